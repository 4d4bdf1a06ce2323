"""Requests and replies of the Training Scheduler's API (``jnx.sched.<verb>``).

Every verb is idempotent (reserve by job_id, marks by target state, leases by holder or
request_id, complete by attempt), so a client may retry a call that got no answer.
See docs/ARCHITECTURE.md, "The Training Scheduler: one decider, many callers".
"""

from __future__ import annotations

import msgspec

from joynexus.schemas.base import Wire
from joynexus.schemas.jobs import (
    GlobalLimits,
    JobMetadata,
    JobState,
    TaskType,
    TenantTaskPolicy,
    TrainingJob,
)


class ReserveRequest(Wire, kw_only=True, omit_defaults=True):
    """Ask for admission of a new job. ``job_id`` makes the call idempotent."""

    job_id: str
    tenant_id: str
    task_type: TaskType
    policy_key: str = "default"
    domain: str = ""
    sample_count: int = 0
    behavior_policy_version: int = 0
    producer_role: str = "producer"
    consumer_role: str = "actor"
    metadata: JobMetadata = msgspec.field(default_factory=JobMetadata)
    by: str = ""


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
    policy: TenantTaskPolicy


class SetLimitsRequest(Wire, kw_only=True, omit_defaults=True):
    limits: GlobalLimits


class SetVersionRequest(Wire, kw_only=True, omit_defaults=True):
    tenant_id: str
    policy_key: str
    version: int


class WaitReadyRequest(Wire, kw_only=True, omit_defaults=True):
    consumer_role: str = "actor"
    wait_s: float = 0.0


class GetJobRequest(Wire, kw_only=True, omit_defaults=True):
    job_id: str


class ListJobsRequest(Wire, kw_only=True, omit_defaults=True):
    tenant_id: str
    policy_key: str = ""
    states: list[JobState] = []


class SchedulerSnapshot(Wire, kw_only=True, omit_defaults=True):
    """What ``status`` shows: counts, not every job."""

    jobs_by_state: dict[str, int]
    jobs_by_tenant_state: dict[str, dict[str, int]]
    policies: list[TenantTaskPolicy]
    limits: GlobalLimits
    versions: dict[str, int]
    active_rollouts: int
    leases: int
    last_seq: int


class ErrorBody(Wire, kw_only=True):
    code: str
    message: str


#: The job lease TTL a client assumes when the scheduler's reply does not say
#: (a scheduler from before replies carried it); the scheduler's own default.
DEFAULT_LEASE_TTL_S = 30.0


class Reply(Wire, kw_only=True, omit_defaults=True):
    """Every scheduler reply: a job, a refusal, a count, or an error."""

    job: TrainingJob | None = None
    #: Why reserve / lease_next returned no job (admission, nothing ready...).
    refused: str = ""
    count: int = 0
    error: ErrorBody | None = None
    snapshot: SchedulerSnapshot | None = None
    jobs: list[TrainingJob] = []
    #: With a lease (``lease_stage``, ``lease_next``, ``touch``): how long it lasts
    #: untouched, in seconds (0: not said; the client assumes DEFAULT_LEASE_TTL_S).
    lease_ttl_s: float = 0.0
