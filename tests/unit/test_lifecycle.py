"""The pure scheduler core: every (state, event) pair, admission, lease order."""

from __future__ import annotations

import itertools
from collections import Counter

import msgspec
import pytest

from joynexus.agents.lifecycle import allowed, transition
from joynexus.agents.schedcore import Refused, SchedulerCore
from joynexus.schemas import jobs
from joynexus.schemas.errors import (
    Conflict,
    IllegalTransition,
    StaleLease,
    UnknownJob,
    UnknownTenant,
)
from joynexus.schemas.jobs import GlobalLimits, JobState, TrainingJob, WorkloadPolicy
from joynexus.schemas.scheduler import ReserveRequest

S = JobState
ALL = list(JobState)
NON_TERMINAL = [s for s in ALL if s not in (S.COMPLETED, S.DROPPED, S.FAILED)]

# Written out by hand, independently of the code's tables: (from, event kind, to).
EXPECTED: set[tuple[JobState | None, str, JobState]] = {
    (None, "reserved", S.RESERVED),
    *(
        (S.RESERVED, "marked", t)
        for t in (S.PRODUCING, S.NEEDS_ACTOR_FORWARD, S.NEEDS_ADVANTAGES, S.READY)
    ),
    *((S.PRODUCING, "marked", t) for t in (S.NEEDS_ACTOR_FORWARD, S.NEEDS_ADVANTAGES, S.READY)),
    (S.COMPUTING_ACTOR_FORWARD, "marked", S.NEEDS_ADVANTAGES),
    (S.COMPUTING_ACTOR_FORWARD, "marked", S.READY),
    (S.COMPUTING_ADVANTAGES, "marked", S.READY),
    (S.NEEDS_ACTOR_FORWARD, "stage:actor_forward", S.COMPUTING_ACTOR_FORWARD),
    (S.COMPUTING_ACTOR_FORWARD, "stage:actor_forward", S.COMPUTING_ACTOR_FORWARD),
    (S.NEEDS_ADVANTAGES, "stage:advantages", S.COMPUTING_ADVANTAGES),
    (S.COMPUTING_ADVANTAGES, "stage:advantages", S.COMPUTING_ADVANTAGES),
    (S.READY, "leased", S.LEASED),
    (S.LEASED, "lease_expired", S.READY),
    (S.LEASED, "completed", S.COMPLETED),
    *((s, "dropped", S.DROPPED) for s in NON_TERMINAL),
    *((s, "failed", S.FAILED) for s in NON_TERMINAL),
}

KINDS = [
    "reserved",
    "marked",
    "stage:actor_forward",
    "stage:advantages",
    "stage:bogus",
    "leased",
    "lease_expired",
    "completed",
    "dropped",
    "failed",
]


def job(state: JobState = S.RESERVED, **kw: object) -> TrainingJob:
    base = dict(job_id="j1", tenant_id="acme", task_type="rl", workload="default", state=state)
    base.update(kw)
    return TrainingJob(**base)  # type: ignore[arg-type]


def make_event(kind: str, to: JobState):
    j = job(to)
    if kind.startswith("stage:"):
        return jobs.StageLeased(stage=kind.split(":")[1], job=j)
    cls = {
        "reserved": jobs.Reserved,
        "marked": jobs.Marked,
        "leased": jobs.Leased,
        "lease_expired": jobs.LeaseExpired,
        "completed": jobs.Completed,
        "dropped": jobs.Dropped,
        "failed": jobs.Failed,
    }[kind]
    return cls(job=j)


@pytest.mark.parametrize("prev,kind", list(itertools.product([None, *ALL], KINDS)))
def test_transition_table(prev: JobState | None, kind: str) -> None:
    for to in ALL:
        ev = make_event(kind, to)
        ok = (prev, kind, to) in EXPECTED
        assert allowed(prev, ev) is ok, (prev, kind, to)
        current = None if prev is None else job(prev)
        if ok:
            assert transition(current, ev).state is to
        else:
            with pytest.raises(IllegalTransition, match="not allowed"):
                transition(current, ev)


