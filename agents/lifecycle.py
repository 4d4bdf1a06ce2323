"""The Training Scheduler's pure core: lifecycle rules, admission, lease order.

No I/O and no clock reads: every function takes ``now`` (monotonic seconds,
used only for lease deadlines) from its caller, so every (state, event) pair
is tabled in tests/unit/test_lifecycle.py. The agent is a thin loop around
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
    TrainingJob,
    WorkloadEnded,
    WorkloadPolicy,
    check_name,
    generation_key,
)
from joynexus.schemas.scheduler import Refusal, ReserveRequest

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


@dataclass(frozen=True)
class Refused:
    """Why admission refused a job: a code to decide on and the words to show."""

    code: Refusal
    reason: str


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
    #: Per "<tenant>.<workload>": the admission policy of its current generation.
    policies: dict[str, WorkloadPolicy] = field(default_factory=dict)
    #: Per "<tenant>.<workload>": how its newest ended generation ended.
    ended: dict[str, WorkloadEnded] = field(default_factory=dict)
    jobs: dict[str, TrainingJob] = field(default_factory=dict)
    last_seq: dict[str, int] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    #: Current policy version per "<tenant>.<workload>".
    versions: dict[str, int] = field(default_factory=dict)
    # Jobs per workload generation ("<tenant>.<workload>.<generation>"), and
    # active_rollouts["*"]: rollouts of every tenant.
    in_flight: Counter[str] = field(default_factory=Counter)
    active_rollouts: Counter[str] = field(default_factory=Counter)
    started: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
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
    def _account(self, job: TrainingJob, sign: int) -> None:
        gk = generation_key(job.tenant_id, job.workload, job.generation)
        self.by_state[job.state.value] += sign
        self.by_tenant_state[job.tenant_id][job.state.value] += sign
        self.started[gk] += sign
        if job.state not in TERMINAL_STATES:
            self.in_flight[gk] += sign
        if job.task_type == "rl" and job.state in ROLLOUT_STATES:
            self.active_rollouts[gk] += sign
            self.active_rollouts["*"] += sign
        if job.state is S.COMPLETED:
            self.completed[gk] += sign
        elif job.state is S.FAILED:
            self.failed[gk] += sign
        elif job.state is S.DROPPED:
            self.dropped[gk] += sign

    def is_superseded(self, policy: WorkloadPolicy) -> bool:
        """Whether a newer generation's policy is in force for its workload (``policy``
        is a late retry of an older create)."""
        cur = self.policies.get(policy.key)
        return cur is not None and cur.generation > policy.generation

    def set_policy(self, policy: WorkloadPolicy) -> WorkloadPolicy:
        """Take ``policy`` for its workload unless it is superseded; returns the
        policy in force."""
        if self.is_superseded(policy):
            return self.policies[policy.key]
        self.policies[policy.key] = policy
        return policy

    def is_ended(self, policy: WorkloadPolicy) -> bool:
        """Whether the policy's generation has ended (its WorkloadEnded is in the log)."""
        end = self.ended.get(policy.key)
        return end is not None and end.generation >= policy.generation

    def note_ended(self, end: WorkloadEnded) -> WorkloadEnded | None:
        """Record a generation's end (from the log, or about to be appended); returns
        the end it replaced, for :meth:`forget_ended` if the append fails."""
        key = f"{end.tenant_id}.{end.workload}"
        prev = self.ended.get(key)
        if prev is None or prev.generation < end.generation:
            self.ended[key] = end
        return prev

    def forget_ended(self, end: WorkloadEnded, prev: WorkloadEnded | None) -> None:
        key = f"{end.tenant_id}.{end.workload}"
        if self.ended.get(key) is end:
            if prev is None:
                self.ended.pop(key, None)
            else:
                self.ended[key] = prev

    def counts(self, policy: WorkloadPolicy) -> dict[str, int]:
        """The policy's generation's jobs: in flight, completed, failed, dropped."""
        gk = policy.counts_key
        return {
            "in_flight": self.in_flight[gk],
            "completed": self.completed[gk],
            "failed": self.failed[gk],
            "dropped": self.dropped[gk],
        }

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

    def current_version(self, tenant_id: str, workload: str) -> int:
        return self.versions.get(f"{tenant_id}.{workload}", 0)

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
            key = f"{new.tenant_id}.{new.workload}"
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
            key = f"{job.tenant_id}.{job.workload}"
            self.versions[key] = max(self.versions.get(key, 0), job.result_version)
        self.commit(job.job_id, seq)

    def _push_ready(self, job: TrainingJob) -> None:
        heapq.heappush(self.ready[job.consumer_role], (_ready_key(job), job.job_id))

    # ------------------------------------------------------------ decisions
    def decide_reserve(
        self, req: ReserveRequest, *, at: float, by: str
    ) -> Reserved | TrainingJob | Refused:
        """A Reserved event, the existing job (a retried reserve), or why admission refused."""
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
        refused = self._refusal(policy, req)
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

    def _refusal(self, policy: WorkloadPolicy, req: ReserveRequest) -> Refused | None:
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
            if self.active_rollouts["*"] >= self.limits.max_active_rollouts:
                return Refused(
                    "global_rollouts",
                    f"global: {self.active_rollouts['*']} rollouts active "
                    f"(max {self.limits.max_active_rollouts})",
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
        lag = self.current_version(job.tenant_id, job.workload) - job.behavior_policy_version
        return lag > job.max_policy_staleness

    def stale_reason(self, job: TrainingJob) -> str:
        cur = self.current_version(job.tenant_id, job.workload)
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
