"""The penalty box's bookkeeping: the door's count (agents/control/door.py) and the
pauses the auth sync applies (ops/runtime/penaltybox.py)."""

from __future__ import annotations

from joynexus.agents.control.door import MAX_STRIKES, DoorCount
from joynexus.ops.runtime.penaltybox import MAX_PAUSE_S, PenaltyBox
from joynexus.schemas.base import encode
from joynexus.schemas.identities import Penalty, is_bookkeeping_key, penalised_tenant, penalty_key


def _flood(door: DoorCount, tenant: str, start: float, n: int, limit: int = 100, penalty_s: float = 10.0):
    pauses = []
    for i in range(n):
        p = door.hit(tenant, start + i * 0.5 / n, limit, penalty_s)
        if p is not None:
            pauses.append(p)
    return pauses


def test_a_tenant_over_its_rate_is_paused_once_and_others_are_not() -> None:
    door = DoorCount()
    assert _flood(door, "vera", 1000.0, 100) == []  # at the limit: fine
    pauses = _flood(door, "mallory", 1000.0, 1000)
    assert len(pauses) == 1
    until, rate, strikes = pauses[0]
    assert rate == 101 and strikes == 1 and until > 1000.0 + 9.9
    assert door.paused("mallory", 1005.0) and not door.paused("vera", 1005.0)
    assert not door.paused("mallory", until + 0.01)


def test_a_flood_that_goes_on_doubles_the_pause_up_to_a_bound_and_is_forgiven_later() -> None:
    door = DoorCount()
    t = 0.0
    lengths = []
    for _ in range(MAX_STRIKES + 2):
        (until, _, _), = _flood(door, "mallory", t, 500)
        lengths.append(round(until - t))
        t = until + 0.5  # floods again as soon as the pause ends
    assert lengths[:3] == [10, 20, 40] and max(lengths) == 10 * 2 ** (MAX_STRIKES - 1)
    (until, _, strikes), = _flood(door, "mallory", t + 10_000, 500)
    assert strikes == 1


def test_a_limit_of_zero_turns_the_count_off() -> None:
    assert _flood(DoorCount(), "mallory", 0.0, 10_000, limit=0) == []


def test_penalty_records_are_bounded_and_checked() -> None:
    box = PenaltyBox()
    rec = encode(Penalty(tenant_id="mallory", until=1e12, rate=9000))
    until = box.update("JNX_IDENTITIES", "mallory", rec, now=100.0)
    assert until == 100.0 + MAX_PAUSE_S  # a record cannot lock a tenant out for long
    assert box.paused("JNX_IDENTITIES", 101.0) == {"mallory"}
    assert box.paused("OTHER_IDENTITIES", 101.0) == set()
    assert box.paused("JNX_IDENTITIES", until + 1) == set()
    # A record naming another tenant than its key, or that does not decode, pauses no one.
    assert box.update("JNX_IDENTITIES", "vera", rec, now=100.0) is None
    assert box.update("JNX_IDENTITIES", "vera", b"{not json", now=100.0) is None
    assert box.paused("JNX_IDENTITIES", 101.0) == {"mallory"}
    assert box.update("JNX_IDENTITIES", "mallory", None, now=100.0) is None  # deleted
    assert box.paused("JNX_IDENTITIES", 101.0) == set()


def test_penalty_keys_are_bookkeeping_not_tenants() -> None:
    assert penalised_tenant(penalty_key("mallory")) == "mallory"
    assert is_bookkeeping_key(penalty_key("mallory")) and is_bookkeeping_key("_applied.n1")
    assert not is_bookkeeping_key("mallory") and penalised_tenant("mallory") is None


def test_training_queue_bytes_are_paced_to_the_tenants_rate() -> None:
    from joynexus.agents.control.door import IngressPace

    pace = IngressPace()
    mib = 1 << 20
    # One second's bytes go at once; the rest waits its turn, per tenant.
    assert pace.delay("mallory", 16 * mib, 0.0, 16 * mib) == 0.0
    assert pace.delay("mallory", 8 * mib, 0.0, 16 * mib) == 0.5
    assert pace.delay("mallory", 8 * mib, 0.0, 16 * mib) == 1.0
    assert pace.delay("vera", 4 * mib, 0.0, 16 * mib) == 0.0
    # Two seconds later the debt is paid and one second's bytes are back, no more.
    assert pace.delay("mallory", 16 * mib, 3.0, 16 * mib) == 0.0
    assert pace.delay("mallory", 1, 3.0, 0) == 0.0  # 0: no pacing