def test_completed_to_leased_names_both_states() -> None:
    with pytest.raises(IllegalTransition, match="completed -> leased"):
        transition(job(S.COMPLETED), jobs.Leased(job=job(S.LEASED)))


def test_event_of_another_job_is_rejected() -> None:
    with pytest.raises(IllegalTransition, match="applied to job"):
        transition(job(S.READY), jobs.Leased(job=job(S.LEASED, job_id="j2")))


# ----------------------------------------------------------------- the core


class Driver:
    """Runs the core the way the agent does, with a fake sequence counter."""

    def __init__(self, **policies: WorkloadPolicy) -> None:
        self.core = SchedulerCore(lease_ttl_s=10.0)
        self.seq = itertools.count(1)
        self.now = 0.0
        for p in policies.values():
            self.core.policies[p.key] = p

    def run(self, ev):
        if isinstance(ev, (Refused, TrainingJob)):
            return ev
        self.core.apply(ev, self.now)
        return self.core.commit(ev.job.job_id, next(self.seq))

    def reserve(self, tenant: str, task: str = "rl", job_id: str | None = None, **kw):
        req = ReserveRequest(
            job_id=job_id or f"j{next(self.seq)}", tenant_id=tenant, task_type=task, **kw
        )
        return self.run(self.core.decide_reserve(req, at=0, by="p"))

    def ready(self, job_id: str) -> TrainingJob:
        return self.run(
            self.core.decide_mark(job_id, S.READY, attempt=0, sample_count=None, at=0, by="p")
        )

    def lease(self, role: str = "actor"):
        j = self.core.next_ready(role)
        return None if j is None else self.run(self.core.decide_lease(j, at=0, by="a"))


def recording(d: Driver) -> dict[str, tuple[object, int]]:
    """Each job's last event and its sequence, as the log would hold them, from now on."""
    events: dict[str, tuple[object, int]] = {}
    orig_run = d.run

    def recording_run(ev):
        out = orig_run(ev)
        if not isinstance(ev, (Refused, TrainingJob)):
            events[ev.job.job_id] = (ev, d.core.last_seq[ev.job.job_id])
        return out

    d.run = recording_run  # type: ignore[method-assign]
    return events


def pol(tenant: str, task: str = "rl", **kw: object) -> WorkloadPolicy:
    return WorkloadPolicy(tenant_id=tenant, task_type=task, **kw)  # type: ignore[arg-type]


def test_admission_max_in_flight_and_rollouts() -> None:
    d = Driver(a=pol("a", max_in_flight=2, max_active_rollouts=1))
    j1 = d.reserve("a")
    assert isinstance(j1, TrainingJob)
    refused = d.reserve("a")  # one rollout already under way
    assert refused.code == "rollouts" and "rollouts active" in refused.reason
    d.ready(j1.job_id)
    j2 = d.reserve("a")
    assert isinstance(j2, TrainingJob)
    d.ready(j2.job_id)
    refused = d.reserve("a")
    assert refused.code == "in_flight" and "max_in_flight 2" in refused.reason
    leased = d.lease()
    d.run(d.core.decide_complete(leased.job_id, leased.attempt, result_version=1, at=0, by="a"))
    assert isinstance(d.reserve("a"), TrainingJob)


def test_global_rollout_limit_and_completion_target() -> None:
    d = Driver(
        a=pol("a", max_in_flight=9),
        b=pol("b", max_in_flight=9),
        c=pol("c", task="sft", max_in_flight=9, completion_target=2),
    )
    d.core.limits = GlobalLimits(max_active_rollouts=1)
    assert isinstance(d.reserve("a"), TrainingJob)
    assert d.reserve("b").code == "global_rollouts"
    # SFT jobs are not rollouts; the completion target counts in-flight + completed.
    assert isinstance(d.reserve("c", "sft"), TrainingJob)
    assert isinstance(d.reserve("c", "sft"), TrainingJob)
    refused = d.reserve("c", "sft")
    assert refused.code == "completion_target" and "completion target 2" in refused.reason


