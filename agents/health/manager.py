"""The health manager: owns role processes and restarts a failed one in place.

The process-owning side of :class:`~joynexus.agents.health.core.HealthCore`:
it spawns each slot's process (its log, ``dying_with_parent``), feeds the core
the beats it watches, the exits it waits for and its connection state, carries
out the decisions (kill, spawn again with the same arguments), publishes each
as a ``health`` metric event and its view under ``mgr.<instance>``. It lives in
``agents/`` and not ``ops/`` because role producer-rl supervises its
environment workers with it (``agents/envworkers/``), and agents may not
import ops. See docs/ARCHITECTURE.md ("Health: heartbeats and in-place
restarts").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from joynexus.agents.health.core import HealthCore, ttl_for
from joynexus.agents.procs import dying_with_parent
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.headers import TTL
from joynexus.broker.natsapi import kv_subject
from joynexus.broker.subjects import ALL_HEARTBEATS, HEALTH_KIND
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.health import HealthDecision, Heartbeat, SlotState, SupervisorState

log = logging.getLogger(__name__)

#: Roles whose processes another supervisor owns (environment workers: role
#: producer-rl's); a supervising manager that does not own them ignores their beats.
SUPERVISED_ELSEWHERE = ("env-worker",)


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
        argv, preexec = dying_with_parent(slot.argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=out, stderr=out, env=env, preexec_fn=preexec
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
            await cancel_and_wait(watch)
            for s in self.core.slots.values():
                if s.owned:
                    s.state = "stopped"
            await asyncio.gather(*(self._kill(i, graceful=True) for i in self.slots))
            await asyncio.gather(*self._removals, return_exceptions=True)
            for t in self._waiters.values():
                t.cancel()
            await asyncio.gather(*self._waiters.values(), return_exceptions=True)
