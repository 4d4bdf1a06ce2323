"""The batcher's choice (agents/inference/batcher.py) as tables: which requests of an
idle engine's queue run now, or how long the engine waits for company. No server, no
model: each row is the pending requests' tenants, backbone keys and arrival times, the
engine's limits and clock in, a batch (indices into the queue) or a deadline out."""

from __future__ import annotations

import random

import pytest

from joynexus.agents.inference.batcher import (
    Arrival,
    Choice,
    choose,
    part_rows,
    plan,
    row_bound,
    served,
    sharing,
)


def q(*items: str, t: float = 0.0, busy: bool = False) -> list[Arrival]:
    """``"a"`` or ``"a:k2"``: tenant a, backbone key k (default) or k2, all arrived at
    ``t`` (busy: while a batch ran)."""
    out = []
    for s in items:
        tenant, _, key = s.partition(":")
        out.append(Arrival(tenant, key or "k", t, busy))
    return out


W = 0.005  # max_wait_s


@pytest.mark.parametrize(
    ("queue", "last_served", "max_batch", "now", "freed_at", "want"),
    [
        # nothing pending: nothing to run, nothing to wait for
        ([], {}, 16, 1.0, 0.0, Choice()),
        # an idle engine runs a lone request at once (no company is coming)
        (q("a", t=1.0), {}, 16, 1.0, 0.0, Choice(take=(0,))),
        # ... and what arrived together shares the forward
        (q("a", "a", "b", t=1.0), {}, 16, 1.0, 0.0, Choice(take=(0, 2, 1))),
        # a request that arrived at a busy engine waits T from when the engine was freed
        (q("a", t=1.0, busy=True), {}, 16, 1.011, 1.010, Choice(until=1.010 + W)),
        # ... not from its arrival (waiting behind the running batch is not waiting for company)
        (q("a", t=1.0, busy=True), {}, 16, 1.006, 1.010, Choice(until=1.010 + W)),
        # ... and runs when that deadline has passed
        (q("a", t=1.0, busy=True), {}, 16, 1.016, 1.010, Choice(take=(0,))),
        (q("a", t=1.0, busy=True), {}, 16, 1.0151, 1.010, Choice(take=(0,))),
        # arrived after the engine was freed (busy at arrival): T counts from its arrival
        (q("a", t=1.020, busy=True), {}, 16, 1.021, 1.010, Choice(until=1.020 + W)),
        # a full batch runs at once, waiting or not
        (q("a", "b", t=1.0, busy=True), {}, 2, 1.011, 1.010, Choice(take=(0, 1))),
        (q("a", "a", "a", t=1.0, busy=True), {}, 2, 1.011, 1.010, Choice(take=(0, 1))),
        # blocked by an incompatible request behind: waiting cannot grow it, so run now
        (q("a", "a:k2", t=1.0, busy=True), {}, 16, 1.011, 1.010, Choice(take=(0,))),
        # one tenant: the largest FIFO-compatible prefix (its own order is never broken)
        (q("a", "a", "a:k2", "a"), {}, 16, 0.0, 0.0, Choice(take=(0, 1))),
        (q("a:k2", "a", "a"), {}, 16, 0.0, 0.0, Choice(take=(0,))),
        # tenants take turns, one request each per round, then arrival order
        (q("a", "a", "a", "b"), {}, 16, 0.0, 0.0, Choice(take=(0, 3, 1, 2))),
        (q("a", "a", "a", "b"), {}, 3, 0.0, 0.0, Choice(take=(0, 3, 1))),
        (q("a", "a", "a", "b", "c"), {}, 2, 0.0, 0.0, Choice(take=(0, 3))),
        # the tenant served longest ago goes first (never served: before all)
        (q("a", "a", "b"), {"a": 5, "b": 3}, 16, 0.0, 0.0, Choice(take=(2, 0, 1))),
        (q("a", "b", "c"), {"a": 2, "b": 1}, 2, 0.0, 0.0, Choice(take=(2, 1))),
        # the batch's key is that of the first tenant in turn, not of the queue's head
        (q("a", "b:k2"), {"a": 5}, 16, 0.0, 0.0, Choice(take=(1,))),
        # a tenant whose next request cannot share the forward sits this batch out
        (q("a", "b:k2", "a", "c"), {}, 16, 0.0, 0.0, Choice(take=(0, 3, 2))),
        # ... even if it has compatible requests behind that one (its FIFO order holds)
        (q("a", "b:k2", "b", "a"), {}, 16, 0.0, 0.0, Choice(take=(0, 3))),
        # B = 1
        (q("a", "b"), {}, 1, 0.0, 0.0, Choice(take=(0,))),
    ],
)
def test_choose(
    queue: list[Arrival],
    last_served: dict[str, int],
    max_batch: int,
    now: float,
    freed_at: float,
    want: Choice,
) -> None:
    got = choose(queue, last_served, now=now, freed_at=freed_at, max_batch=max_batch, max_wait_s=W)
    assert got.take == want.take
    if want.until is None:
        assert got.until is None
    else:
        assert got.until == pytest.approx(want.until, abs=1e-12)


