"""The control plane's pure decisions: a tenant's request against its quota and
its own records, names, sizes, pages and slices.

Each function takes data and returns a decision or raises the tenant's error
(``InvalidSpec``, ``QuotaExceeded``, ...); none touches the server, so
``tests/unit/test_control_checks.py`` tables them alone. The limits of the API are
here too (its verbs are in ``schemas/api.py``).
See docs/ARCHITECTURE.md
("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from joynexus.broker import metrics
from joynexus.schemas.api import ADMIN_VERBS, BIG_VERBS, VERBS
from joynexus.schemas.errors import (
    InvalidSpec,
    PayloadTooLarge,
    QuotaExceeded,
    ShapeMismatch,
)
from joynexus.schemas.identities import TenantIdentity, TenantRequest
from joynexus.schemas.inference import FeatureSchemaSpec
from joynexus.schemas.jobs import JobState, TrainingJob, WorkloadEnded, check_name
from joynexus.schemas.quotas import Quota
from joynexus.schemas.samples import (
    FIELDS,
    IMAGE_FIELD_PREFIX,
    SCHEMA_FIELDS,
    dims_of,
    image_shape,
)
from joynexus.schemas.workloads import (
    PutData,
    ReadEvents,
    VideoQuery,
    WorkloadRecord,
    WorkloadSpec,
)

#: Tenant names that would collide with internal keys (``cursor.<tenant>.<wl>`` in
#: the workloads bucket, ``version.<tenant>.<wl>`` in the tenants bucket, ...).
RESERVED_TENANTS = frozenset({"cursor", "version", "global", "applied", "admin", "svc", "hb",
                              "mgr", "all", "service", "control", "responder"})
_BCRYPT = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")
TERMINAL_STATES = frozenset({JobState.COMPLETED.value, JobState.DROPPED.value, JobState.FAILED.value})

#: Requests of every other verb than BIG_VERBS are small.
MAX_SMALL_REQUEST = 64 * 1024

#: Longest long-poll of read_events (the SDK's request timeout must exceed it).
MAX_EVENTS_WAIT_S = 20.0
MAX_EVENTS_PAGE = 1000


# ------------------------------------------------------------ the door
def tenant_of_subject(subject: str) -> str | None:
    """The tenant of ``<ns>.api.<tenant>.<verb>`` (the subject's, never the
    payload's); None for another shape or a token that is not a valid name."""
    parts = subject.split(".")
    tenant = parts[2] if len(parts) == 4 else None
    try:
        check_name("tenant", tenant or "")
    except InvalidSpec:
        return None
    return tenant


def oversized(verb: str, size: int, max_payload: int) -> PayloadTooLarge | None:
    """The error for a request body too large for its verb (None: small enough);
    decided on the length alone, before any decoding."""
    if size > (max_payload if verb in BIG_VERBS else MAX_SMALL_REQUEST):
        return PayloadTooLarge(
            f"{verb} request of {size} bytes; at most {MAX_SMALL_REQUEST} for this verb"
        )
    return None


def request_type(verb: str) -> type[Any]:
    """The request struct of a tenant verb; InvalidSpec for an unknown one."""
    if verb not in VERBS:
        raise InvalidSpec(
            f"unknown API verb {metrics.clip(verb, 40)!r}; verbs are {sorted(VERBS)}"
        )
    return VERBS[verb]


def check_admin_verb(verb: str) -> None:
    if verb not in ADMIN_VERBS:
        raise InvalidSpec(f"unknown admin verb {verb!r}; verbs are {list(ADMIN_VERBS)}")


# ------------------------------------------------------------ workloads
def bound_spec(tenant: str, spec: WorkloadSpec, q: Quota) -> WorkloadSpec:
    """The spec with every number within the tenant's quota (else QuotaExceeded)
    and the quota's priority (the class's, never the tenant's)."""
    s = spec.scheduling

    def bound(what: str, value: int, limit: int) -> None:
        if value > limit:
            raise QuotaExceeded(
                f"{what} = {value} is over tenant {tenant!r}'s quota ({limit}); "
                "ask for less, or ask your operator to raise it"
            )

    bound("scheduling.max_in_flight", s.max_in_flight, q.max_in_flight)
    bound("scheduling.max_active_rollouts", s.max_active_rollouts, q.max_active_rollouts)
    bound("action_horizon", spec.action_horizon, q.max_action_horizon)
    bound("num_envs x horizon", spec.num_envs * spec.horizon, q.max_rollout_steps)
    bound("batch_size", spec.batch_size, q.max_batch_size)
    bound("instruction bytes", len(spec.instruction.encode()), q.max_instruction_bytes)
    if spec.task_type in ("rl", "eval") and spec.source == "service":
        # Each step asks the Inference Queue for all its envs at once: one request of
        # num_envs rows, which the engine refuses past the tenant's rows per request.
        bound("num_envs (rows of each inference request)", spec.num_envs, q.max_infer_rows)
    if spec.task_type == "eval":
        bound("episodes", spec.episodes, q.max_eval_episodes)
    if spec.eval_every:
        bound("eval_episodes", spec.eval_episodes, q.max_eval_episodes)
    if spec.eval_videos:
        bound("eval_videos", spec.eval_videos, q.max_eval_videos)
        bound("video_frames", spec.video_frames, q.max_video_frames)
        # 0 = the camera's size: bounded here as the largest it may be.
        bound("video_size", spec.video_size or spec.image_size, q.max_video_size)
    # The class's priority and the operator's share weight, never the tenant's.
    sched = msgspec.structs.replace(s, priority=q.priority, weight=q.share_weight)
    return msgspec.structs.replace(spec, scheduling=sched)


def check_create(
    tenant: str, spec: WorkloadSpec, every: Sequence[WorkloadRecord], q: Quota
) -> WorkloadRecord | int:
    """May ``tenant``, holding the records ``every``, create ``spec``? The existing
    record for a retried create (the same spec under the name of an active
    workload), else the generation the new workload gets: 1 for a new name, one
    more than the last for the name of a workload that ended (done, failed or
    cancelled: its record is replaced, its jobs and versions stay theirs).
    InvalidSpec or QuotaExceeded otherwise."""
    # The evaluator's periodic evaluations (eval_every) count while they run (they use
    # the evaluator and the inference engine like the tenant's own); ended, they are
    # results, kept within a bound of their own (periodic_to_forget).
    records = [r for r in every if not r.periodic or r.state == "active"]
    active = [r for r in records if r.state == "active"]
    generation = 1
    for rec in every:
        if rec.spec.name == spec.name:
            if rec.state == "active":
                if rec.spec == spec:
                    return rec  # a retried create
                raise InvalidSpec(
                    f"tenant {tenant!r} already has an active workload named {spec.name!r}; "
                    "pick another name, or cancel it first"
                )
            if rec.periodic:
                raise InvalidSpec(
                    f"{spec.name!r} names one of tenant {tenant!r}'s periodic evaluations; "
                    "pick another name"
                )
            generation = rec.generation + 1
            continue
        if rec.state == "active" and rec.spec.task_type == spec.task_type != "eval":
            raise InvalidSpec(
                f"tenant {tenant!r} already runs an active {spec.task_type} workload "
                f"({rec.spec.name!r}); cancel it, or wait until it is done (it ends once its "
                "completion target of jobs completed; without a target only a cancel ends it)"
            )
    # A name reused replaces its ended record: it takes no new slot.
    kept = [r for r in records if r.spec.name != spec.name]
    if len(kept) >= q.max_workloads:
        raise QuotaExceeded(
            f"tenant {tenant!r} has {len(kept)} workloads, its quota's max_workloads; "
            "ask your operator to raise it"
        )
    if len(active) >= q.max_active_workloads:
        raise QuotaExceeded(
            f"tenant {tenant!r} has {len(active)} active workloads (quota "
            f"{q.max_active_workloads}); cancel one or wait for one to finish"
        )
    evals = sum(1 for r in active if r.spec.task_type == "eval")
    if spec.task_type == "eval" and evals >= q.max_concurrent_evals:
        raise QuotaExceeded(
            f"tenant {tenant!r} has {evals} evaluations running (quota "
            f"{q.max_concurrent_evals}, periodic ones included); wait for one to finish"
        )
    return generation


def periodic_wait(tenant: str, every: Iterable[WorkloadRecord], q: Quota) -> str | None:
    """Why a periodic evaluation of ``tenant`` (``eval_every``) may not start now
    (the tenant's evaluations running, periodic ones included, at
    ``max_concurrent_evals``; its active workloads at ``max_active_workloads``), or
    None: it may. The evaluator queues it meanwhile, it is not dropped."""
    active = [r for r in every if r.state == "active"]
    evals = sum(1 for r in active if r.spec.task_type == "eval")
    if evals >= q.max_concurrent_evals:
        return f"tenant {tenant!r} has {evals} evaluations running (quota {q.max_concurrent_evals})"
    if len(active) >= q.max_active_workloads:
        return f"tenant {tenant!r} has {len(active)} active workloads (quota {q.max_active_workloads})"
    return None


def periodic_to_forget(every: Iterable[WorkloadRecord], q: Quota) -> list[WorkloadRecord]:
    """The tenant's ended periodic evaluations beyond ``max_workloads`` of them, oldest
    first: the evaluator deletes these before it adds one (their results were also
    emitted as learning metrics), so periodic records never pass the quota."""
    ended = sorted((r for r in every if r.periodic and r.state != "active"),
                   key=lambda r: (r.finished_at or r.created_at, r.spec.name))
    return ended[: max(0, len(ended) - (q.max_workloads - 1))]


def cancelled(rec: WorkloadRecord, at: float = 0.0) -> WorkloadRecord:
    """The record after a cancel (an ended workload stays as it is)."""
    if rec.state != "active":
        return rec
    return msgspec.structs.replace(rec, state="cancelled", finished_at=at)


def ended(rec: WorkloadRecord, end: WorkloadEnded) -> WorkloadRecord | None:
    """The record after its generation's end (None: the end is not this record's, or
    the record has ended already, say by a cancel that came first)."""
    if rec.state != "active" or rec.generation != end.generation or end.state == "cancelled":
        return None
    return msgspec.structs.replace(
        rec,
        state=end.state,
        finished_at=end.at,
        result={
            "completed": float(end.completed),
            "failed": float(end.failed),
            "dropped": float(end.dropped),
            "last_version": float(end.last_version),
        },
        reason=end.reason,
    )


# ------------------------------------------------------------ submissions
def takes_tenant_data(spec: WorkloadSpec) -> bool:
    """A workload the tenant feeds itself (open_job or train_call, put_data, close_job)."""
    return spec.task_type == "custom" or (spec.source == "tenant" and spec.task_type in ("rl", "sft"))


def check_open_job(
    tenant: str, name: str, rec: WorkloadRecord, sample_count: int, q: Quota, opened: int
) -> None:
    """May ``tenant``, with ``opened`` jobs open, open a job of ``sample_count``
    samples on its workload ``rec`` (named ``name`` in the request)?"""
    spec = rec.spec
    if spec.task_type == "custom":
        raise InvalidSpec(
            f"workload {name!r} is custom: its rows come with training-client calls "
            "(client.training_client), not open_job"
        )
    if not takes_tenant_data(spec):
        raise InvalidSpec(
            f"workload {name!r} is fed by the service ({spec.task_type}, source "
            f"{spec.source!r}); create one with source='tenant' to submit your own data"
        )
    if rec.state != "active":
        raise InvalidSpec(f"workload {name!r} is {rec.state}; it takes no more data")
    if opened >= q.max_open_jobs:
        raise QuotaExceeded(
            f"tenant {tenant!r} has {opened} jobs open (quota {q.max_open_jobs}); "
            "close_job or abort_job one first"
        )
    most = max(q.max_rollout_steps, q.max_batch_size)
    if not 1 <= sample_count <= most:
        raise QuotaExceeded(f"sample_count must be 1..{most}, got {sample_count}")


def closed_state(task_type: str) -> JobState:
    """Where close_job moves a tenant's job: RL rows still need their advantages."""
    return JobState.NEEDS_ADVANTAGES if task_type == "rl" else JobState.READY


def abort_reason(reason: str) -> str:
    return f"aborted by the tenant: {reason}" if reason else "aborted by the tenant"


def expired(opened: dict[str, float], now: float, ttl_s: float) -> list[tuple[str, float]]:
    """(job id, opened at) of the open jobs whose client has not closed them within
    ``ttl_s``, in the order they were opened."""
    return [(job_id, at) for job_id, at in opened.items() if now - at >= ttl_s]


def expiry_period_s(ttl_s: float) -> float:
    """How often open jobs are checked for expiry."""
    return max(0.2, min(30.0, ttl_s / 4))


# ------------------------------------------------------------ the tenant's data
def check_put_data(job: TrainingJob, req: PutData) -> None:
    """May rows be put into ``job`` (one of the tenant's own)?"""
    if job.producer_role != "tenant" or job.state != JobState.RESERVED:
        raise InvalidSpec(
            f"job {req.job_id!r} takes no data from you (state {job.state.value}, produced "
            f"by {job.producer_role!r}); open one with open_job and put before close_job"
        )
    if not req.fields:
        raise InvalidSpec("put_data got no fields")


def check_tq_room(tenant: str, in_use: int, size: int, q: Quota) -> None:
    """``size`` more bytes on top of the ``in_use`` the tenant holds in open jobs."""
    if in_use + size > q.tq_bytes:
        raise QuotaExceeded(
            f"tenant {tenant!r} has {in_use} bytes in the Training Queue; {size} more would "
            f"pass its quota of {q.tq_bytes} bytes: close or abort open jobs first"
        )


def check_rows(data: dict[str, Any], fs: FeatureSchemaSpec, workload: str) -> None:
    """Rows the tenant hands in must fit its workload's schema (else its jobs would
    fail at training time, far from the mistake)."""
    # The per-row shapes of schemas/samples.py's FIELDS, sized by the workload's schema.
    sizes = dims_of(fs.action_horizon, fs.action_dim, fs.state_dim, fs.channels, fs.image_hw)
    want: dict[str, tuple[int, ...]] = {
        f"{IMAGE_FIELD_PREFIX}{slot}": image_shape(sizes) for slot in fs.camera_slots
    }
    want.update({name: FIELDS[name].shape(sizes) for name in SCHEMA_FIELDS})
    for name, shape in want.items():
        arr = data.get(name)
        if arr is None:
            raise InvalidSpec(f"workload {workload!r} needs field {name!r} of shape [B, {', '.join(map(str, shape))}]")
        if tuple(arr.shape[1:]) != shape:
            raise ShapeMismatch(
                f"field {name!r} of workload {workload!r}: expected [B, "
                f"{', '.join(map(str, shape))}], got {list(arr.shape)}"
            )


def check_after_seq(after_seq: object) -> None:
    if not isinstance(after_seq, int) or after_seq > 1 << 62:
        raise InvalidSpec("after_seq must be a stream sequence (an integer)")


def events_page(req: ReadEvents) -> tuple[int, float]:
    """(events per page, seconds to long-poll) of a read_events request, bounded."""
    limit = max(1, min(req.limit, MAX_EVENTS_PAGE))
    wait_s = req.wait_s if math.isfinite(req.wait_s) else 0.0  # NaN would park it forever
    return limit, min(max(wait_s, 0.0), MAX_EVENTS_WAIT_S)


def check_offset(offset: int) -> None:
    if offset < 0:
        raise InvalidSpec(f"offset must be >= 0, got {offset}")


def weights_slice(offset: int, limit: int, max_payload: int) -> slice:
    """A get_policy slice of the weights (replies are JSON, bytes as base64: a
    slice well under max_payload)."""
    check_offset(offset)
    return slice(offset, offset + min(limit, max_payload // 2))


def video_slice(rec: WorkloadRecord, req: VideoQuery, max_payload: int) -> tuple[int, slice]:
    """(video index, byte slice) a get_video request asks for of ``rec``'s videos."""
    if not isinstance(req.index, int) or not 0 <= req.index < len(rec.videos):
        raise InvalidSpec(
            f"workload {req.workload!r} has {len(rec.videos)} videos; index must be 0.."
            f"{len(rec.videos) - 1}, got {req.index!r}"
        )
    check_offset(req.offset)
    limit = min(req.limit if req.limit > 0 else max_payload // 2, max_payload // 2)
    return req.index, slice(req.offset, req.offset + limit)


def check_since(since: float) -> None:
    if not math.isfinite(since) or since < 0:
        raise InvalidSpec(f"since must be a time in epoch seconds >= 0, got {since}")


# ------------------------------------------------------------ the operator's
def check_new_tenant(req: TenantRequest) -> str:
    """The tenant name of a tenant_add request, checked with its password hash."""
    tenant = check_name("tenant", req.tenant)
    if tenant in RESERVED_TENANTS:
        raise InvalidSpec(
            f"tenant name {tenant!r} is reserved for the service's own keys; pick another"
        )
    if not _BCRYPT.match(req.password_hash):
        raise InvalidSpec(
            "tenant_add needs password_hash: the bcrypt hash of a password your client "
            "generated (joynexus tenant add does it; the password itself never travels)"
        )
    return tenant


def issued_identity(
    req: TenantRequest, tenant: str, user: str, old: TenantIdentity | None, now: float
) -> TenantIdentity:
    """The identity tenant_add stores: new credentials, or rotated ones (``rotate``)
    keeping the creation time and quota unless a new quota is given."""
    if old is not None and not req.rotate:
        raise InvalidSpec(
            f"tenant {tenant!r} already has credentials; rotate them "
            f"(`joynexus tenant add {tenant} --rotate`) to issue new ones"
        )
    return TenantIdentity(
        tenant_id=tenant,
        user=user,
        password_hash=req.password_hash,
        created_at=old.created_at if old else now,
        rotated_at=now if old else 0.0,
        quota=req.quota if req.quota is not None else (old.quota if old else None),
    )


def applied_state(
    applied: dict[str, int], revision: int, now: float, discover_deadline: float, deadline: float
) -> str | None:
    """'yes' once every auth sync seen applied ``revision``; 'off' when none was
    seen by ``discover_deadline``; 'pending' at ``deadline``; None: keep waiting."""
    if applied and all(r >= revision for r in applied.values()):
        return "yes"
    if not applied and now >= discover_deadline:
        return "off"
    if now >= deadline:
        return "pending"
    return None


def open_jobs_of(opened_by: dict[str, str], tenant: str) -> int:
    return sum(1 for who in opened_by.values() if who == tenant)


def count_active(records: Iterable[WorkloadRecord]) -> int:
    return sum(1 for r in records if r.state == "active")