def test_unknown_tenant_is_a_clear_error() -> None:
    d = Driver(a=pol("a"))
    with pytest.raises(UnknownTenant, match="'ghost' has no workload 'default'"):
        d.reserve("ghost")
    with pytest.raises(UnknownJob):
        d.core.get("nope")


def test_reserve_is_idempotent_by_job_id() -> None:
    d = Driver(a=pol("a"))
    j = d.reserve("a", job_id="jx")
    assert d.reserve("a", job_id="jx") == j
    assert d.core.in_flight["a.default.1"] == 1


def test_lease_order_priority_then_rl_then_fifo() -> None:
    d = Driver(
        lo=pol("lo", max_in_flight=9, max_active_rollouts=9, priority=0),
        hi=pol("hi", task="sft", max_in_flight=9, priority=5),
        rl=pol("rl", max_in_flight=9, max_active_rollouts=9, priority=0),
        sft=pol("sft", task="sft", max_in_flight=9, priority=0),
    )
    d.core.limits = GlobalLimits(max_active_rollouts=99)
    order = []
    for tenant, task in [("sft", "sft"), ("lo", "rl"), ("hi", "sft"), ("rl", "rl"), ("sft", "sft")]:
        j = d.reserve(tenant, task)
        d.ready(j.job_id)
        order.append(j.job_id)
    got = [d.lease().job_id for _ in range(5)]
    # hi (priority 5) first; then RL jobs in ready order; then SFT in ready order.
    assert got == [order[2], order[1], order[3], order[0], order[4]]
    assert d.lease() is None


def test_stale_rl_job_is_dropped_at_lease_with_reason() -> None:
    d = Driver(a=pol("a", max_in_flight=4, max_active_rollouts=4, max_policy_staleness=1))
    d.core.limits = GlobalLimits(max_active_rollouts=9)
    old = d.reserve("a", behavior_policy_version=0)
    fresh = d.reserve("a", behavior_policy_version=2)
    d.ready(old.job_id)
    d.ready(fresh.job_id)
    d.core.versions["a.default"] = 2
    j = d.core.next_ready("actor")
    ev = d.core.decide_lease(j, at=0, by="a")
    assert isinstance(ev, jobs.Dropped) and "lags current version 2 by 2" in ev.job.reason
    d.run(ev)
    assert d.core.effects_of(d.core.jobs[old.job_id]).clear_partitions == [("a", old.job_id)]
    assert d.lease().job_id == fresh.job_id


def test_lease_expiry_and_stale_complete() -> None:
    d = Driver(a=pol("a", task="sft"))
    j = d.reserve("a", "sft")
    d.ready(j.job_id)
    first = d.lease()
    assert first.attempt == 1
    d.now = 5.0
    d.core.touch(first.job_id, 1, now=d.now)  # extends to 15
    d.now = 12.0
    assert d.core.decide_expiries(now=d.now, at=0, by="s") == []
    d.now = 16.0
    [exp] = d.core.decide_expiries(now=d.now, at=0, by="s")
    d.run(exp)
    second = d.lease()
    assert second.attempt == 2 and second.ready_seq == first.ready_seq
    with pytest.raises(StaleLease, match="lease 1 expired"):
        d.core.decide_complete(j.job_id, 1, result_version=None, at=0, by="zombie")
    done = d.run(d.core.decide_complete(j.job_id, 2, result_version=3, at=0, by="a"))
    assert done.state is S.COMPLETED and d.core.versions["a.default"] == 3
    # A retried complete of the same lease is a no-op, not an error.
    assert d.core.decide_complete(j.job_id, 2, result_version=3, at=0, by="a") == done
    with pytest.raises(IllegalTransition):
        d.core.decide_lease_stage(j.job_id, "advantages", now=d.now, at=0, by="w")


