"""The Training Scheduler's pure core: admission, lease order and every decision.

:class:`SchedulerCore` is a :class:`~joynexus.agents.lifecycle.JobBook` (the
state the event log makes) that also decides: whether to admit a reserve (and
why not: :class:`Refused`), which ready job a lease takes, stage leases, marks,
completions, ends, lease expiries and workload ends. Every decision returns the
event to append (or the job as it is, for a retried call) and changes nothing;
the agent applies it, appends it, then commits or reverts. No I/O, no clock
reads: ``now`` and ``at`` come from the caller.

See docs/ARCHITECTURE.md, "The Training Scheduler: one decider, many callers".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec

from joynexus.agents.admission import FairBook
from joynexus.agents.fairshare import admission_key
from joynexus.agents.lifecycle import COMPUTING, transition
from joynexus.schemas.errors import (
    Conflict,
    IllegalTransition,
    InvalidSpec,
    StaleLease,
    UnknownTenant,
)
from joynexus.schemas.jobs import (
    STAGES,
    TERMINAL_STATES,
    Completed,
    Dropped,
    Failed,
    JobMetadata,
    JobState,
    Leased,
    LeaseExpired,
    Marked,
    Reserved,
    StageLeased,
    TrainingJob,
    WorkloadEnded,
    WorkloadPolicy,
    check_name,
)
from joynexus.schemas.scheduler import Refusal, ReserveRequest

S = JobState


#: Actor leases of one job that may lapse before the job fails instead of being leased
#: again (:meth:`SchedulerCore.decide_expiries`).
MAX_LAPSED_LEASES = 5


@dataclass(frozen=True)
class Refused:
    """Why admission refused a job: a code to decide on and the words to show."""

    code: Refusal
    reason: str


@dataclass
class Effects:
    """What the agent must do besides appending events."""

    clear_partitions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class SchedulerCore(FairBook):
    """All scheduler state, rebuilt from the event log, and every decision; pure."""

    # ------------------------------------------------------------ decisions
    def decide_reserve(
        self, req: ReserveRequest, *, at: float, by: str, now: float | None = None
    ) -> Reserved | TrainingJob | Refused:
        """A Reserved event, the existing job (a retried reserve), or why admission
        refused (``now``: the clock of lease times, for the fair order of waiters)."""
        check_name("job_id", req.job_id)
        check_name("tenant_id", req.tenant_id)
        existing = self.jobs.get(req.job_id)
        if existing is not None:
            if existing.tenant_id != req.tenant_id:
                raise InvalidSpec(f"job id {req.job_id!r} is already used by another tenant")
            return existing
        key = f"{req.tenant_id}.{req.workload}"
        policy = self.policies.get(key)
        if policy is None:
            known = sorted(p.workload for p in self.policies.values() if p.tenant_id == req.tenant_id)
            raise UnknownTenant(
                f"tenant {req.tenant_id!r} has no workload {req.workload!r} at the scheduler; "
                f"register its policy first (set_policy). Its workloads: {', '.join(known) or 'none'}"
            )
        if policy.task_type != req.task_type:
            raise InvalidSpec(
                f"workload {key} is {policy.task_type}, not {req.task_type}: reserve its own task type"
            )
        refused = self._refusal(policy, req, self._now(now))
        if refused is not None:
            return refused
        job = TrainingJob(
            job_id=req.job_id,
            tenant_id=req.tenant_id,
            task_type=req.task_type,
            workload=check_name("workload", req.workload),
            generation=req.generation,
            domain=req.domain,
            partition_id=req.job_id,
            sample_count=req.sample_count,
            behavior_policy_version=req.behavior_policy_version,
            max_policy_staleness=policy.max_policy_staleness,
            priority=policy.priority,
            producer_role=check_name("producer_role", req.producer_role),
            consumer_role=check_name("consumer_role", req.consumer_role),
            state=S.RESERVED,
            metadata=req.metadata if isinstance(req.metadata, JobMetadata) else JobMetadata(),
        )
        return Reserved(job=job, at=at, by=by)

    def _refusal(self, policy: WorkloadPolicy, req: ReserveRequest, now: float) -> Refused | None:
        """Why ``req`` may not be admitted now under ``policy`` (None: it may)."""
        key = policy.key
        if req.generation != policy.generation:
            return Refused(
                "superseded",
                f"{key}: generation {req.generation} is not the workload's current one "
                f"({policy.generation}): it was created again",
            )
        if self.is_ended(policy):
            end = self.ended[key]
            return Refused("ended", f"{key}: generation {end.generation} ended ({end.state})")
        gk = policy.counts_key
        in_flight, completed = self.in_flight[gk], self.completed[gk]
        if in_flight >= policy.max_in_flight:
            return Refused(
                "in_flight", f"{key}: {in_flight} jobs in flight (max_in_flight {policy.max_in_flight})"
            )
        target = policy.completion_target
        if target is not None and completed + in_flight >= target:
            return Refused(
                "completion_target",
                f"{key}: completion target {target} reached "
                f"({completed} completed, {in_flight} in flight)",
            )
        if req.task_type == "rl":
            if self.active_rollouts[gk] >= policy.max_active_rollouts:
                return Refused(
                    "rollouts",
                    f"{key}: {self.active_rollouts[gk]} rollouts active "
                    f"(max {policy.max_active_rollouts})",
                )
            active, limit = self.active_rollouts["*"], self.limits.max_active_rollouts
            ahead = 0
            if active < limit and self.queue.waiters:
                # A free slot goes to the tenant furthest behind its share first.
                waiter = self.queue.waiters.get(req.job_id)
                order = admission_key(policy.priority,
                                    self.admission_lag(req.tenant_id, policy.weight, now),
                                    waiter.since if waiter else now)
                ahead = self.queue.ahead(req.job_id, order, self._waiter_lag(now))
            if active + ahead >= limit:
                return Refused(
                    "global_rollouts",
                    f"global: {active} rollouts active (max {limit})"
                    + (f", {ahead} reserves of tenants further behind their share first"
                       if ahead else ""),
                )
        return None

    def decide_workload_end(
        self, tenant_id: str, workload: str, *, at: float, by: str
    ) -> WorkloadEnded | None:
        """The end of the workload's current generation, if it has just come: its
        completion target of jobs completed (``done``), or as many failed (``failed``:
        it would go on failing), and no job of it in flight. None: not yet, no
        target, or ended already."""
        policy = self.policies.get(f"{tenant_id}.{workload}")
        if policy is None or policy.completion_target is None or self.is_ended(policy):
            return None
        c = self.counts(policy)
        target = policy.completion_target
        if c["in_flight"]:
            return None
        if c["completed"] >= target:
            state: Literal["done", "failed"] = "done"
            reason = f"{c['completed']} jobs completed (completion target {target})"
        elif c["failed"] >= target:
            state = "failed"
            reason = (
                f"{c['failed']} jobs failed, as many as its completion target ({target}), "
                f"with {c['completed']} completed: see the jobs' reasons"
            )
        else:
            return None
        return WorkloadEnded(
            tenant_id=tenant_id,
            workload=workload,
            generation=policy.generation,
            state=state,
            completed=c["completed"],
            failed=c["failed"],
            dropped=c["dropped"],
            last_version=self.versions.get(policy.key, 0),
            reason=reason,
            at=at,
            by=by,
        )

    def pending_ends(self, *, at: float, by: str) -> list[WorkloadEnded]:
        """Every workload generation whose end is due and not in the log yet (after a
        restart: the scheduler stopped between a last completion and its end)."""
        out = []
        for p in self.policies.values():
            end = self.decide_workload_end(p.tenant_id, p.workload, at=at, by=by)
            if end is not None:
                out.append(end)
        return out

    def decide_mark(
        self,
        job_id: str,
        state: JobState,
        *,
        attempt: int,
        sample_count: int | None,
        at: float,
        by: str,
    ) -> Marked | TrainingJob:
        job = self.get(job_id)
        if job.state is state:
            return job  # a retried mark that already landed
        if job.state in COMPUTING and attempt != job.attempt:
            raise StaleLease(
                f"job {job_id}: lease {attempt} on stage {COMPUTING[job.state]} is stale "
                f"(current lease {job.attempt} held by {job.holder or 'nobody'})"
            )
        changes: dict[str, object] = {"state": state, "holder": ""}
        if sample_count is not None:
            changes["sample_count"] = sample_count
        ev = Marked(job=msgspec.structs.replace(job, **changes), at=at, by=by)
        transition(job, ev)
        return ev

    def decide_lease_stage(
        self, job_id: str, stage: str, *, now: float, at: float, by: str
    ) -> StageLeased | TrainingJob:
        if stage not in STAGES:
            raise InvalidSpec(f"unknown stage {stage!r}; stages are {sorted(STAGES)}")
        job = self.get(job_id)
        _needs, computing = STAGES[stage]
        if job.state is computing:
            if job.holder == by:
                return job  # our own lease, asked again (a retry or a redelivery)
            if self.deadlines.get(job_id, 0.0) > now:
                raise Conflict(
                    f"job {job_id}: stage {stage} is leased to {job.holder} "
                    f"(lease {job.attempt}); two workers never run one stage"
                )
        ev = StageLeased(
            stage=stage,
            job=msgspec.structs.replace(job, state=computing, attempt=job.attempt + 1, holder=by),
            at=at,
            by=by,
        )
        transition(job, ev)
        return ev

    def is_stale(self, job: TrainingJob) -> bool:
        if job.task_type != "rl" or job.max_policy_staleness is None:
            return False
        lag = self.current_version(job.tenant_id, job.workload) - job.behavior_policy_version
        return lag > job.max_policy_staleness

    def stale_reason(self, job: TrainingJob) -> str:
        cur = self.current_version(job.tenant_id, job.workload)
        return (
            f"stale: behaviour policy version {job.behavior_policy_version} lags current "
            f"version {cur} by {cur - job.behavior_policy_version} "
            f"(max_policy_staleness {job.max_policy_staleness})"
        )

    def decide_lease(self, job: TrainingJob, *, at: float, by: str) -> Leased | Dropped:
        """Lease a ready job, or drop it if it became stale while it waited."""
        if self.is_stale(job):
            return Dropped(
                job=msgspec.structs.replace(
                    job, state=S.DROPPED, holder="", reason=self.stale_reason(job)
                ),
                at=at,
                by=by,
            )
        ev = Leased(
            job=msgspec.structs.replace(job, state=S.LEASED, attempt=job.attempt + 1, holder=by),
            at=at,
            by=by,
        )
        transition(job, ev)
        return ev

    def check_lease(self, job_id: str, attempt: int, *, verb: str) -> TrainingJob:
        job = self.get(job_id)
        if job.state is not S.LEASED and job.state not in COMPUTING:
            raise IllegalTransition(
                f"cannot {verb} job {job_id}: it is {job.state.value}, not leased"
            )
        if attempt != job.attempt:
            raise StaleLease(
                f"cannot {verb} job {job_id}: lease {attempt} expired and the job was "
                f"leased again (lease {job.attempt}, holder {job.holder or 'nobody'})"
            )
        return job

    def touch(self, job_id: str, attempt: int, *, now: float) -> TrainingJob:
        job = self.check_lease(job_id, attempt, verb="touch")
        self.deadlines[job_id] = now + self.lease_ttl_s
        return job

    def decide_complete(
        self, job_id: str, attempt: int, *, result_version: int | None, at: float, by: str
    ) -> Completed | TrainingJob:
        job = self.get(job_id)
        if job.state is S.COMPLETED and job.attempt == attempt:
            return job  # a retried complete that already landed
        if job.state is not S.LEASED:
            raise IllegalTransition(
                f"cannot complete job {job_id}: it is {job.state.value}, not leased"
            )
        self.check_lease(job_id, attempt, verb="complete")
        ev = Completed(
            job=msgspec.structs.replace(
                job, state=S.COMPLETED, holder="", result_version=result_version
            ),
            at=at,
            by=by,
        )
        transition(job, ev)
        return ev

    def decide_end(
        self,
        job_id: str,
        kind: Literal["drop", "fail"],
        reason: str,
        *,
        attempt: int,
        at: float,
        by: str,
    ) -> Dropped | Failed | TrainingJob:
        job = self.get(job_id)
        target = S.DROPPED if kind == "drop" else S.FAILED
        if job.state is target:
            return job
        if job.state in TERMINAL_STATES:
            raise IllegalTransition(f"cannot {kind} job {job_id}: it is already {job.state.value}")
        if attempt and attempt != job.attempt:
            raise StaleLease(
                f"cannot {kind} job {job_id}: lease {attempt} is stale (current {job.attempt})"
            )
        new = msgspec.structs.replace(job, state=target, holder="", reason=reason or kind)
        return Dropped(job=new, at=at, by=by) if kind == "drop" else Failed(job=new, at=at, by=by)

    def decide_expiries(self, *, now: float, at: float, by: str) -> list[LeaseExpired | Failed]:
        """Actor leases past their deadline go back to ready (stage leases are
        re-taken on redelivery instead: their durable consumer resends the work); a
        job whose leases lapsed ``MAX_LAPSED_LEASES`` times fails instead: a job that
        stops every actor that takes it (a poison job: data or state the actor cannot
        read) would otherwise take the shared actor down for every tenant, forever."""
        out: list[LeaseExpired | Failed] = []
        for job_id, deadline in self.deadlines.items():
            if deadline > now:
                continue
            job = self.jobs.get(job_id)
            if job is None or job.state is not S.LEASED:
                continue
            lapsed = job.lapsed + 1
            if lapsed >= MAX_LAPSED_LEASES:
                reason = (f"leased {lapsed} times and each holder stopped without finishing it "
                          f"(last: {job.holder or 'unknown'}): failed so that it stops taking "
                          "the actor down; submit it again if its data was not the cause")
                out.append(Failed(job=msgspec.structs.replace(
                    job, state=S.FAILED, holder="", lapsed=lapsed, reason=reason), at=at, by=by))
            else:
                out.append(LeaseExpired(job=msgspec.structs.replace(
                    job, state=S.READY, holder="", lapsed=lapsed), at=at, by=by))
        return out

    def effects_of(self, job: TrainingJob) -> Effects:
        eff = Effects()
        if job.state in TERMINAL_STATES and job.partition_id:
            eff.clear_partitions.append((job.tenant_id, job.partition_id))
        return eff