@pytest.mark.parametrize(
    ("max_wait_s", "now", "want"),
    [
        (0.0, 1.010, Choice(take=(0,))),  # T = 0: no waiting even under load
        (0.020, 1.011, Choice(until=1.030)),
        (0.020, 1.0301, Choice(take=(0,))),
    ],
)
def test_choose_max_wait(max_wait_s: float, now: float, want: Choice) -> None:
    got = choose(q("a", t=1.0, busy=True), {}, now=now, freed_at=1.010, max_batch=16,
                 max_wait_s=max_wait_s)
    assert got.take == want.take
    assert got.until == (None if want.until is None else pytest.approx(want.until))


def test_plan_invariants_on_random_queues() -> None:
    """Whatever the queue: at most B, one key, each tenant's requests a FIFO prefix of its
    own, and nothing left that could have joined (fewer than B means every tenant with a
    compatible request next in its line was drained to an incompatible one or to empty)."""
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 12)
        queue = [Arrival(rng.choice("abc"), rng.choice(["k", "k", "k2"]), float(i)) for i in range(n)]
        last = {t: rng.randint(0, 3) for t in "abc" if rng.random() < 0.5}
        b = rng.randint(1, 6)
        take = plan(queue, last, b)
        assert 1 <= len(take) <= b
        assert len(set(take)) == len(take)
        keys = {queue[i].key for i in take}
        assert len(keys) == 1
        for t in "abc":
            mine = [i for i, p in enumerate(queue) if p.tenant == t]
            chosen = [i for i in take if queue[i].tenant == t]
            assert chosen == mine[: len(chosen)], (queue, take)  # a prefix, in order
            if len(take) < b and len(chosen) < len(mine):
                assert queue[mine[len(chosen)]].key not in keys  # blocked, not forgotten


def r(*items: str) -> list[Arrival]:
    """``"a64"``: tenant a, a request of 64 rows (key k, arrived at 0)."""
    return [Arrival(s[0], "k", 0.0, False, int(s[1:])) for s in items]


@pytest.mark.parametrize(
    ("queue", "last_served", "max_rows", "want"),
    [
        # a batch is bounded by rows: a 64-row request fills one of its own
        (r("m64", "m64", "v1"), {}, 64, (0,)),
        # the victim's turn comes next: it runs before the flood's second request ...
        (r("m64", "v1"), {"m": 1}, 64, (1,)),
        # ... and with another small tenant, not behind a row-heavy one
        (r("m64", "v1", "w2"), {"m": 3, "v": 1, "w": 2}, 64, (1, 2)),
        # the first request always runs, however large (nothing could run it otherwise)
        (r("m100", "v1"), {}, 64, (0,)),
        # rows fill up with every tenant's turns, each FIFO
        (r("a8", "a8", "b8", "b8"), {}, 24, (0, 2, 1)),
        # a request that would not fit keeps its tenant's later ones out (FIFO) ...
        (r("a8", "a60", "a1", "b1"), {}, 64, (0, 3)),
        # ... while other tenants' still fit
        (r("a60", "b8", "c4"), {}, 64, (0, 2)),
        # no row bound: the request count alone (as before)
        (r("m64", "m64", "v1"), {}, None, (0, 2, 1)),
    ],
)
def test_plan_bounds_rows(
    queue: list[Arrival], last_served: dict[str, int], max_rows: int | None,
    want: tuple[int, ...],
) -> None:
    assert tuple(plan(queue, last_served, 16, max_rows)) == want


@pytest.mark.parametrize(("max_rows", "want"), [(16, 8), (17, 8), (2, 1), (1, 1)])
def test_large_requests_split_into_half_batches(max_rows: int, want: int) -> None:
    assert part_rows(max_rows) == want


@pytest.mark.parametrize(
    ("queue", "last_served", "want_rows"),
    [
        # a flood's 64-row requests as parts of 8 (max_rows 16): alone, two fill a batch
        (r(*["m8"] * 8), {}, 16),
        # the victim's 1-row request rides with one part, not two: 9 rows, not 17
        (r(*["m8"] * 8, "v1"), {"m": 1}, 9),
        (r(*["m8"] * 8, "v1"), {"v": 1}, 9),
    ],
)
def test_a_small_request_rides_with_half_a_batch(
    queue: list[Arrival], last_served: dict[str, int], want_rows: int,
) -> None:
    take = plan(queue, last_served, 16, 16)
    assert sum(queue[i].rows for i in take) == want_rows
    if any(a.tenant == "v" for a in queue):
        assert len(queue) - 1 in take


