"""The job lifecycle's rules, and the scheduler's state as the event log makes it.

``allowed``/``transition`` (with ``MARK_TARGETS``) say which event may follow a
job in which state; :class:`JobBook` holds every job, policy, counter, lease
deadline and ready queue, and applies events to them: ``apply`` a decided
event before its append, then ``commit`` its stream sequence or ``revert`` it,
and ``load`` a job's latest event when rebuilding after a restart. No I/O and
no clock reads: ``now`` (monotonic seconds, for lease deadlines) comes from the
caller, so every (state, event) pair is tabled in tests/unit/test_lifecycle.py.
The decisions on top of this state are ``agents.schedcore.SchedulerCore``.

See docs/ARCHITECTURE.md, "The job lifecycle is an event log" (the states,
actor_forward included) and "The Training Scheduler: one decider, many callers".
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import msgspec

from joynexus.agents.fairshare import FairShare
from joynexus.schemas import jobs
from joynexus.schemas.errors import IllegalTransition, UnknownJob
from joynexus.schemas.jobs import (
    STAGES,
    TERMINAL_STATES,
    GlobalLimits,
    JobEvent,
    JobState,
    TrainingJob,
    WorkloadEnded,
    WorkloadPolicy,
    generation_key,
)

S = JobState
_NEEDS = {needs: stage for stage, (needs, _) in STAGES.items()}
#: Each stage's computing state -> the stage.
COMPUTING = {computing: stage for stage, (_, computing) in STAGES.items()}

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
        case jobs.Reserved():
            return prev is None and to is S.RESERVED
        case _ if prev is None or prev in TERMINAL_STATES:
            return False
        case jobs.Marked():
            return to in MARK_TARGETS.get(prev, frozenset())
        case jobs.StageLeased(stage=stage):
            if stage not in STAGES:
                return False
            needs, computing = STAGES[stage]
            return to is computing and prev in (needs, computing)
        case jobs.Leased():
            return prev is S.READY and to is S.LEASED
        case jobs.LeaseExpired():
            return prev is S.LEASED and to is S.READY
        case jobs.Completed():
            return prev is S.LEASED and to is S.COMPLETED
        case jobs.Dropped():
            return to is S.DROPPED
        case jobs.Failed():
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


def ready_key(job: TrainingJob) -> tuple[int, int, int]:
    # Within one tenant: highest priority first; RL before SFT; then FIFO (which
    # tenant goes first is the fair share's: ``SchedulerCore.next_ready``).
    return (-job.priority, 0 if job.task_type == "rl" else 1, job.ready_seq)


@dataclass
class JobBook:
    """All scheduler state, rebuilt from the event log, and how events change it (pure)."""

    lease_ttl_s: float = 30.0
    limits: GlobalLimits = field(default_factory=GlobalLimits)
    #: Per "<tenant>.<workload>": the admission policy of its current generation.
    policies: dict[str, WorkloadPolicy] = field(default_factory=dict)
    #: Per "<tenant>.<workload>": how its newest ended generation ended.
    ended: dict[str, WorkloadEnded] = field(default_factory=dict)
    jobs: dict[str, TrainingJob] = field(default_factory=dict)
    #: Job ids per tenant (of ``jobs``): a tenant's lookups never scan the others' jobs.
    by_tenant: dict[str, set[str]] = field(default_factory=dict)
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
    #: Per consumer role, per tenant: heap of (key, job_id) of committed ready jobs
    #: (lazy deletion); the lease picks a tenant (fair share), then its heap's top.
    ready: defaultdict[str, dict[str, list[tuple[tuple[int, int, int], str]]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    max_seq: int = 0
    #: Training work charged per tenant at each completion (``agents.fairshare``).
    fair: FairShare = field(default_factory=FairShare)
    #: When (``now``) each job now leased to the actor was leased.
    leased_at: dict[str, float] = field(default_factory=dict)
    #: Charges decided by ``apply`` and made by ``commit`` (dropped by ``revert``):
    #: (tenant, rows, now, lease seconds or None).
    _charges: dict[str, tuple[str, int, float, float | None]] = field(default_factory=dict)

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
            self._forget(job_id)
            self.deadlines.pop(job_id, None)
            return
        self._account(new, +1)
        self.jobs[job_id] = new
        self.by_tenant.setdefault(new.tenant_id, set()).add(job_id)

    def _forget(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        ids = self.by_tenant.get(job.tenant_id)
        if ids is not None:
            ids.discard(job_id)
            if not ids:
                del self.by_tenant[job.tenant_id]

    def jobs_of(self, tenant_id: str) -> list[TrainingJob]:
        """The tenant's jobs held (terminal ones until pruned), in no particular order."""
        return [self.jobs[j] for j in self.by_tenant.get(tenant_id, ())]

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
        if new.state in (S.LEASED, *COMPUTING):
            self.deadlines[new.job_id] = now + self.lease_ttl_s
        else:
            self.deadlines.pop(new.job_id, None)
        if prev is None:
            self._admitted(new, now)
        if new.state is S.LEASED:
            self.leased_at[new.job_id] = now
        elif prev is not None and prev.state is S.LEASED:
            at = self.leased_at.pop(new.job_id, None)
            if new.state is S.COMPLETED:
                self._charges[new.job_id] = (
                    new.tenant_id, new.sample_count, now, None if at is None else now - at
                )
        if new.state is S.COMPLETED and new.result_version is not None:
            key = f"{new.tenant_id}.{new.workload}"
            self.versions[key] = max(self.versions.get(key, 0), new.result_version)
        return prev

    def revert(self, job_id: str, prev: TrainingJob | None, now: float) -> None:
        """Undo an applied event whose append failed."""
        self._replace(prev, job_id)
        charged = self._charges.pop(job_id, None)
        self.leased_at.pop(job_id, None)
        if prev is not None and prev.state is S.LEASED:
            held = charged[3] if charged else None
            self.leased_at[job_id] = now if charged is None or held is None else charged[2] - held
        if prev is not None and prev.state in (S.LEASED, *COMPUTING):
            self.deadlines[job_id] = now + self.lease_ttl_s
        if prev is not None and prev.state is S.READY:
            self._push_ready(prev)

    def commit(self, job_id: str, seq: int) -> TrainingJob:
        """Record the stream sequence of an appended event (fills created/ready_seq)."""
        job = self.jobs[job_id]
        self.last_seq[job_id] = seq
        charge = self._charges.pop(job_id, None)
        if charge is not None:
            tenant, rows, at, seconds = charge
            p = self.policies.get(f"{tenant}.{job.workload}")
            self.fair.charge(tenant, rows, at, seconds, weight=p.weight if p else 1)
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
        if job.state in (S.LEASED, *COMPUTING):
            # Deadlines do not survive a restart; give holders a full TTL to touch.
            self.deadlines[job.job_id] = now + self.lease_ttl_s
        if job.state is S.LEASED:
            self.leased_at[job.job_id] = now  # its time before the restart is not known
        if job.state is S.COMPLETED and job.result_version is not None:
            key = f"{job.tenant_id}.{job.workload}"
            self.versions[key] = max(self.versions.get(key, 0), job.result_version)
        self.commit(job.job_id, seq)

    def _admitted(self, job: TrainingJob, now: float) -> None:
        """A job was admitted (``apply`` of its Reserved): the fair share's hook."""

    def _push_ready(self, job: TrainingJob) -> None:
        heap = self.ready[job.consumer_role].setdefault(job.tenant_id, [])
        heapq.heappush(heap, (ready_key(job), job.job_id))

    def prune_terminal(self, keep: int) -> int:
        """Forget the oldest terminal jobs beyond ``keep`` (their events stay in the log)."""
        terminal = [j for j in self.jobs.values() if j.state in TERMINAL_STATES]
        if len(terminal) <= keep:
            return 0
        terminal.sort(key=lambda j: self.last_seq.get(j.job_id, 0))
        n = len(terminal) - keep
        for j in terminal[:n]:
            # Keep the counters (completed, by_state) as they are: accounting survives pruning.
            self._forget(j.job_id)
            self.last_seq.pop(j.job_id, None)
        return n
