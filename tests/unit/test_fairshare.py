"""Fair shares of the trainer (pure): the lease order, the charges, the admission queue."""

from __future__ import annotations

import itertools
from collections import Counter

import msgspec
import pytest

from joynexus.agents.admission import AdmissionQueue, Waiter
from joynexus.agents.fairshare import FairShare, admission_key, jain, lease_key
from joynexus.agents.schedcore import Refused, SchedulerCore
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.jobs import GlobalLimits, JobState, TrainingJob, WorkloadPolicy
from joynexus.schemas.quotas import Quota
from joynexus.schemas.scheduler import ReserveRequest

S = JobState

# (priority, lag, task, ready_seq) pairs: the first is leased before the second.
LEASE_ORDER = [
    ((20, 9.0, "sft", 9), (10, 0.0, "rl", 1), "a higher class first, however far ahead it is"),
    ((10, 1.0, "sft", 9), (10, 2.0, "rl", 1), "the tenant furthest behind, SFT or not"),
    ((10, 1.0, "rl", 9), (10, 1.0, "sft", 1), "equally behind: RL before SFT"),
    ((10, 1.0, "sft", 1), (10, 1.0, "sft", 2), "then ready order"),
    ((0, 0.5, "rl", 5), (0, 0.6, "rl", 1), "a lower lag beats an earlier job"),
]


@pytest.mark.parametrize(("first", "second", "why"), LEASE_ORDER)
def test_lease_key_order(first: tuple, second: tuple, why: str) -> None:
    assert lease_key(*first) < lease_key(*second), why


def test_admission_key_order() -> None:
    assert admission_key(10, 0.0, 9.0) > admission_key(20, 5.0, 0.0)  # priority first
    assert admission_key(10, 1.0, 9.0) < admission_key(10, 2.0, 0.0)  # then the lag
    assert admission_key(10, 1.0, 1.0) < admission_key(10, 1.0, 2.0)  # then arrival


def test_charges_weights_and_the_decayed_display() -> None:
    f = FairShare(half_life_s=60.0)
    f.charge("a", 4, now=0.0, seconds=2.0)
    # the displayed rows decay with the half-life; the order's virtual time does not
    assert f.served("a", 60.0) == pytest.approx(2.0)
    assert f.served("a", 120.0) == pytest.approx(1.0)
    assert f.trainer_s("a", 0.0) == pytest.approx(2.0)  # 0.5 s per row measured
    assert f.lag_key("a", 1, 0, 120.0) == pytest.approx(4.0)
    f.charge("b", 4, now=0.0, weight=2)
    # weight 2 halves the virtual time; jobs under way count at the mean rows per job
    assert f.lag_key("b", 2, 0, 0.0) == pytest.approx(2.0)
    assert f.lag_key("a", 1, 2, 0.0) == pytest.approx(4.0 + 2 * 4.0)
    assert f.lag_key("new", 1, 1, 0.0) == pytest.approx(4.0)  # a new tenant: the mean
    f.lift("new", 3.0, now=0.0)  # back from idle: no credit banked
    assert f.lag_key("new", 1, 0, 0.0) == pytest.approx(3.0)
    f.lift("a", 1.0, now=0.0)  # a lift never lowers
    assert f.vt("a") == pytest.approx(4.0)
    f.charge("c", 0, now=0.0, seconds=-5.0)  # no rows counts as one; no negative time
    assert f.served("c", 0.0) == pytest.approx(1.0) and f.seconds_per_row >= 0.0
    share = f.report({"a": 1.0, "b": 2.0}, 0.0)
    assert share["a"] == pytest.approx((0.5, 1 / 3)) and share["b"] == pytest.approx((0.5, 2 / 3))


def test_a_tenant_back_from_idle_starts_level_with_the_others() -> None:
    """a trained 20 jobs while b was idle; b's first job does not make it owed all
    of a's past: the two alternate from there."""
    t = Trainer(pol("a"), pol("b"))
    for _ in range(20):
        t.ready("a")
        t.train_one()
    for _ in range(10):
        t.ready("a")
        t.ready("b")
    served = [t.train_one().tenant_id for _ in range(10)]
    assert Counter(served) == {"a": 5, "b": 5}


