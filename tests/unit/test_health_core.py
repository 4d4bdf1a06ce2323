"""The health manager's pure decisions (HealthCore): tables on a fake clock.

No processes, no server: what the manager decides for each sequence of
starts, beats, exits and outages. The drills with real processes are in
test_chaos.py.
"""

from __future__ import annotations

import msgspec
import pytest

from joynexus.agents.health import HealthCore, Heartbeat, RestartBudget


def _hb(instance: str, pid: int, beats: int = 1, errors: int = 0) -> Heartbeat:
    return Heartbeat(
        role="actor",
        instance=instance,
        pid=pid,
        host="h",
        started_at=0.0,
        at=0.0,
        beats=beats,
        interval_s=1.0,
        errors=errors,
    )


def test_core_missing_beats_restart_then_budget_then_global_then_give_up() -> None:
    core = HealthCore(
        heartbeat_s=1.0,
        miss_after=2.5,
        budget=RestartBudget(max_restarts=2, window_s=100, max_global=1, global_window_s=100),
    )
    core.own("actor", "actor-0")
    core.own("scheduler", "scheduler-0")
    now = 0.0
    for pid in (10, 11, 12, 13, 14, 15):
        core.on_started("actor-0", now, pid)
        assert core.on_beat(_hb("actor-0", pid), now) == []
        assert core.check(now + 2.4) == []  # within 2.5 intervals: fine
        [d] = core.check(now + 2.6)
        now += 3.0
        if pid in (10, 11, 13, 14):  # a global restart gives every slot a fresh budget
            assert d.action == "restart" and "no heartbeat for 2.6s" in d.reason, d
            assert d.detect_s == pytest.approx(2.6) and d.restarts_in_window == (pid - 9) % 3
        elif pid == 12:  # budget spent: everybody restarts
            assert d.action == "global_restart" and "budget spent" in d.reason
            assert core.slots["scheduler-0"].state == "restarting"
            core.on_started("scheduler-0", now, 99)
        else:  # the global budget is spent too: left down, loudly
            assert d.action == "give_up" and core.slots["actor-0"].state == "failed"
    # A beat from a replaced incarnation changes nothing.
    core.on_started("scheduler-0", now, 100)
    core.on_beat(_hb("scheduler-0", 99), now)
    assert core.slots["scheduler-0"].state == "starting"


def test_core_exit_burst_reconnect_and_watch_mode() -> None:
    core = HealthCore(heartbeat_s=1.0, burst_errors=5, burst_window_s=10, coord_lost_s=30)
    core.own("actor", "a")
    core.on_started("a", 0.0, 1)
    [d] = core.on_exit("a", -9, 1.0)
    assert d.action == "restart" and d.reason == "process exited with -9"
    core.on_started("a", 1.0, 2)
    assert core.on_beat(_hb("a", 2, errors=1), 2.0) == []
    [d] = core.on_beat(_hb("a", 2, errors=7), 3.0)
    assert d.action == "restart" and d.reason.startswith("error burst: 7 errors")
    core.on_started("a", 3.0, 3)
    core.on_beat(_hb("a", 3), 4.0)
    # No decisions while disconnected; a short outage gives a grace window, a long
    # one means coordination was lost: global restart.
    core.on_disconnect(5.0)
    assert core.check(20.0) == []
    assert core.on_reconnect(21.0) == []
    assert core.check(25.0) == []  # inside the reconnect grace
    core.on_beat(_hb("a", 3), 25.0)
    core.on_disconnect(30.0)
    [d] = core.on_reconnect(70.0)
    assert d.action == "global_restart" and "NATS unreachable for 40.0s" in d.reason
    # Watch mode: instances nobody owns are reported lost, then recovered.
    w = HealthCore(heartbeat_s=1.0)
    w.on_beat(_hb("x", 5), 0.0)
    [d] = w.check(3.0)
    assert d.action == "lost" and w.check(4.0) == []
    [d] = w.on_beat(_hb("x", 5, beats=2), 5.0)
    assert d.action == "recovered"


# (what, beat's loop lag, seconds since the last beat or start, runnable, restart?)
TIMING_ROWS = [
    # start_grace_s (20): a started process that never beats
    ("start", None, 19.9, False, False),
    ("start", None, 20.1, False, True),
    # busy_miss_s (8): late beats of a runnable process are a busy one, until 8 s
    ("late", None, 2.6, True, False),
    ("late", None, 7.9, True, False),
    ("late", None, 8.1, True, True),
    ("late", None, 2.6, False, True),  # not runnable: missing at miss_after x heartbeat_s
    # hang_after_s (5): beats that say the event loop has not run for that long
    ("lag", 4.9, 0.0, True, False),
    ("lag", 5.1, 0.0, True, True),
]


@pytest.mark.parametrize(("what", "lag", "after", "runnable", "restart"), TIMING_ROWS)
def test_the_timing_bounds(
    what: str, lag: float | None, after: float, runnable: bool, restart: bool
) -> None:
    """``start_grace_s``, ``busy_miss_s`` and ``hang_after_s`` each at both sides of
    their bound; the reason names the bound that was passed."""
    core = HealthCore(heartbeat_s=1.0, miss_after=2.5, start_grace_s=20.0, busy_miss_s=8.0,
                      hang_after_s=5.0)
    core.own("actor", "actor-0")
    core.on_started("actor-0", 0.0, 10)
    if what == "start":
        out = core.check(after)
        want = "no heartbeat within 20s of start"
    elif what == "late":
        assert core.on_beat(_hb("actor-0", 10), 0.0) == []
        out = core.check(after, {"actor-0": runnable})
        want = "(> 8s while runnable)" if runnable else "(> 2.5 x 1s)"
    else:
        hb = msgspec.structs.replace(_hb("actor-0", 10), loop_lag_s=lag)
        out = core.on_beat(hb, 0.0)
        want = "event loop frozen for"
    assert [d.action for d in out] == (["restart"] if restart else [])
    if restart:
        assert want in out[0].reason, out[0].reason
