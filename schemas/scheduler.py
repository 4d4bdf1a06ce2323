"""Requests and replies of the Training Scheduler's API (``jnx.sched.<verb>``).

Every verb is idempotent (reserve by job_id, marks by target state, leases by holder or
request_id, complete by attempt), so a client may retry a call that got no answer.
See docs/ARCHITECTURE.md, "The Training Scheduler: one decider, many callers".
"""

from __future__ import annotations

from typing import Literal

import msgspec

from joynexus.schemas.base import Wire
from joynexus.schemas.jobs import (
    GlobalLimits,
    JobMetadata,
    JobState,
    TaskType,
    TrainingJob,
    WorkloadPolicy,
)

#: Why admission refused a job, as the code callers decide on (``Reply.refusal``):
#: wait and ask again (``in_flight``, ``rollouts``, ``global_rollouts``: a limit on
#: jobs at once; ``completion_target``: the last jobs are in flight, one may still
#: fail), or stop (``ended``: the generation ended; ``superseded``: the workload was
#: created again, the caller's generation is not current). ``no_ready``: lease_next
#: found no job in time.
Refusal = Literal[
    "in_flight", "rollouts", "global_rollouts", "completion_target", "ended", "superseded",
    "no_ready",
]
#: Refusals after which a producer of that generation stops for good.
FINAL_REFUSALS: frozenset[str] = frozenset({"ended", "superseded"})


class ReserveRequest(Wire, kw_only=True, omit_defaults=True):
    """Ask for admission of a new job. ``job_id`` makes the call idempotent."""

    job_id: str
    tenant_id: str
    task_type: TaskType
    workload: str = "default"
    #: The workload generation the job is for (WorkloadRecord.generation); a
    #: reserve for any other than the workload's current one is refused.
    generation: int = 1
    domain: str = ""
    sample_count: int = 0
    behavior_policy_version: int = 0
    producer_role: str = "producer"
    consumer_role: str = "actor"
    metadata: JobMetadata = msgspec.field(default_factory=JobMetadata)
    by: str = ""
    #: If refused for a limit that will lift (``in_flight``, ``rollouts``,
    #: ``global_rollouts``, ``completion_target``), wait up to this long in the
    #: admission queue (long poll; 0: answer at once).
    wait_s: float = 0.0


class MarkRequest(Wire, kw_only=True, omit_defaults=True):
    job_id: str
    state: JobState
    #: The lease the caller holds (stage leases), 0 for the producer.
    attempt: int = 0
    sample_count: int | None = None
    by: str = ""


class LeaseStageRequest(Wire, kw_only=True, omit_defaults=True):
    job_id: str
    stage: str
    by: str


class LeaseNextRequest(Wire, kw_only=True, omit_defaults=True):
    consumer_role: str = "actor"
    by: str
    #: Wait up to this long for a ready job (long poll).
    wait_s: float = 0.0
    #: Makes a retried call return the lease the first call got.
    request_id: str = ""


class TouchRequest(Wire, kw_only=True, omit_defaults=True):
    """Extend a lease (the in_progress of long work)."""

    job_id: str
    attempt: int
    by: str = ""


class CompleteRequest(Wire, kw_only=True, omit_defaults=True):
    job_id: str
    attempt: int
    result_version: int | None = None
    by: str = ""


class EndRequest(Wire, kw_only=True, omit_defaults=True):
    """drop or fail: ``attempt`` 0 means "whatever lease is current" (operator action)."""

    job_id: str
    reason: str
    attempt: int = 0
    by: str = ""


class SetPolicyRequest(Wire, kw_only=True, omit_defaults=True):
    policy: WorkloadPolicy


class SetLimitsRequest(Wire, kw_only=True, omit_defaults=True):
    limits: GlobalLimits


class SetVersionRequest(Wire, kw_only=True, omit_defaults=True):
    tenant_id: str
    workload: str
    version: int


class WaitReadyRequest(Wire, kw_only=True, omit_defaults=True):
    consumer_role: str = "actor"
    wait_s: float = 0.0


class GetJobRequest(Wire, kw_only=True, omit_defaults=True):
    job_id: str


class ListJobsRequest(Wire, kw_only=True, omit_defaults=True):
    tenant_id: str
    workload: str = ""
    #: With ``workload``: that generation's jobs only (0: every generation's).
    generation: int = 0
    states: list[JobState] = []
    #: Only jobs whose ``metadata.extra`` holds every one of these items (a training
    #: client's call: its ``client`` and ``seq``), so the reply stays small.
    extra: dict[str, str] = {}


class TenantShare(Wire, kw_only=True, omit_defaults=True):
    """One tenant's share of the trainer's work (rows trained, decayed over the last
    minutes) against its fair share (its weight over the weights of the tenants
    with work under way, waiting, or trained lately), the same in trainer seconds
    (at the measured seconds per row), and its reserves waiting in the admission queue."""

    tenant_id: str
    weight: int = 1
    share: float = 0.0
    fair_share: float = 0.0
    trainer_s: float = 0.0
    queued: int = 0


class SchedulerSnapshot(Wire, kw_only=True, omit_defaults=True):
    """What ``status`` shows: counts, not every job."""

    jobs_by_state: dict[str, int]
    jobs_by_tenant_state: dict[str, dict[str, int]]
    policies: list[WorkloadPolicy]
    limits: GlobalLimits
    versions: dict[str, int]
    active_rollouts: int
    leases: int
    last_seq: int
    #: Per tenant with jobs under way, waiting or recently trained: its share.
    shares: list[TenantShare] = []


class ErrorBody(Wire, kw_only=True):
    code: str
    message: str


#: The job lease TTL a client assumes when the scheduler's reply does not say
#: (a scheduler from before replies carried it); the scheduler's own default.
DEFAULT_LEASE_TTL_S = 30.0


class Reply(Wire, kw_only=True, omit_defaults=True):
    """Every scheduler reply: a job, a refusal, a count, or an error."""

    job: TrainingJob | None = None
    #: Why reserve / lease_next returned no job (admission, nothing ready...), in words.
    refused: str = ""
    #: The same as a code callers decide on (``Refusal``).
    refusal: str = ""
    #: A reserve that waited in the admission queue: its place when it last waited
    #: (1: next), and how long it waited (a refusal after waiting: still queued
    #: when the wait ended; ask again, the place is the tenant's lag, not arrival).
    position: int = 0
    waited_s: float = 0.0
    count: int = 0
    error: ErrorBody | None = None
    snapshot: SchedulerSnapshot | None = None
    jobs: list[TrainingJob] = []
    #: With a lease (``lease_stage``, ``lease_next``, ``touch``): how long it lasts
    #: untouched, in seconds (0: not said; the client assumes DEFAULT_LEASE_TTL_S).
    lease_ttl_s: float = 0.0