def test_jain() -> None:
    assert jain([1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain([0, 0]) is None


class Trainer:
    """The core as the agent drives it, with one actor whose jobs take ``cost`` seconds."""

    def __init__(self, *policies: WorkloadPolicy, limit: int = 100) -> None:
        self.core = SchedulerCore(lease_ttl_s=1e9, limits=GlobalLimits(max_active_rollouts=limit))
        self.seq = itertools.count(1)
        self.now = 0.0
        #: The last event of every job and its sequence (what a restart reads).
        self.log: dict[str, tuple[object, int]] = {}
        for p in policies:
            self.core.policies[p.key] = p

    def run(self, ev):  # type: ignore[no-untyped-def]
        if isinstance(ev, (Refused, TrainingJob)):
            return ev
        self.core.apply(ev, self.now)
        seq = next(self.seq)
        self.log[ev.job.job_id] = (msgspec.structs.replace(ev, at=self.now), seq)
        return self.core.commit(ev.job.job_id, seq)

    def reserve(
        self, tenant: str, task: str = "rl", job_id: str = "", rows: int = 8
    ) -> TrainingJob | Refused:
        req = ReserveRequest(job_id=job_id or f"j{next(self.seq)}", tenant_id=tenant,
                             task_type=task, workload=task, sample_count=rows)  # type: ignore[arg-type]
        return self.run(self.core.decide_reserve(req, at=0, by="p", now=self.now))

    def ready(self, tenant: str, task: str = "rl", rows: int = 8) -> TrainingJob:
        job = self.reserve(tenant, task, rows=rows)
        assert isinstance(job, TrainingJob), job
        return self.run(self.core.decide_mark(job.job_id, S.READY, attempt=0, sample_count=None,
                                              at=0, by="p"))

    def train_one(self, cost: float = 1.0) -> TrainingJob:
        job = self.core.next_ready("actor", now=self.now)
        assert job is not None
        leased = self.run(self.core.decide_lease(job, at=0, by="a"))
        self.now += cost
        self.run(self.core.decide_complete(job.job_id, leased.attempt, result_version=1,
                                           at=0, by="a"))
        return job


def pol(tenant: str, task: str = "rl", **kw: object) -> WorkloadPolicy:
    return WorkloadPolicy(tenant_id=tenant, task_type=task, workload=task,  # type: ignore[arg-type]
                          max_in_flight=1000, max_active_rollouts=1000, **kw)


def test_equal_tenants_get_equal_turns_whatever_they_have_ready() -> None:
    """a has 30 jobs ready, b 10: before b runs dry they alternate (the old order,
    ready order, would have served a's 30 first)."""
    t = Trainer(pol("a"), pol("b"))
    for _ in range(30):
        t.ready("a")
    for _ in range(10):
        t.ready("b")
    served = [t.train_one().tenant_id for _ in range(20)]
    assert Counter(served) == {"a": 10, "b": 10}
    assert all(x != y for x, y in itertools.pairwise(served))  # strictly alternating


def test_weights_divide_the_trainer_work() -> None:
    """Weights 2 and 1, both always backlogged, b's jobs twice a's rows: a gets twice
    b's rows trained, so four jobs to b's one, whatever the leases' wall times."""
    t = Trainer(pol("a", weight=2), pol("b"))
    for _ in range(60):
        t.ready("a", rows=8)
        t.ready("b", rows=16)
    rows: Counter[str] = Counter()
    jobs: Counter[str] = Counter()
    for i in range(50):
        job = t.train_one(cost=0.1 + (i % 3))  # wall times that say nothing
        jobs[job.tenant_id] += 1
        rows[job.tenant_id] += job.sample_count
    assert rows["a"] / rows["b"] == pytest.approx(2.0, rel=0.1)
    assert jobs["a"] / jobs["b"] == pytest.approx(4.0, rel=0.15)


def test_rl_before_sft_within_a_tenant_and_priority_stays_strict() -> None:
    t = Trainer(pol("a", "sft"), pol("a", "rl"), pol("p", "sft", priority=20))
    t.ready("a", "sft")
    t.ready("a", "rl")  # ready later, leased first: the tenant's RL job
    assert t.train_one().task_type == "rl"
    for _ in range(5):
        t.ready("p", "sft")
    # p is premium: all its jobs first, though it is served more and more.
    assert [t.train_one().tenant_id for _ in range(5)] == ["p"] * 5
    assert t.train_one().tenant_id == "a"


def test_a_refused_completion_append_charges_nothing() -> None:
    t = Trainer(pol("a"))
    t.ready("a")
    job = t.core.next_ready("actor", now=0.0)
    assert job is not None
    leased = t.run(t.core.decide_lease(job, at=0, by="a"))
    ev = t.core.decide_complete(job.job_id, leased.attempt, result_version=1, at=0, by="a")
    prev = t.core.apply(ev, 5.0)
    t.core.revert(job.job_id, prev, 5.0)  # the append failed
    assert t.core.fair.served("a", 5.0) == 0.0
    t.core.apply(ev, 7.0)  # the retry lands: its rows, its lease timed from the lease
    t.core.commit(job.job_id, 99)
    assert t.core.fair.served("a", 7.0) == pytest.approx(8.0)
    assert t.core.fair.seconds_per_row == pytest.approx(7.0 / 8)


def test_a_free_rollout_slot_goes_to_the_tenant_furthest_behind() -> None:
    """One global slot; a (served much) and b (served nothing) both wait: b gets the
    slot, and a fresh reserve of a cannot take it past b."""
    t = Trainer(pol("a"), pol("b"), limit=1)
    t.core.fair.charge("a", 50, now=0.0)
    holder = t.reserve("a")
    assert isinstance(holder, TrainingJob)
    ra = ReserveRequest(job_id="wa", tenant_id="a", task_type="rl", workload="rl")
    rb = ReserveRequest(job_id="wb", tenant_id="b", task_type="rl", workload="rl")
    for req in (ra, rb):
        refused = t.core.decide_reserve(req, at=0, by="p", now=1.0)
        assert isinstance(refused, Refused) and refused.code == "global_rollouts"
        assert t.core.wait(req, refused.code, now=1.0)
    assert t.core.position("wb", now=1.0) == 1 and t.core.position("wa", now=1.0) == 2
    # The slot frees.
    t.run(t.core.decide_mark(holder.job_id, S.READY, attempt=0, sample_count=None, at=0, by="p"))
    assert t.core.first_waiters(1, now=2.0) == ["wb"]
    late = t.core.decide_reserve(
        ReserveRequest(job_id="fresh", tenant_id="a", task_type="rl", workload="rl"),
        at=0, by="p", now=2.0)
    assert isinstance(late, Refused) and "further behind" in late.reason
    assert isinstance(t.core.decide_reserve(ra, at=0, by="p", now=2.0), Refused)
    assert not isinstance(t.core.decide_reserve(rb, at=0, by="p", now=2.0), Refused)


def test_the_queue_is_bounded_per_tenant_and_final_refusals_do_not_wait() -> None:
    q = AdmissionQueue(per_tenant=2)
    mk = lambda i, t="a": Waiter(job_id=f"j{i}", tenant=t, workload_key=f"{t}.rl",  # noqa: E731
                                 priority=0, weight=1, code="in_flight", since=float(i))
    assert q.add(mk(1)) and q.add(mk(2)) and not q.add(mk(3))
    assert q.add(mk(4, "b"))  # another tenant's queue is its own
    assert q.add(mk(1))  # already queued: updated, not counted twice
    assert q.depth() == {"a": 2, "b": 1}
    assert q.position("j2", lambda w: 0.0) == 2
    q.add(Waiter(job_id="j1", tenant="a", workload_key="a.rl", priority=0, weight=1,
                 code="rollouts", since=9.0))  # another own limit: it keeps its place
    assert q.of_workload("a.rl") == ["j1", "j2"] and q.position("j2", lambda w: 0.0) == 2
    q.add(Waiter(job_id="j1", tenant="a", workload_key="a.rl", priority=0, weight=1,
                 code="global_rollouts", since=9.0))  # now waits for a global slot
    assert q.n_global == 1 and q.of_workload("a.rl") == ["j2"]
    assert q.position("j2", lambda w: 0.0) == 1 and q.first(5, lambda w: 0.0) == ["j1"]
    q.remove("j1")
    assert q.n_global == 0 and q.first(5, lambda w: 0.0) == []
    assert q.add(mk(3)) and q.depth() == {"a": 2, "b": 1}
    t = Trainer(pol("a"))
    req = ReserveRequest(job_id="x", tenant_id="a", task_type="rl", workload="rl")
    assert t.core.wait(req, "ended", now=0.0) == 0


def test_weight_is_the_operators_and_bounded() -> None:
    from joynexus.agents.control.checks import bound_spec
    from joynexus.schemas.workloads import Scheduling, WorkloadSpec

    spec = WorkloadSpec(name="w", task_type="sft", dataset="d",
                        scheduling=Scheduling(weight=50))  # asked for by the tenant
    assert bound_spec("acme", spec, Quota(share_weight=2)).scheduling.weight == 2
    with pytest.raises(InvalidSpec, match="weight"):
        pol("a", weight=0)
    with pytest.raises(InvalidSpec, match="share_weight"):
        Quota(share_weight=0)
    assert Quota(share_weight=2).share_weight == 2


def test_status_shows_share_against_fair_share_and_queue_depth() -> None:
    from joynexus.ops.admin import shares

    rows = shares.share_rows({"shares": [
        {"tenant_id": "acme", "weight": 2, "share": 0.5, "fair_share": 0.6667,
         "trainer_s": 12.5, "queued": 3},
        {"tenant_id": "bolt", "share": 0.5, "fair_share": 0.3333},
    ]})
    assert rows == [["acme", 2, "50.0%", "66.7%", "12.5", 3],
                    ["bolt", 1, "50.0%", "33.3%", "0.0", 0]]
    assert shares.share_rows({}) == []


# ---------------------------------------------------------------- a restart
#: (what happens before the restart, tenants' weights, whether a restart that
#: rebuilt no charges would lease in another order). Ops: ("ready", tenant, rows),
#: ("train", n), ("fail", tenant), ("reserve", tenant), ("lease",): a lease left open.
REPLAYS = [
    ([("ready", "a", 8)] * 4 + [("ready", "b", 8)] * 4 + [("train", 5)], {}, True),
    ([("ready", "a", 8), ("ready", "b", 16)] * 6 + [("train", 9)], {"a": 2}, False),
    # b comes back from idle while a has jobs under way: lifted to a's virtual time.
    ([("ready", "a", 8)] * 6 + [("train", 6), ("ready", "a", 8), ("ready", "b", 4),
                                ("ready", "b", 4), ("train", 2)], {}, True),
    # failed and dropped jobs charge nothing; a lease and a reserve open at the restart.
    ([("ready", "a", 8), ("fail", "b"), ("ready", "b", 8), ("ready", "c", 4),
      ("train", 2), ("ready", "c", 4), ("lease",), ("reserve", "a")], {"c": 3}, True),
]


def drive(t: Trainer, ops: list[tuple]) -> None:  # type: ignore[type-arg]
    for op in ops:
        if op[0] == "ready":
            t.ready(op[1], rows=op[2])
        elif op[0] == "train":
            for _ in range(op[1]):
                t.train_one(cost=1.5)
        elif op[0] == "fail":
            job = t.reserve(op[1])
            assert isinstance(job, TrainingJob)
            t.run(t.core.decide_end(job.job_id, "fail", "x", attempt=0, at=0, by="p"))
        elif op[0] == "reserve":
            t.reserve(op[1])
        else:
            job = t.core.next_ready("actor", now=t.now)
            assert job is not None
            t.run(t.core.decide_lease(job, at=0, by="a"))


def restarted(t: Trainer, replayed: bool) -> Trainer:
    """A new core rebuilt from the trainer's log, as ``SchedulerAgent.rebuild`` does."""
    r = Trainer(*t.core.policies.values())
    r.seq, r.now, r.log = itertools.count(max(s for _, s in t.log.values()) + 1), t.now, {}
    latest = sorted(t.log.values(), key=lambda x: x[1])
    for ev, seq in latest:
        r.core.load(ev, seq, t.now)  # type: ignore[arg-type]
    if replayed:
        r.core.replay_shares(latest, now=t.now, wall=t.now)  # type: ignore[arg-type]
    return r


def order(t: Trainer, n: int = 12) -> list[str]:
    for _ in range(n // 3):
        for tenant in ("a", "b", "c"):
            t.ready(tenant, rows=8)
    return [t.train_one().tenant_id for _ in range(n)]


@pytest.mark.parametrize(("ops", "weights", "differs"), REPLAYS)
def test_a_restart_rebuilds_the_same_charges_and_order(
    ops: list[tuple], weights: dict[str, int], differs: bool  # type: ignore[type-arg]
) -> None:
    t = Trainer(*(pol(x, weight=weights.get(x, 1)) for x in ("a", "b", "c")))
    drive(t, ops)
    r = restarted(t, replayed=True)
    for tenant in ("a", "b", "c"):
        before, after = t.core.fair.shares.get(tenant), r.core.fair.shares.get(tenant)
        assert (before is None) == (after is None), tenant
        if before is not None and after is not None:
            assert after.vt == pytest.approx(before.vt), tenant
            assert (after.jobs, after.cost) == pytest.approx((before.jobs, before.cost)), tenant
            assert r.core.fair.served(tenant, t.now) == pytest.approx(
                t.core.fair.served(tenant, t.now)), tenant
    assert r.core.fair.mean_cost == pytest.approx(t.core.fair.mean_cost)
    # The shares shown are the same (trainer seconds come back with the next lease
    # measured: lease times are not in the log).
    assert [msgspec.structs.replace(x, trainer_s=0.0) for x in r.core.share_rows(t.now)] == [
        msgspec.structs.replace(x, trainer_s=0.0) for x in t.core.share_rows(t.now)]
    fresh = restarted(t, replayed=False)
    expected = order(t)
    assert order(r) == expected
    assert (order(fresh) != expected) == differs  # a restart that forgot the charges
