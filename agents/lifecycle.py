"""The Training Scheduler's pure core: lifecycle rules, admission, lease order.

No I/O and no clock reads: every function takes ``now`` (monotonic seconds,
used only for lease deadlines) from its caller, so every (state, event) pair
is tabled in tests/test_lifecycle.py. The agent is a thin loop around
:class:`SchedulerCore` (decide, apply optimistically, append, then commit the
stream sequence or revert), and replaying each job's latest event through
:meth:`SchedulerCore.load` rebuilds the same state after a restart.

See docs/ARCHITECTURE.md, "The job lifecycle is an event log" (the states,
actor_forward included) and "The Training Scheduler: one decider, many callers".
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from joynexus.schemas.errors import (
    Conflict,
    IllegalTransition,
    InvalidSpec,
    StaleLease,
    UnknownJob,
    UnknownTenant,
)
from joynexus.schemas.jobs import (
    STAGES,
    TERMINAL_STATES,
    Completed,
    Dropped,
    Failed,
    GlobalLimits,
    JobEvent,
    JobMetadata,
    JobState,
    Leased,
    LeaseExpired,
    Marked,
    Reserved,
    StageLeased,
    TenantTaskPolicy,
    TrainingJob,
    check_name,
)
from joynexus.schemas.scheduler import ReserveRequest

S = JobState
_NEEDS = {needs: stage for stage, (needs, _) in STAGES.items()}
_COMPUTING = {computing: stage for stage, (_, computing) in STAGES.items()}

#: Where Marked may move a job from each state (the producer's and stage holders' moves).
MARK_TARGETS: dict[JobState, frozenset[JobState]] = {
    S.RESERVED: frozenset({S.PRODUCING, S.NEEDS_ACTOR_FORWARD, S.NEEDS_ADVANTAGES, S.READY}),
    S.PRODUCING: frozenset({S.NEEDS_ACTOR_FORWARD, S.NEEDS_ADVANTAGES, S.READY}),
    S.COMPUTING_ACTOR_FORWARD: frozenset({S.NEEDS_ADVANTAGES, S.READY}),
    S.COMPUTING_ADVANTAGES: frozenset({S.READY}),
}

#: States that count as an active rollout (the producer is interacting).
ROLLOUT_STATES = frozenset({S.RESERVED, S.PRODUCING})


def allowed(prev: JobState | None, event: JobEvent) -> bool:
    """Whether ``event`` may follow a job in state ``prev`` (None: no job yet)."""
    to = event.job.state
    match event:
        case Reserved():
            return prev is None and to is S.RESERVED
        case _ if prev is None or prev in TERMINAL_STATES:
            return False
        case Marked():
            return to in MARK_TARGETS.get(prev, frozenset())
        case StageLeased(stage=stage):
            if stage not in STAGES:
                return False
            needs, computing = STAGES[stage]
            return to is computing and prev in (needs, computing)
        case Leased():
            return prev is S.READY and to is S.LEASED
        case LeaseExpired():
            return prev is S.LEASED and to is S.READY
        case Completed():
            return prev is S.LEASED and to is S.COMPLETED
        case Dropped():
            return to is S.DROPPED
        case Failed():
            return to is S.FAILED
    return False


def transition(job: TrainingJob | None, event: JobEvent) -> TrainingJob:
    """Validate ``event`` against ``job`` and return the job after it.

    Raises IllegalTransition naming both states when the lifecycle forbids it.
    """
    new = event.job
    if job is not None and (job.job_id, job.tenant_id) != (new.job_id, new.tenant_id):
        raise IllegalTransition(
            f"event for job {new.job_id} of {new.tenant_id} applied to job {job.job_id}"
        )
    prev = job.state if job is not None else None
    if not allowed(prev, event):
        raise IllegalTransition(
            f"job {new.job_id}: {prev.value if prev else 'nothing'} -> {new.state.value} "
            f"({type(event).__name__}) is not allowed"
        )
    if job is not None and new.attempt < job.attempt:
        raise IllegalTransition(
            f"job {new.job_id}: attempt went back from {job.attempt} to {new.attempt}"
        )
    return new


@dataclass
class Effects:
    """What the agent must do besides appending events."""

    clear_partitions: list[tuple[str, str]] = field(default_factory=list)


def _ready_key(job: TrainingJob) -> tuple[int, int, int]:
    # Highest priority first; ready RL before SFT at equal priority; then FIFO.
    return (-job.priority, 0 if job.task_type == "rl" else 1, job.ready_seq)


@dataclass
class SchedulerCore:
    """All scheduler state, rebuilt from the event log; every method is pure."""

    lease_ttl_s: float = 30.0
    limits: GlobalLimits = field(default_factory=GlobalLimits)
    policies: dict[str, TenantTaskPolicy] = field(default_factory=dict)
    jobs: dict[str, TrainingJob] = field(default_factory=dict)
    last_seq: dict[str, int] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    #: Current policy version per "<tenant>.<policy_key>".
    versions: dict[str, int] = field(default_factory=dict)
    in_flight: Counter[str] = field(default_factory=Counter)
    active_rollouts: Counter[str] = field(default_factory=Counter)
    started: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    by_state: Counter[str] = field(default_factory=Counter)
    by_tenant_state: defaultdict[str, Counter[str]] = field(
        default_factory=lambda: defaultdict(Counter)
    )
    #: Per consumer role: heap of (key, job_id) of committed ready jobs (lazy deletion).
    ready: defaultdict[str, list[tuple[tuple[int, int, int], str]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    max_seq: int = 0

    # ------------------------------------------------------------ bookkeeping
    @staticmethod
    def policy_key(tenant_id: str, task_type: str) -> str:
        return f"{tenant_id}.{task_type}"

    def _account(self, job: TrainingJob, sign: int) -> None:
        pk = self.policy_key(job.tenant_id, job.task_type)
        self.by_state[job.state.value] += sign
        self.by_tenant_state[job.tenant_id][job.state.value] += sign
        self.started[pk] += sign
        if job.state not in TERMINAL_STATES:
            self.in_flight[pk] += sign
        if job.task_type == "rl" and job.state in ROLLOUT_STATES:
            self.active_rollouts[pk] += sign
            self.active_rollouts["*"] += sign
        if job.state is S.COMPLETED:
            self.completed[pk] += sign

    def _replace(self, new: TrainingJob | None, job_id: str) -> None:
        old = self.jobs.get(job_id)
        if old is not None:
            self._account(old, -1)
        if new is None:
            self.jobs.pop(job_id, None)
            self.deadlines.pop(job_id, None)
            return
        self._account(new, +1)
        self.jobs[job_id] = new

    def get(self, job_id: str) -> TrainingJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"no job {job_id!r}: it was never reserved (or is past retention)")
        return job

    def current_version(self, tenant_id: str, policy_key: str) -> int:
        return self.versions.get(f"{tenant_id}.{policy_key}", 0)

    # ------------------------------------------------------------ apply / commit
    def apply(self, event: JobEvent, now: float) -> TrainingJob | None:
        """Apply a decided event before its append; returns the previous job (for revert)."""
        prev = self.jobs.get(event.job.job_id)
        new = transition(prev, event)
        self._replace(new, new.job_id)
        if new.state in (S.LEASED, *_COMPUTING):
            self.deadlines[new.job_id] = now + self.lease_ttl_s
        else:
            self.deadlines.pop(new.job_id, None)
        if new.state is S.COMPLETED and new.result_version is not None:
            key = f"{new.tenant_id}.{new.policy_key}"
            self.versions[key] = max(self.versions.get(key, 0), new.result_version)
        return prev

    def revert(self, job_id: str, prev: TrainingJob | None, now: float) -> None:
        """Undo an applied event whose append failed."""
        self._replace(prev, job_id)
        if prev is not None and prev.state in (S.LEASED, *_COMPUTING):
            self.deadlines[job_id] = now + self.lease_ttl_s
        if prev is not None and prev.state is S.READY:
            self._push_ready(prev)

    def commit(self, job_id: str, seq: int) -> TrainingJob:
        """Record the stream sequence of an appended event (fills created/ready_seq)."""
        job = self.jobs[job_id]
        self.last_seq[job_id] = seq
        self.max_seq = max(self.max_seq, seq)
        changes: dict[str, int] = {}
        if job.state is S.RESERVED and job.created_seq == 0:
            changes["created_seq"] = seq
        if job.state is S.READY and job.ready_seq == 0:
            changes["ready_seq"] = seq
        if changes:
            job = msgspec.structs.replace(job, **changes)
            self.jobs[job_id] = job
        if job.state is S.READY:
            self._push_ready(job)
        return job

    def load(self, event: JobEvent, seq: int, now: float) -> None:
        """Rebuild: take a job's last event from the log as its state."""
        job = event.job
        self._replace(job, job.job_id)
        if job.state in (S.LEASED, *_COMPUTING):
            # Deadlines do not survive a restart; give holders a full TTL to touch.
            self.deadlines[job.job_id] = now + self.lease_ttl_s
        if job.state is S.COMPLETED and job.result_version is not None:
            key = f"{job.tenant_id}.{job.policy_key}"
            self.versions[key] = max(self.versions.get(key, 0), job.result_version)
        self.commit(job.job_id, seq)

    def _push_ready(self, job: TrainingJob) -> None:
        heapq.heappush(self.ready[job.consumer_role], (_ready_key(job), job.job_id))

    # ------------------------------------------------------------ decisions
    def decide_reserve(
        self, req: ReserveRequest, *, at: float, by: str
    ) -> Reserved | TrainingJob | str:
        """A Reserved event, the existing job (a retried reserve), or why admission refused."""
        check_name("job_id", req.job_id)
        check_name("tenant_id", req.tenant_id)
        existing = self.jobs.get(req.job_id)
        if existing is not None:
            if existing.tenant_id != req.tenant_id:
                raise InvalidSpec(f"job id {req.job_id!r} is already used by another tenant")
            return existing
        pk = self.policy_key(req.tenant_id, req.task_type)
        policy = self.policies.get(pk)
        if policy is None:
            known = sorted(self.policies)
            raise UnknownTenant(
                f"tenant {req.tenant_id!r} has no policy for task {req.task_type!r}; "
                f"register one first (set_policy). Known: {', '.join(known) or 'none'}"
            )
        if self.in_flight[pk] >= policy.max_in_flight:
            return (
                f"{pk}: {self.in_flight[pk]} jobs in flight (max_in_flight {policy.max_in_flight})"
            )
        if policy.completion_target is not None and (
            self.completed[pk] + self.in_flight[pk] >= policy.completion_target
        ):
            return (
                f"{pk}: completion target {policy.completion_target} reached "
                f"({self.completed[pk]} completed, {self.in_flight[pk]} in flight)"
            )
        if req.task_type == "rl":
            if self.active_rollouts[pk] >= policy.max_active_rollouts:
                return f"{pk}: {self.active_rollouts[pk]} rollouts active (max {policy.max_active_rollouts})"
            if self.active_rollouts["*"] >= self.limits.max_active_rollouts:
                return (
                    f"global: {self.active_rollouts['*']} rollouts active "
                    f"(max {self.limits.max_active_rollouts})"
                )
        job = TrainingJob(
            job_id=req.job_id,
            tenant_id=req.tenant_id,
            task_type=req.task_type,
            policy_key=check_name("policy_key", req.policy_key),
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
        if job.state in _COMPUTING and attempt != job.attempt:
            raise StaleLease(
                f"job {job_id}: lease {attempt} on stage {_COMPUTING[job.state]} is stale "
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
        lag = self.current_version(job.tenant_id, job.policy_key) - job.behavior_policy_version
        return lag > job.max_policy_staleness

    def stale_reason(self, job: TrainingJob) -> str:
        cur = self.current_version(job.tenant_id, job.policy_key)
        return (
            f"stale: behaviour policy version {job.behavior_policy_version} lags current "
            f"version {cur} by {cur - job.behavior_policy_version} "
            f"(max_policy_staleness {job.max_policy_staleness})"
        )

    def next_ready(
        self, consumer_role: str, skip: set[str] | frozenset[str] = frozenset()
    ) -> TrainingJob | None:
        """The job lease_next would take: priority, then RL before SFT, then ready order."""
        heap = self.ready.get(consumer_role)
        if not heap:
            return None
        skipped: list[tuple[tuple[int, int, int], str]] = []
        found: TrainingJob | None = None
        while heap:
            key, job_id = heap[0]
            job = self.jobs.get(job_id)
            if job is None or job.state is not S.READY or _ready_key(job) != key:
                heapq.heappop(heap)  # lazily deleted entry
                continue
            if job_id in skip:
                skipped.append(heapq.heappop(heap))
                continue
            found = job
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def count_ready(self, consumer_role: str) -> int:
        return sum(
            1
            for _, job_id in self.ready.get(consumer_role, ())
            if (j := self.jobs.get(job_id)) is not None and j.state is S.READY
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
        if job.state is not S.LEASED and job.state not in _COMPUTING:
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

    def decide_expiries(self, *, now: float, at: float, by: str) -> list[LeaseExpired]:
        """Actor leases past their deadline go back to ready (stage leases are
        re-taken on redelivery instead: their durable consumer resends the work)."""
        out = []
        for job_id, deadline in self.deadlines.items():
            if deadline > now:
                continue
            job = self.jobs.get(job_id)
            if job is not None and job.state is S.LEASED:
                out.append(
                    LeaseExpired(
                        job=msgspec.structs.replace(job, state=S.READY, holder=""), at=at, by=by
                    )
                )
        return out

    def effects_of(self, job: TrainingJob) -> Effects:
        eff = Effects()
        if job.state in TERMINAL_STATES and job.partition_id:
            eff.clear_partitions.append((job.tenant_id, job.partition_id))
        return eff

    def prune_terminal(self, keep: int) -> int:
        """Forget the oldest terminal jobs beyond ``keep`` (their events stay in the log)."""
        terminal = [j for j in self.jobs.values() if j.state in TERMINAL_STATES]
        if len(terminal) <= keep:
            return 0
        terminal.sort(key=lambda j: self.last_seq.get(j.job_id, 0))
        n = len(terminal) - keep
        for j in terminal[:n]:
            # Keep the counters (completed, by_state) as they are: accounting survives pruning.
            self.jobs.pop(j.job_id, None)
            self.last_seq.pop(j.job_id, None)
        return n
