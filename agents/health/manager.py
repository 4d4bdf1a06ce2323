"""Heartbeats, error reports and the health manager that restarts failed roles in place.

Every agent process beats into KV ``<NS>_HEALTH`` under ``hb.<role>.<instance>``
(:class:`Heartbeat`: pid, host, started_at, beats, errors, last error) with a
per-message TTL, so a dead or frozen agent's key expires and the server writes
a purge marker (the bucket's stream has ``allow_msg_ttl`` and
``subject_delete_marker_ttl``). Errors an agent logs are counted into its beat
and reported as ``system`` metric events (``event="error"``).

The health manager (:class:`HealthManager`) has two modes:

* **supervise** (``joynexus up``: the launcher *is* the health manager): it
  owns one child process per :class:`RoleSlot` (``joynexus agent <role>
  --instance <slot>``), and restarts a slot in place, same instance name and
  same arguments, when its process exits, its heartbeat is missing for
  ``miss_after`` intervals (a SIGSTOPped or hung process is SIGKILLed first),
  its key expires, or it reports an error burst. The restarted role resumes
  from its durable consumer, the event log and its checkpoint; nothing else
  is touched. Each slot has a restart budget (``max_restarts`` per
  ``window_s``); a slot that spends it, or a NATS outage longer than
  ``coord_lost_s`` (shared coordination lost), triggers a global restart of
  every slot, itself budgeted (``max_global`` per ``global_window_s``); past
  that the slot is given up and left down, loudly.
* **watch** (``joynexus agent health --nats URL``, no slots): it owns no
  processes, so it only watches heartbeats and reports ``suspect`` /
  ``lost`` / ``recovered`` decisions for every role of the namespace.

Every decision is a :class:`HealthDecision` published as a metric event of
kind ``health`` (``<ns>.metrics.health._``, kept by the metrics stream), and
the manager's current view (:class:`SupervisorState`: slots, pids, restarts,
the last decisions) is written to ``mgr.<instance>`` in the health bucket,
which ``joynexus status`` reads.

The decisions are made by :class:`HealthCore`, pure (``now`` is passed in),
and carried out by the manager's thin loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from joynexus.agents.procs import die_with_parent
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.headers import TTL
from joynexus.broker.subjects import ALL_HEARTBEATS, HEALTH_KIND, kv_subject

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
#: Roles whose processes another supervisor owns (environment workers: role
#: producer-rl's); a supervising manager that does not own them ignores their beats.
SUPERVISED_ELSEWHERE = ("env-worker",)
#: How many heartbeat intervals without a beat make an agent missing.
MISS_AFTER = 2.5

Action = Literal[
    "started", "restart", "global_restart", "give_up", "suspect", "lost", "recovered", "stopped"
]


class Heartbeat(msgspec.Struct, kw_only=True):
    """One beat of one agent process (value of ``hb.<role>.<instance>``)."""

    role: str
    instance: str
    pid: int
    host: str
    started_at: float
    at: float
    beats: int
    interval_s: float
    state: Literal["running", "stopped", "crashed"] = "running"
    errors: int = 0
    last_error: str = ""
    #: How long the agent's event loop has not run (0: responsive).
    loop_lag_s: float = 0.0


class HealthDecision(msgspec.Struct, kw_only=True):
    """What the health manager decided, and why (published as a ``health`` metric)."""

    action: Action
    role: str = ""
    instance: str = ""
    reason: str = ""
    at: float = 0.0
    by: str = ""
    pid: int | None = None
    exit_code: int | None = None
    #: Seconds from the last sign of life to the decision (missing beats).
    detect_s: float | None = None
    restarts_in_window: int = 0


class SlotState(msgspec.Struct, kw_only=True):
    role: str
    instance: str
    state: Literal["starting", "running", "restarting", "failed", "stopped", "watched"]
    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    last_reason: str = ""
    beat_age_s: float | None = None
    beats: int = 0
    errors: int = 0
    last_error: str = ""
    #: What the slot runs for, when its supervisor says (an environment worker: its workload).
    detail: str = ""


class SupervisorState(msgspec.Struct, kw_only=True):
    """Value of ``mgr.<instance>``: what ``joynexus status`` shows."""

    instance: str
    mode: Literal["supervise", "watch"]
    host: str
    pid: int
    at: float
    connected: bool
    global_restarts: int
    slots: list[SlotState]
    decisions: list[HealthDecision]


# ---------------------------------------------------------------- the pure core


@dataclass(frozen=True)
class RestartBudget:
    max_restarts: int = 5
    window_s: float = 300.0
    max_global: int = 2
    global_window_s: float = 900.0


@dataclass
class _Slot:
    role: str
    instance: str
    owned: bool
    state: str = "starting"
    started_at: float = 0.0
    last_beat_at: float | None = None
    beats: int = 0
    errors: int = 0
    last_error: str = ""
    restarts: deque[float] = field(default_factory=deque)
    total_restarts: int = 0
    error_marks: deque[tuple[float, int]] = field(default_factory=deque)
    suspect: bool = False
    last_exit: int | None = None
    last_reason: str = ""
    pid: int | None = None


@dataclass
class HealthCore:
    """Decides restarts from beats, exits, expiries and connection state. No I/O, no clock."""

    heartbeat_s: float = HEARTBEAT_S
    miss_after: float = MISS_AFTER
    start_grace_s: float = 180.0
    burst_errors: int = 20
    burst_window_s: float = 10.0
    coord_lost_s: float = 30.0
    #: Late beats of a process the kernel shows runnable: busy until this, then dead.
    busy_miss_s: float = 30.0
    #: An agent whose event loop has not run for this long is hung (beats still come).
    hang_after_s: float = 120.0
    #: After the manager's own reconnect, missing beats are not acted on for this long.
    reconnect_grace_s: float = 10.0
    budget: RestartBudget = field(default_factory=RestartBudget)
    slots: dict[str, _Slot] = field(default_factory=dict)
    global_restarts: deque[float] = field(default_factory=deque)
    disconnected_at: float | None = None

    @property
    def missing_after_s(self) -> float:
        return self.miss_after * self.heartbeat_s

    # -- observations
    def own(self, role: str, instance: str) -> None:
        self.slots[instance] = _Slot(role, instance, owned=True)

    def on_started(self, instance: str, now: float, pid: int | None = None) -> None:
        s = self.slots[instance]
        s.state, s.started_at, s.last_beat_at, s.suspect = "starting", now, None, False
        s.pid = pid
        s.beats = s.errors = 0
        s.error_marks.clear()

    def on_beat(self, hb: Heartbeat, now: float) -> list[HealthDecision]:
        s = self.slots.get(hb.instance)
        if s is None:
            s = self.slots[hb.instance] = _Slot(hb.role, hb.instance, owned=False, started_at=now)
        out: list[HealthDecision] = []
        if hb.state != "running":
            s.state = hb.state if not s.owned else s.state
            return out
        if s.owned and (s.state not in ("starting", "running") or (s.pid and hb.pid != s.pid)):
            return out  # a beat from a process we are replacing (or replaced)
        if s.suspect and not s.owned:
            out.append(self._d("recovered", s, "heartbeats resumed", now))
        s.suspect = False
        s.state = "running" if s.owned else "watched"
        # max(): a reconnect grace (a last_beat_at in the future) outlasts early beats.
        s.last_beat_at = now if s.last_beat_at is None else max(now, s.last_beat_at)
        s.beats = hb.beats
        if hb.errors > s.errors:
            s.error_marks.append((now, hb.errors - s.errors))
        s.errors, s.last_error = hb.errors, hb.last_error or s.last_error
        while s.error_marks and s.error_marks[0][0] < now - self.burst_window_s:
            s.error_marks.popleft()
        if s.owned and hb.loop_lag_s > self.hang_after_s:
            return out + self._restart(
                s, f"event loop frozen for {hb.loop_lag_s:.1f}s (> {self.hang_after_s:g}s)", now
            )
        burst = sum(n for _, n in s.error_marks)
        if s.owned and burst >= self.burst_errors:
            out += self._restart(
                s,
                f"error burst: {burst} errors in {self.burst_window_s:g}s "
                f"(last: {s.last_error[:200]})",
                now,
            )
        return out

    def on_expired(self, instance: str, now: float) -> list[HealthDecision]:
        """The server's TTL marker: no beat for the key's TTL."""
        s = self.slots.get(instance)
        if s is None or s.state not in ("running", "watched") or self.disconnected_at is not None:
            return []
        if s.owned:
            return []  # supervise mode: check() knows the process state and decides
        return self._missing(s, "heartbeat key expired (TTL marker)", now)

    def on_exit(self, instance: str, code: int, now: float) -> list[HealthDecision]:
        s = self.slots[instance]
        s.last_exit = code
        if s.state not in ("starting", "running"):
            return []  # we killed it ourselves, or it is given up
        return self._restart(s, f"process exited with {code}", now, exit_code=code)

    def on_disconnect(self, now: float) -> None:
        if self.disconnected_at is None:
            self.disconnected_at = now

    def on_reconnect(self, now: float) -> list[HealthDecision]:
        since, self.disconnected_at = self.disconnected_at, None
        # Beats could not arrive, and agents reconnect on their own schedule (JetStream
        # also needs a moment after a server restart): everyone gets a grace window.
        for s in self.slots.values():
            if s.last_beat_at is not None:
                s.last_beat_at = max(s.last_beat_at, now + self.reconnect_grace_s)
            s.started_at = max(s.started_at, now + self.reconnect_grace_s)
        if since is not None and now - since > self.coord_lost_s:
            return self._global(
                f"NATS unreachable for {now - since:.1f}s (> coord_lost_s {self.coord_lost_s:g})",
                now,
            )
        return []

    def check(self, now: float, runnable: Mapping[str, bool] | None = None) -> list[HealthDecision]:
        """Periodic: missing heartbeats.

        ``runnable`` (supervise mode) says which owned processes the kernel
        shows as running or sleeping: one of those whose beats are late is
        busy (a simulator step can hold the GIL for seconds), and is
        restarted only past ``busy_miss_s``; a stopped, zombie or vanished
        one is restarted at ``miss_after`` intervals.
        """
        if self.disconnected_at is not None:
            return []
        runnable = runnable or {}
        out: list[HealthDecision] = []
        for s in list(self.slots.values()):
            if s.state in ("running", "watched") and s.last_beat_at is not None:
                late = now - s.last_beat_at
                if late <= self.missing_after_s or s.suspect:
                    continue
                if s.owned and runnable.get(s.instance) and late <= self.busy_miss_s:
                    continue
                out += self._missing(
                    s,
                    f"no heartbeat for {late:.1f}s "
                    + (
                        f"(> {self.miss_after:g} x {self.heartbeat_s:g}s)"
                        if late <= self.busy_miss_s
                        else f"(> {self.busy_miss_s:g}s while runnable)"
                    ),
                    now,
                    detect_s=late,
                )
            elif s.owned and s.state == "starting" and now - s.started_at > self.start_grace_s:
                out += self._restart(
                    s, f"no heartbeat within {self.start_grace_s:g}s of start", now
                )
        return out

    # -- decisions
    def _d(self, action: Action, s: _Slot, reason: str, now: float, **kw: Any) -> HealthDecision:
        return HealthDecision(
            action=action,
            role=s.role,
            instance=s.instance,
            reason=reason,
            at=now,
            restarts_in_window=len(s.restarts),
            **kw,
        )

    def _missing(self, s: _Slot, reason: str, now: float, **kw: Any) -> list[HealthDecision]:
        if s.owned:
            return self._restart(s, reason, now, **kw)
        s.suspect = True
        return [self._d("lost", s, reason, now, **kw)]

    def _restart(self, s: _Slot, reason: str, now: float, **kw: Any) -> list[HealthDecision]:
        while s.restarts and s.restarts[0] < now - self.budget.window_s:
            s.restarts.popleft()
        s.last_reason = reason
        if len(s.restarts) >= self.budget.max_restarts:
            why = (
                f"{reason}; restart budget spent ({len(s.restarts)} restarts in "
                f"{self.budget.window_s:g}s)"
            )
            return self._global(why, now, failed=s, **kw)
        s.restarts.append(now)
        s.total_restarts += 1
        s.state = "restarting"
        return [self._d("restart", s, reason, now, **kw)]

    def _global(
        self, reason: str, now: float, failed: _Slot | None = None, **kw: Any
    ) -> list[HealthDecision]:
        while self.global_restarts and self.global_restarts[0] < now - self.budget.global_window_s:
            self.global_restarts.popleft()
        if len(self.global_restarts) >= self.budget.max_global:
            if failed is None:
                return [
                    HealthDecision(
                        action="give_up", reason=f"{reason}; global restart budget spent", at=now
                    )
                ]
            failed.state = "failed"
            return [
                self._d(
                    "give_up",
                    failed,
                    f"{reason}; global restart budget spent "
                    f"({len(self.global_restarts)} in {self.budget.global_window_s:g}s): "
                    "left down",
                    now,
                    **kw,
                )
            ]
        self.global_restarts.append(now)
        for s in self.slots.values():
            if s.owned and s.state != "failed":
                s.state = "restarting"
                s.restarts.clear()
        return [
            HealthDecision(
                action="global_restart",
                role=failed.role if failed else "",
                instance=failed.instance if failed else "",
                reason=reason,
                at=now,
                **kw,
            )
        ]


# ---------------------------------------------------------------- agents' side


class _ErrorCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        with contextlib.suppress(Exception):
            self.last = f"{record.name}: {record.getMessage()}"[:500]


def ttl_for(heartbeat_s: float, miss_after: float = MISS_AFTER) -> int:
    """A beat's TTL in whole seconds (the server's unit; at least 1)."""
    return max(1, math.ceil(miss_after * heartbeat_s))


class Heartbeater:
    """Beats for one agent process from a thread with its own NATS connection.

    A thread, so that an agent that blocks its event loop for a while (a
    simulator step, an import) is not taken for dead; the beat carries the
    event loop's lag (``loop_lag_s``), and the manager restarts an agent
    whose loop stays frozen past ``HealthCore.hang_after_s``. SIGSTOP or a
    crash stops the thread too.
    """

    def __init__(
        self, b: Broker, role: str, instance: str, *, interval_s: float = HEARTBEAT_S
    ) -> None:
        self.b = b
        self.role, self.instance = role, instance
        self.interval_s = interval_s
        self.key = b.names.heartbeat_key(role, instance)
        self.subject = kv_subject(b.names.health_bucket, self.key)
        self.started_at = time.time()
        self.beats = 0
        self.errors = _ErrorCounter()
        self._reported = 0
        self._loop_seen = time.monotonic()
        self._done = threading.Event()
        self._final_state = "stopped"

    async def beat(self, b: Broker, state: str = "running", ttl_s: int | None = None) -> None:
        self.beats += 1
        hb = Heartbeat(
            role=self.role,
            instance=self.instance,
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=self.started_at,
            at=time.time(),
            beats=self.beats,
            interval_s=self.interval_s,
            state=state,  # type: ignore[arg-type]
            errors=self.errors.count,
            last_error=self.errors.last,
            loop_lag_s=round(max(0.0, time.monotonic() - self._loop_seen - self.interval_s), 3),
        )
        ttl = ttl_s or ttl_for(self.interval_s)
        await b.js.publish(
            self.subject,
            msgspec.json.encode(hb),
            headers={TTL: f"{ttl}s"},
            timeout=max(0.25, 0.9 * self.interval_s),
        )
        if self.errors.count > self._reported:
            await metrics.emit(
                b,
                "system",
                event="error",
                role=self.role,
                instance=self.instance,
                errors=self.errors.count,
                new=self.errors.count - self._reported,
                last_error=self.errors.last,
            )
            self._reported = self.errors.count

    async def _beat_forever(self, servers: list[str]) -> None:
        b = await Broker.connect(
            servers, name=f"{self.instance}-heartbeat", namespace=self.b.names.namespace
        )
        loop = asyncio.get_running_loop()
        try:
            while not self._done.is_set():
                t0 = loop.time()
                try:
                    await self.beat(b)
                except Exception as e:  # disconnected: the next beat tries again
                    log.debug("heartbeat %s failed: %s", self.key, e)
                # A fixed cadence: a slow publish does not stretch the interval.
                await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - t0)))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.beat(b, self._final_state, ttl_s=60), 2.0)
        finally:
            await b.close()

    def _thread(self, servers: list[str]) -> None:
        try:
            asyncio.run(self._beat_forever(servers))
        except Exception as e:
            log.warning("heartbeat thread of %s ended: %s", self.key, e)

    async def _tick(self) -> None:
        while True:
            self._loop_seen = time.monotonic()
            await asyncio.sleep(self.interval_s / 2)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Heartbeater]:
        servers = [u.geturl() for u in self.b.nc.servers] or ["nats://127.0.0.1:4222"]
        logging.getLogger().addHandler(self.errors)
        tick = asyncio.create_task(self._tick(), name=f"heartbeat-tick-{self.key}")
        thread = threading.Thread(
            target=self._thread, args=(servers,), name=f"heartbeat-{self.key}", daemon=True
        )
        thread.start()
        try:
            yield self
        except BaseException as e:
            self._final_state = "crashed"
            self.errors.count += 1
            self.errors.last = f"{type(e).__name__}: {e}"[:500]
            raise
        finally:
            tick.cancel()
            with contextlib.suppress(BaseException):
                await tick
            logging.getLogger().removeHandler(self.errors)
            self._done.set()
            await asyncio.to_thread(thread.join, 5.0)


# ---------------------------------------------------------------- the manager


@dataclass
class RoleSlot:
    """One supervised process: restarted with exactly these arguments."""

    role: str
    instance: str
    argv: list[str]
    env: Mapping[str, str] | None = None


def _open_log(path: Path) -> Any:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("ab")


class HealthManager:
    def __init__(
        self,
        b: Broker,
        slots: list[RoleSlot] | None = None,
        *,
        instance: str = "health-0",
        core: HealthCore | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        kill_grace_s: float = 10.0,
        keep_decisions: int = 50,
        mode: Literal["supervise", "watch"] | None = None,
        watch_keys: str = ALL_HEARTBEATS,
        owned_only: bool = False,
    ) -> None:
        """``mode`` defaults to supervise with slots and watch without; a supervisor
        whose slots come and go (:meth:`add_slot`, :meth:`remove_slot`) passes
        ``mode="supervise"``. ``watch_keys`` filters the heartbeats it reads and
        ``owned_only`` ignores beats of instances it does not own."""
        self.b = b
        self.instance = instance
        self.core = core or HealthCore()
        self.slots = {s.instance: s for s in slots or []}
        self.mode: Literal["supervise", "watch"] = mode or ("supervise" if slots else "watch")
        self.watch_keys = watch_keys
        self.owned_only = owned_only
        #: Per instance: what it runs for (shown as SlotState.detail).
        self.details: dict[str, str] = {}
        for s in self.slots.values():
            self.core.own(s.role, s.instance)
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.log_dir = Path(log_dir) if log_dir else None
        self.kill_grace_s = kill_grace_s
        self.decisions: deque[HealthDecision] = deque(maxlen=keep_decisions)
        self.detect_s: dict[str, float] = {}
        self._waiters: dict[str, asyncio.Task[None]] = {}
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._clock = time.monotonic
        self._removals: set[asyncio.Task[None]] = set()

    # -- slots that come and go (processed on the manager's loop)
    def add_slot(self, slot: RoleSlot) -> None:
        """Own and start ``slot`` (supervise mode); restarted in place like the others."""
        self._events.put_nowait(("add", slot))

    async def remove_slot(self, instance: str) -> int | None:
        """Stop ``instance`` (SIGTERM, SIGKILL after the grace) and forget it; returns
        its exit code once it is gone (None if it was not running)."""
        done: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._events.put_nowait(("remove", (instance, done)))
        return await done

    def _add(self, slot: RoleSlot) -> list[Any]:
        self.slots[slot.instance] = slot
        self.core.own(slot.role, slot.instance)
        return [self._spawn(slot)]

    def _remove(self, instance: str, done: asyncio.Future[int | None]) -> None:
        s = self.core.slots.pop(instance, None)
        if s is not None:
            s.state = "stopped"
        self.slots.pop(instance, None)
        self.details.pop(instance, None)
        proc = self.procs.pop(instance, None)
        waiter = self._waiters.pop(instance, None)

        async def stop_it() -> None:
            code: int | None = None
            try:
                if proc is not None and proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGCONT)
                        proc.terminate()
                    try:
                        await asyncio.wait_for(proc.wait(), self.kill_grace_s)
                    except TimeoutError:
                        with contextlib.suppress(ProcessLookupError):
                            proc.kill()
                        await proc.wait()
                code = proc.returncode if proc is not None else None
                if waiter is not None:
                    waiter.cancel()
                if proc is not None:
                    await self._publish(
                        HealthDecision(
                            action="stopped",
                            role=s.role if s else "",
                            instance=instance,
                            pid=proc.pid,
                            exit_code=code,
                            reason="slot removed by its supervisor",
                            at=self._clock(),
                        )
                    )
            finally:
                if not done.done():
                    done.set_result(code)

        task = asyncio.create_task(stop_it())
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    # -- processes
    async def _spawn(self, slot: RoleSlot) -> None:
        out: Any = None
        if self.log_dir is not None:
            out = await asyncio.to_thread(_open_log, self.log_dir / f"{slot.instance}.log")
        env = {**os.environ, **slot.env} if slot.env else None
        try:
            proc = await asyncio.create_subprocess_exec(
                *slot.argv, stdout=out, stderr=out, env=env, preexec_fn=die_with_parent
            )
        finally:
            if out is not None:
                out.close()
        self.procs[slot.instance] = proc
        self.core.on_started(slot.instance, self._clock(), proc.pid)
        self._waiters[slot.instance] = asyncio.create_task(self._wait(slot.instance, proc))
        await self._publish(
            HealthDecision(
                action="started",
                role=slot.role,
                instance=slot.instance,
                pid=proc.pid,
                reason="process started",
                at=self._clock(),
            )
        )

    async def _wait(self, instance: str, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        await self._events.put(("exit", (instance, proc, code)))

    async def _kill(self, instance: str, *, graceful: bool) -> None:
        proc = self.procs.get(instance)
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if graceful:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), self.kill_grace_s)
                    return
                except TimeoutError:
                    pass
            proc.kill()
        await proc.wait()

    # -- events
    async def _publish(self, d: HealthDecision) -> None:
        d.by = self.instance
        self.decisions.append(d)
        level = logging.INFO if d.action in ("started", "recovered", "stopped") else logging.WARNING
        log.log(level, "health %s %s: %s", d.action, d.instance or "*", d.reason)
        fields = msgspec.to_builtins(d)
        fields["decision"] = fields.pop("action")
        await metrics.emit(self.b, HEALTH_KIND, **fields)

    async def _carry_out(self, decisions: list[HealthDecision]) -> None:
        for d in decisions:
            d.pid = d.pid or (self.procs[d.instance].pid if d.instance in self.procs else None)
            await self._publish(d)
            if d.action == "restart":
                if d.detect_s is not None:
                    self.detect_s[d.instance] = d.detect_s
                await self._kill(d.instance, graceful=False)  # it is dead, stopped or hung
                await self._spawn(self.slots[d.instance])
            elif d.action == "global_restart":
                for inst in self.slots:
                    await self._kill(inst, graceful=True)
                for slot in self.slots.values():
                    if self.core.slots[slot.instance].state != "failed":
                        await self._spawn(slot)
            elif d.action == "give_up" and d.instance in self.slots:
                await self._kill(d.instance, graceful=False)

    def _runnable(self) -> dict[str, bool]:
        """Owned processes the kernel shows running or sleeping (not stopped, not zombie)."""
        out = {}
        for instance, proc in self.procs.items():
            try:
                stat = Path(f"/proc/{proc.pid}/stat").read_text()
                out[instance] = stat.rsplit(")", 1)[1].split()[0] in ("R", "S", "D")
            except (OSError, IndexError):
                out[instance] = False
        return out

    def state(self) -> SupervisorState:
        now = self._clock()
        slots = []
        for s in self.core.slots.values():
            proc = self.procs.get(s.instance)
            slots.append(
                SlotState(
                    role=s.role,
                    instance=s.instance,
                    state=s.state if s.owned else "watched",  # type: ignore[arg-type]
                    pid=proc.pid if proc and proc.returncode is None else None,
                    restarts=s.total_restarts,
                    last_exit=s.last_exit,
                    last_reason=s.last_reason,
                    beat_age_s=None if s.last_beat_at is None else round(now - s.last_beat_at, 3),
                    beats=s.beats,
                    errors=s.errors,
                    last_error=s.last_error,
                    detail=self.details.get(s.instance, ""),
                )
            )
        return SupervisorState(
            instance=self.instance,
            mode=self.mode,
            host=socket.gethostname(),
            pid=os.getpid(),
            at=time.time(),
            connected=self.b.nc.is_connected,
            global_restarts=len(self.core.global_restarts),
            slots=slots,
            decisions=list(self.decisions)[-20:],
        )

    async def _watch_beats(self, kv: Any) -> None:
        while True:
            try:
                watcher = await kv.watch(self.watch_keys)
                while True:
                    try:
                        entry = await watcher.updates(timeout=5.0)
                    except Exception:  # nats-py raises its TimeoutError here
                        continue
                    if entry is None:
                        continue
                    if entry.operation in ("PURGE", "DEL") or not entry.value:
                        instance = entry.key.split(".", 2)[-1]
                        await self._events.put(("expired", instance))
                        continue
                    try:
                        hb = msgspec.json.decode(entry.value, type=Heartbeat)
                    except msgspec.DecodeError:
                        continue
                    await self._events.put(("beat", hb))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the server went away: watch again once it is back
                log.debug("heartbeat watch failed: %s", e)
                await asyncio.sleep(self.core.heartbeat_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Start the slots (supervise mode), then decide until ``stop``; stops the slots after."""
        kv = await self.b.js.key_value(self.b.names.health_bucket)
        for slot in self.slots.values():
            await self._spawn(slot)
        watch = asyncio.create_task(self._watch_beats(kv))
        tick = min(0.2, self.core.heartbeat_s / 5)
        last_state = 0.0
        try:
            while not stop.is_set():
                try:
                    kind, payload = await asyncio.wait_for(self._events.get(), tick)
                except TimeoutError:
                    kind, payload = "tick", None
                now = self._clock()
                decisions: list[HealthDecision] = []
                if kind == "add":
                    for spawn in self._add(payload):
                        await spawn
                    continue
                if kind == "remove":
                    self._remove(*payload)
                    continue
                if kind in ("beat", "expired"):
                    who = payload.instance if kind == "beat" else payload
                    role = payload.role if kind == "beat" else ""
                    if who not in self.slots and (
                        self.owned_only or (self.mode == "supervise" and role in SUPERVISED_ELSEWHERE)
                    ):
                        kind = "tick"
                if kind == "beat":
                    decisions = self.core.on_beat(payload, now)
                elif kind == "expired":
                    decisions = self.core.on_expired(payload, now)
                elif kind == "exit":
                    instance, proc, code = payload
                    if self.procs.get(instance) is proc:  # not an old incarnation we replaced
                        decisions = self.core.on_exit(instance, code, now)
                connected = self.b.nc.is_connected
                if not connected:
                    self.core.on_disconnect(now)
                elif self.core.disconnected_at is not None:
                    decisions += self.core.on_reconnect(now)
                decisions += self.core.check(now, self._runnable())
                await self._carry_out(decisions)
                if now - last_state >= self.core.heartbeat_s and connected:
                    last_state = now
                    with contextlib.suppress(Exception):
                        await self.b.js.publish(
                            kv_subject(self.b.names.health_bucket,
                                       self.b.names.supervisor_key(self.instance)),
                            msgspec.json.encode(self.state()),
                            headers={TTL: f"{max(10, ttl_for(self.core.heartbeat_s) * 4)}s"},
                            timeout=1.0,
                        )
        finally:
            watch.cancel()
            with contextlib.suppress(BaseException):
                await watch
            for s in self.core.slots.values():
                if s.owned:
                    s.state = "stopped"
            await asyncio.gather(*(self._kill(i, graceful=True) for i in self.slots))
            await asyncio.gather(*self._removals, return_exceptions=True)
            for t in self._waiters.values():
                t.cancel()
            await asyncio.gather(*self._waiters.values(), return_exceptions=True)