def test_a_job_whose_leases_keep_lapsing_fails_instead_of_looping() -> None:
    """A poison job (every actor that takes it stops) is leased again at most
    MAX_LAPSED_LEASES - 1 times, then fails with a reason; its partition is cleared."""
    from joynexus.agents.schedcore import MAX_LAPSED_LEASES

    d = Driver(a=pol("a", task="sft"))
    j = d.reserve("a", "sft")
    d.ready(j.job_id)
    for n in range(1, MAX_LAPSED_LEASES):
        leased = d.lease()
        assert leased.attempt == n and leased.lapsed == n - 1
        d.now += 100.0
        [exp] = d.core.decide_expiries(now=d.now, at=0, by="s")
        assert isinstance(exp, jobs.LeaseExpired) and exp.job.lapsed == n
        d.run(exp)
    d.lease()
    d.now += 100.0
    [end] = d.core.decide_expiries(now=d.now, at=0, by="s")
    assert isinstance(end, jobs.Failed)
    assert f"leased {MAX_LAPSED_LEASES} times" in end.job.reason
    failed = d.run(end)
    assert failed.state is S.FAILED and d.core.next_ready("actor") is None
    assert d.core.effects_of(failed).clear_partitions == [("a", j.job_id)]
    assert d.core.decide_expiries(now=d.now + 100.0, at=0, by="s") == []


def test_stage_lease_is_exclusive_until_it_expires() -> None:
    d = Driver(a=pol("a"))
    j = d.reserve("a")
    d.run(d.core.decide_mark(j.job_id, S.NEEDS_ADVANTAGES, attempt=0, sample_count=8, at=0, by="p"))
    a = d.run(d.core.decide_lease_stage(j.job_id, "advantages", now=0, at=0, by="w1"))
    assert a.holder == "w1" and a.attempt == 1 and a.sample_count == 8
    assert d.core.decide_lease_stage(j.job_id, "advantages", now=1, at=0, by="w1") == a
    with pytest.raises(Conflict, match="leased to w1"):
        d.core.decide_lease_stage(j.job_id, "advantages", now=1, at=0, by="w2")
    b = d.run(d.core.decide_lease_stage(j.job_id, "advantages", now=11, at=0, by="w2"))
    assert b.holder == "w2" and b.attempt == 2
    with pytest.raises(StaleLease):
        d.core.decide_mark(j.job_id, S.READY, attempt=1, sample_count=None, at=0, by="w1")
    assert (
        d.run(
            d.core.decide_mark(j.job_id, S.READY, attempt=2, sample_count=None, at=0, by="w2")
        ).state
        is S.READY
    )


def test_revert_restores_counters_and_ready_queue() -> None:
    d = Driver(a=pol("a", task="sft"))
    j = d.reserve("a", "sft")
    d.ready(j.job_id)
    before = (+d.core.by_state, +d.core.in_flight)
    ready_job = d.core.next_ready("actor")
    ev = d.core.decide_lease(ready_job, at=0, by="a")
    prev = d.core.apply(ev, 0.0)
    assert d.core.next_ready("actor") is None
    d.core.revert(j.job_id, prev, 0.0)
    assert (+d.core.by_state, +d.core.in_flight) == before
    assert d.core.next_ready("actor").job_id == j.job_id


def test_rebuild_from_last_events_gives_same_state() -> None:
    d = Driver(
        a=pol("a", max_in_flight=5, max_active_rollouts=5), b=pol("b", task="sft", max_in_flight=5)
    )
    d.core.limits = GlobalLimits(max_active_rollouts=9)
    events = recording(d)
    for t, task in [("a", "rl"), ("b", "sft"), ("a", "rl"), ("b", "sft")]:
        j = d.reserve(t, task)
        d.ready(j.job_id)
    leased = d.lease()
    d.run(d.core.decide_complete(leased.job_id, leased.attempt, result_version=4, at=0, by="a"))
    d.lease()
    fresh = SchedulerCore(lease_ttl_s=10.0, policies=dict(d.core.policies), limits=d.core.limits)
    for ev, seq in sorted(events.values(), key=lambda x: x[1]):
        fresh.load(ev, seq, 0.0)  # type: ignore[arg-type]
    strip = lambda c: {k: msgspec.structs.asdict(v) for k, v in c.jobs.items()}  # noqa: E731
    assert strip(fresh) == strip(d.core)
    assert fresh.by_state == d.core.by_state and fresh.versions == {"a.default": 4}
    assert fresh.next_ready("actor").job_id == d.core.next_ready("actor").job_id


