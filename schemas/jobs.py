"""The training job descriptor (the paper's Table 3), its states and events.

Each event carries a snapshot of the job *after* it, so a job's current state
is its last event; which event may follow which is decided in
``joynexus.agents.lifecycle`` (pure, no I/O).

See docs/ARCHITECTURE.md, "The job lifecycle is an event log".
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Literal

import msgspec

from joynexus.schemas.base import WIRE_VERSION, Wire
from joynexus.schemas.errors import InvalidSpec


class JobState(StrEnum):
    RESERVED = "reserved"
    PRODUCING = "producing"
    NEEDS_ACTOR_FORWARD = "needs_actor_forward"
    COMPUTING_ACTOR_FORWARD = "computing_actor_forward"
    NEEDS_ADVANTAGES = "needs_advantages"
    COMPUTING_ADVANTAGES = "computing_advantages"
    READY = "ready"
    LEASED = "leased"
    COMPLETED = "completed"
    DROPPED = "dropped"
    FAILED = "failed"


TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.DROPPED, JobState.FAILED})

#: Pre-training stages run by stage workers: stage -> (waiting state, working state).
STAGES: dict[str, tuple[JobState, JobState]] = {
    "actor_forward": (JobState.NEEDS_ACTOR_FORWARD, JobState.COMPUTING_ACTOR_FORWARD),
    "advantages": (JobState.NEEDS_ADVANTAGES, JobState.COMPUTING_ADVANTAGES),
}

TaskType = Literal["rl", "sft", "eval", "custom"]
TASK_TYPES: tuple[str, ...] = ("rl", "sft", "eval", "custom")

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def check_name(kind: str, value: str) -> str:
    """Validate a name that becomes a subject token (tenant, role, ...)."""
    if not isinstance(value, str) or not _NAME.match(value):
        shown = repr(value[:40]) + (f"...(+{len(value) - 40} chars)" if len(value) > 40 else "") \
            if isinstance(value, str) else type(value).__name__
        raise InvalidSpec(
            f"{kind} {shown} is not a valid name: use 1-32 characters of "
            "lowercase letters, digits, '-' or '_', starting with a letter or digit"
        )
    return value


class JobMetadata(Wire, kw_only=True, omit_defaults=True):
    #: Identifies the sample layout (cameras, image size, state/action dims...).
    schema_signature: str = ""
    extra: dict[str, str] = {}


class TrainingJob(Wire, kw_only=True, omit_defaults=True):
    """One unit of training work (Table 3 of the paper, plus bookkeeping)."""

    job_id: str
    tenant_id: str
    task_type: TaskType
    #: The workload the job belongs to (its name, and which creation of that name:
    #: a name ended and created again counts from generation 1 + the last).
    workload: str
    generation: int = 1
    domain: str = ""
    partition_id: str = ""
    sample_count: int = 0
    behavior_policy_version: int = 0
    max_policy_staleness: int | None = None
    priority: int = 0
    created_seq: int = 0
    ready_seq: int = 0
    producer_role: str = "producer"
    consumer_role: str = "actor"
    state: JobState = JobState.RESERVED
    metadata: JobMetadata = msgspec.field(default_factory=JobMetadata)
    #: Leases granted so far (actor and stage leases); a lease is named by it.
    attempt: int = 0
    #: Instance holding the current lease, "" when none.
    holder: str = ""
    #: Actor leases that lapsed (their holder stopped without completing or failing
    #: the job); at ``MAX_LAPSED_LEASES`` the job fails instead of being leased again.
    lapsed: int = 0
    #: Why the job is dropped or failed.
    reason: str = ""
    #: Policy version the consumer produced when it completed the job.
    result_version: int | None = None


class _Event(Wire, kw_only=True, tag_field="event", omit_defaults=True):
    v: int = WIRE_VERSION
    #: The job after this event.
    job: TrainingJob
    #: Wall-clock seconds (for accounting and display only; never for decisions).
    at: float = 0.0
    #: The agent instance that caused the event.
    by: str = ""


class Reserved(_Event, tag="reserved"):
    pass


class Marked(_Event, tag="marked"):
    """A producer or stage holder moved the job forward (e.g. to ready)."""


class StageLeased(_Event, kw_only=True, tag="stage_leased"):
    stage: str


class Leased(_Event, tag="leased"):
    pass


class LeaseExpired(_Event, tag="lease_expired"):
    pass


class Completed(_Event, tag="completed"):
    pass


class Dropped(_Event, tag="dropped"):
    pass


class Failed(_Event, tag="failed"):
    pass


JobEvent = Reserved | Marked | StageLeased | Leased | LeaseExpired | Completed | Dropped | Failed

#: How a workload generation ended: ``done`` (its completion target of jobs
#: completed), ``failed`` (as many jobs failed as it was to complete, none in
#: flight: it would never finish) or ``cancelled`` (its tenant cancelled it).
WorkloadEnd = Literal["done", "failed", "cancelled"]


class WorkloadEnded(Wire, kw_only=True, tag_field="event", tag="workload_ended", omit_defaults=True):
    """The last event of a workload generation in the job event log (its own
    subject, ``Names.workload_end_subject``): the scheduler appends it once the
    generation's completion target is met and no job of it is in flight, the
    control plane when its tenant cancels it. The control plane turns it into the
    workload record's state; the SDK's ``events(workload)`` stops on it."""

    v: int = WIRE_VERSION
    tenant_id: str
    workload: str
    generation: int = 1
    state: WorkloadEnd
    completed: int = 0
    failed: int = 0
    dropped: int = 0
    #: The newest policy version its jobs produced (0: none).
    last_version: int = 0
    reason: str = ""
    at: float = 0.0
    by: str = ""


#: Anything in the job event log's job subjects: a job's event or a workload's end.
LogEvent = JobEvent | WorkloadEnded


#: The largest share weight (a tenant's weight over another's: at most this ratio).
MAX_WEIGHT = 1000


class Admission(Wire, kw_only=True, omit_defaults=True):
    """A workload's admission and ordering bounds: what a tenant asks for in its spec
    (``schemas.workloads.Scheduling``) and what the scheduler enforces per
    generation (:class:`WorkloadPolicy`)."""

    priority: int = 0
    #: Weight of the tenant's share of the trainer among equal priorities (the
    #: operator's: the quota's ``share_weight`` replaces the spec's, as for priority).
    weight: int = 1
    #: Non-terminal jobs allowed at once.
    max_in_flight: int = 2
    #: Jobs in reserved/producing at once (rollouts under way) for this task.
    max_active_rollouts: int = 1
    #: Stop admitting once this many jobs completed or are in flight.
    completion_target: int | None = None
    #: An RL job is dropped if its behaviour version lags by more than this.
    max_policy_staleness: int | None = None

    def check_bounds(self, prefix: str = "") -> None:
        """InvalidSpec naming the first bound out of range (``prefix``: before the
        field's name in the message, e.g. ``scheduling.``)."""
        if not 1 <= self.weight <= MAX_WEIGHT:
            raise InvalidSpec(f"{prefix}weight must be in 1..{MAX_WEIGHT}, got {self.weight}")
        for field in ("max_in_flight", "max_active_rollouts"):
            if getattr(self, field) < 1:
                raise InvalidSpec(f"{prefix}{field} must be >= 1, got {getattr(self, field)}")
        if self.completion_target is not None and self.completion_target < 1:
            raise InvalidSpec(
                f"{prefix}completion_target must be >= 1, got {self.completion_target}"
            )
        if self.max_policy_staleness is not None and self.max_policy_staleness < 0:
            raise InvalidSpec(
                f"{prefix}max_policy_staleness must be >= 0, got {self.max_policy_staleness}"
            )


class WorkloadPolicy(Admission, kw_only=True, omit_defaults=True):
    """Admission and ordering for one workload (the paper's per-policy limits).

    Jobs are counted per workload generation: a workload created again under a
    name that ended starts from no jobs, whatever the name's earlier generations
    completed. The tenant as a whole stays bounded by its quota at the control
    plane (one active workload per task type, every number within the quota)."""

    tenant_id: str
    task_type: TaskType
    workload: str = "default"
    generation: int = 1

    def __post_init__(self) -> None:
        check_name("tenant_id", self.tenant_id)
        check_name("workload", self.workload)
        if self.generation < 1:
            raise InvalidSpec(f"generation must be >= 1, got {self.generation}")
        if self.task_type not in TASK_TYPES:
            raise InvalidSpec(f"task_type {self.task_type!r} is not one of {TASK_TYPES}")
        self.check_bounds()

    @property
    def key(self) -> str:
        """``<tenant>.<workload>``: the policy's key in the tenants bucket."""
        return f"{self.tenant_id}.{self.workload}"

    @property
    def counts_key(self) -> str:
        """What the scheduler counts this generation's jobs under."""
        return generation_key(self.tenant_id, self.workload, self.generation)


def generation_key(tenant_id: str, workload: str, generation: int) -> str:
    """``<tenant>.<workload>.<generation>``: one creation of one workload."""
    return f"{tenant_id}.{workload}.{generation}"


class GlobalLimits(Wire, kw_only=True, omit_defaults=True):
    #: Rollouts (jobs in reserved/producing) across all tenants.
    max_active_rollouts: int = 3

    def __post_init__(self) -> None:
        if self.max_active_rollouts < 1:
            raise InvalidSpec(f"max_active_rollouts must be >= 1, got {self.max_active_rollouts}")
