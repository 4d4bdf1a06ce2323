"""The health manager's decisions, pure: ``now`` is passed in, nothing is sent.

:class:`HealthCore` turns beats, process exits, TTL expiries and the manager's
connection state into :class:`~joynexus.schemas.health.HealthDecision` s (restart
a slot, restart every slot, give up; or, for a slot it does not own, ``lost`` /
``recovered``), spending a :class:`RestartBudget`; the manager's loop
(:mod:`.manager`) carries them out. Kept apart so its tables run without a
server or a process (``tests/unit/test_health_core.py``); see docs/ARCHITECTURE.md
("Health: heartbeats and in-place restarts").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from joynexus.schemas.health import Action, HealthDecision, Heartbeat

HEARTBEAT_S = 1.0
#: How many heartbeat intervals without a beat make an agent missing.
MISS_AFTER = 2.5


def ttl_for(heartbeat_s: float, miss_after: float = MISS_AFTER) -> int:
    """A beat's TTL in whole seconds (the server's unit; at least 1)."""
    return max(1, math.ceil(miss_after * heartbeat_s))


@dataclass(frozen=True)
class RestartBudget:
    """Restarts a slot may make per ``window_s``, and global restarts per ``global_window_s``."""

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