# ------------------------------------------------- per workload, per generation
def finish(d: Driver, job: TrainingJob, how: str = "complete") -> TrainingJob:
    """Take ``job`` from reserved through ready and a lease to its end."""
    d.ready(job.job_id)
    leased = d.core.next_ready("actor", frozenset(j for j in d.core.jobs if j != job.job_id))
    assert leased is not None and leased.job_id == job.job_id
    leased = d.run(d.core.decide_lease(leased, at=0, by="a"))
    if how == "complete":
        return d.run(d.core.decide_complete(job.job_id, leased.attempt, result_version=2,
                                            at=0, by="a"))
    return d.run(d.core.decide_end(job.job_id, "fail", "broken", attempt=leased.attempt,
                                   at=0, by="a"))


def sft(d: Driver, workload: str, generation: int = 1, tenant: str = "acme"):
    return d.reserve(tenant, "sft", workload=workload, generation=generation)


def test_a_second_workload_of_a_tenant_counts_from_zero() -> None:
    """The reproduction of issue 30: `first` completed 2 jobs (its target), `second`
    (target 1, the same tenant and task type) is admitted and ends on its own."""
    d = Driver(first=pol("acme", "sft", workload="first", completion_target=2, max_in_flight=4))
    for _ in range(2):
        finish(d, sft(d, "first"))
    end = d.core.decide_workload_end("acme", "first", at=5.0, by="s")
    assert end is not None and (end.state, end.completed, end.generation) == ("done", 2, 1)
    d.core.note_ended(end)
    assert sft(d, "first").code == "ended"
    d.core.set_policy(pol("acme", "sft", workload="second", completion_target=1, max_in_flight=4))
    j = sft(d, "second")
    assert isinstance(j, TrainingJob) and j.workload == "second"
    assert sft(d, "second").code == "completion_target"  # its one job is in flight
    assert d.core.decide_workload_end("acme", "second", at=0, by="s") is None
    finish(d, j)
    end2 = d.core.decide_workload_end("acme", "second", at=0, by="s")
    assert end2 is not None and (end2.state, end2.completed, end2.last_version) == ("done", 1, 2)


def test_a_name_created_again_is_a_new_generation() -> None:
    d = Driver(w=pol("acme", "sft", workload="w", completion_target=1))
    finish(d, sft(d, "w"))
    d.core.note_ended(d.core.decide_workload_end("acme", "w", at=0, by="s"))
    d.core.set_policy(pol("acme", "sft", workload="w", generation=2, completion_target=1))
    # A late producer of generation 1 is told it was replaced, not admitted into 2.
    assert sft(d, "w", generation=1).code == "superseded"
    j = sft(d, "w", generation=2)
    assert isinstance(j, TrainingJob) and j.generation == 2
    assert d.core.in_flight["acme.w.2"] == 1 and d.core.completed["acme.w.1"] == 1
    # A late set_policy of the older generation does not take the name back.
    d.core.set_policy(pol("acme", "sft", workload="w", generation=1, completion_target=9))
    assert d.core.policies["acme.w"].generation == 2


def test_a_workload_whose_jobs_keep_failing_ends_failed() -> None:
    d = Driver(w=pol("acme", "sft", workload="w", completion_target=2, max_in_flight=4))
    finish(d, sft(d, "w"), "fail")
    assert d.core.decide_workload_end("acme", "w", at=0, by="s") is None  # 1 failure < 2
    finish(d, sft(d, "w"), "fail")
    end = d.core.decide_workload_end("acme", "w", at=0, by="s")
    assert end is not None and (end.state, end.failed, end.completed) == ("failed", 2, 0)
    assert "2 jobs failed" in end.reason


def test_failed_jobs_are_replaced_until_the_target_completes() -> None:
    d = Driver(w=pol("acme", "sft", workload="w", completion_target=2, max_in_flight=4))
    finish(d, sft(d, "w"))
    finish(d, sft(d, "w"), "fail")  # admission reopens: completed + in flight is 1
    finish(d, sft(d, "w"))
    end = d.core.decide_workload_end("acme", "w", at=0, by="s")
    assert end is not None and (end.state, end.completed, end.failed) == ("done", 2, 1)