def test_a_full_row_batch_runs_without_waiting_for_company() -> None:
    queue = [Arrival("a", "k", 1.0, True, 64), Arrival("b", "k", 1.0, True, 8)]
    assert choose(queue, {}, now=1.011, freed_at=1.010, max_batch=16, max_wait_s=W,
                  max_rows=64).take == (0,)
    got = choose(queue[:1], {}, now=1.011, freed_at=1.010, max_batch=16, max_wait_s=W, max_rows=64)
    assert got.take == (0,)  # 64 of 64 rows: full


def test_a_small_tenant_waits_at_most_one_batch_behind_a_flood() -> None:
    """Whatever the flood sends (requests up to the row bound), a 1-row request that
    arrives runs in the next batch or the one after (the batch running when it came,
    then the one the flood's turn may hold)."""
    rng = random.Random(3)
    for _ in range(300):
        queue = [Arrival("m", "k", float(i), False, rng.randint(1, 64)) for i in range(rng.randint(1, 20))]
        queue.append(Arrival("v", "k", 99.0, False, 1))
        last: dict[str, int] = {"v": rng.randint(0, 5), "m": rng.randint(0, 5)}
        for batch_no in range(2):
            take = plan(queue, last, 16, 64)
            assert sum(queue[i].rows for i in take) <= 64 or len(take) == 1
            if any(queue[i].tenant == "v" for i in take):
                break
            last = served(last, [queue[i].tenant for i in take], 10 + batch_no, 100)
            queue = [p for i, p in enumerate(queue) if i not in set(take)]
        else:
            raise AssertionError("the 1-row request waited more than two batches")


@pytest.mark.parametrize(
    ("max_rows", "tenants", "want"),
    [(16, 0, 16), (16, 1, 16), (16, 2, 8), (16, 30, 8), (17, 2, 8), (1, 2, 1), (2, 3, 1)],
)
def test_batches_are_halved_while_tenants_share(max_rows: int, tenants: int, want: int) -> None:
    assert row_bound(max_rows, tenants) == want


def test_sharing_counts_recent_senders_and_forgets_the_others() -> None:
    seen = {"a": 10.0, "b": 8.5, "c": 7.9}
    assert sharing(seen, now=10.0, window_s=2.0) == 2
    assert seen == {"a": 10.0, "b": 8.5}  # c forgotten: the map holds recent senders only
    assert sharing(seen, now=12.1, window_s=2.0) == 0 and seen == {}
    assert sharing({}, now=0.0) == 0


def test_while_two_tenants_share_a_small_request_waits_for_one_half_batch() -> None:
    """A flood's 64-row requests (parts of 8 of a 16-row engine) while a 1-row tenant
    sends too: every batch under the shared bound holds at most 8 rows, so the batch
    running when the 1-row request comes is a half one, and the request then runs in
    a batch of 1 row (no part fits beside it), not one of 9 after one of 16."""
    rng = random.Random(5)
    bound = row_bound(16, 2)
    for _ in range(200):
        queue = [Arrival("m", "k", float(i), False, 8) for i in range(rng.randint(1, 24))]
        last: dict[str, int] = {"m": 7}
        running = plan(queue, last, 16, bound)
        assert sum(queue[i].rows for i in running) <= 8
        last = served(last, ["m"], 8, 100)
        queue = [p for i, p in enumerate(queue) if i not in set(running)]
        queue.append(Arrival("v", "k", 99.0, False, 1))
        take = plan(queue, {**last, "v": rng.randint(0, 6)}, 16, bound)
        assert [queue[i].tenant for i in take] == ["v"]


@pytest.mark.parametrize(
    ("before", "tenants", "turn", "forget_above", "after"),
    [
        ({}, ["a", "b", "a"], 1, 10, {"a": 1, "b": 1}),
        ({"a": 1, "c": 2}, ["a"], 3, 10, {"a": 3, "c": 2}),
        # past the bound only this batch's tenants are remembered
        ({"a": 1, "c": 2}, ["b"], 3, 2, {"b": 3}),
        ({"a": 1, "c": 2}, ["a"], 3, 2, {"a": 3, "c": 2}),
    ],
)
def test_served(
    before: dict[str, int], tenants: list[str], turn: int, forget_above: int,
    after: dict[str, int],
) -> None:
    assert served(dict(before), tenants, turn, forget_above) == after