def test_no_end_without_a_target_and_no_end_twice() -> None:
    d = Driver(w=pol("acme", "sft", workload="w"), t=pol("acme", "rl", workload="t",
                                                        completion_target=1))
    finish(d, sft(d, "w"))
    assert d.core.decide_workload_end("acme", "w", at=0, by="s") is None  # runs until cancelled
    finish(d, d.reserve("acme", "rl", workload="t"))
    [end] = d.core.pending_ends(at=0, by="s")
    prev = d.core.note_ended(end)
    assert d.core.pending_ends(at=0, by="s") == []
    d.core.forget_ended(end, prev)  # its append failed: due again
    assert [e.workload for e in d.core.pending_ends(at=0, by="s")] == ["t"]


def test_rebuild_counts_per_generation_and_finds_an_end_due() -> None:
    """A scheduler that stopped between a workload's last completion and appending its
    end: the rebuilt core counts the same and has the end due; with the end in the log
    it is ended (reserves refused) and nothing is due."""
    d = Driver(w=pol("acme", "sft", workload="w", generation=2, completion_target=2,
                     max_in_flight=4))
    events = recording(d)
    for _ in range(2):
        finish(d, sft(d, "w", generation=2))

    def rebuilt() -> SchedulerCore:
        fresh = SchedulerCore(lease_ttl_s=10.0)
        fresh.set_policy(d.core.policies["acme.w"])
        for ev, seq in sorted(events.values(), key=lambda x: x[1]):
            fresh.load(ev, seq, 0.0)  # type: ignore[arg-type]
        return fresh

    fresh = rebuilt()
    assert +fresh.completed == +d.core.completed == Counter({"acme.w.2": 2})
    [due] = fresh.pending_ends(at=0, by="s")
    assert (due.state, due.generation, due.completed) == ("done", 2, 2)
    again = rebuilt()
    again.note_ended(due)  # as read back from the log
    assert again.pending_ends(at=0, by="s") == []
    refused = again.decide_reserve(
        ReserveRequest(job_id="late", tenant_id="acme", task_type="sft", workload="w",
                       generation=2), at=0, by="p")
    assert isinstance(refused, Refused) and refused.code == "ended"


def test_the_jobs_of_a_tenant_are_indexed_through_every_change() -> None:
    """``jobs_of`` (what ``list_jobs`` reads instead of every tenant's jobs) holds
    exactly the tenant's jobs after reserves, ends, reverts and pruning."""
    d = Driver(a=pol("a", task="sft", max_in_flight=50), b=pol("b", task="sft", max_in_flight=50))

    def check() -> None:
        for t in ("a", "b", "nobody"):
            want = {j.job_id for j in d.core.jobs.values() if j.tenant_id == t}
            assert {j.job_id for j in d.core.jobs_of(t)} == want, t
        assert set().union(*d.core.by_tenant.values()) == set(d.core.jobs)
        assert all(d.core.by_tenant.values())  # no empty entries kept

    made = [d.reserve(t, "sft") for t in ("a", "b") * 6]
    check()
    for j in made[:6]:
        finish(d, j, "complete" if j.tenant_id == "a" else "fail")
    check()
    j = d.reserve("a", "sft")
    ev = d.core.decide_mark(j.job_id, S.READY, attempt=0, sample_count=None, at=0, by="p")
    prev = d.core.apply(ev, 0.0)
    d.core.revert(j.job_id, prev, 0.0)
    check()
    ev = d.core.decide_reserve(ReserveRequest(job_id="undone", tenant_id="b", task_type="sft"),
                               at=0, by="p")
    prev = d.core.apply(ev, 0.0)  # a new job whose append failed: reverted to none
    assert "undone" in {j.job_id for j in d.core.jobs_of("b")}
    d.core.revert("undone", prev, 0.0)
    check()
    assert d.core.prune_terminal(keep=1) == 5
    check()
    assert len(d.core.jobs_of("b")) == 6 - 2  # three of b's ended, two of them pruned
    fresh = SchedulerCore(lease_ttl_s=10.0)
    assert fresh.jobs_of("a") == []
