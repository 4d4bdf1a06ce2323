"""The control plane: tenant slots and credentials, workload specs, and the
tenant's only door to its own data.

Serves the micro service ``<ns>-control`` on two endpoints:

- ``<ns>.api.<tenant>.<verb>`` (tenants): the tenant is taken from the
  subject (the third token), never from the payload; the broker lets a tenant
  publish only on its own. Creating a workload registers its admission policy
  with the scheduler, publishes the first version of its action module (fresh
  weights, or a copy of another of the tenant's versions) and stores the
  workload record, which the producer agents watch. Since a tenant has no
  JetStream access, the control plane also reads and writes the tenant's own
  data for it: its job events (``read_events``, paged by stream sequence,
  long-polled), rows of its open jobs' Training Queue partitions
  (``put_data``) and its policy versions and weights (``get_policy``).
- ``<ns>.admin.<verb>`` (the admin identity only): ``tenant_add`` issues a
  tenant its NATS user (a generated password, stored only as a bcrypt hash in
  the identities bucket), ``tenant_remove`` revokes it (and cancels its active
  workloads), ``tenant_list``. The server's auth sync applies the change
  without a restart; the reply waits until it has.

A request that reaches for another tenant's job is refused like an unknown
one (nothing is revealed) and reported as a ``security`` metric event.

Every tenant input is hostile (issue 11): requests are answered only at the
requester's own inbox and at most ``max_requests_in_flight`` of a tenant's are
served at once (:mod:`joynexus.broker.rpc`); every number a tenant asks for is
checked against its operator-set quota (:mod:`joynexus.schemas.quotas`), its
priority is its class's; an SFT dataset must lie in the tenant's own dataset
space (:mod:`joynexus.agents.datasets`); rows are checked for dtype, finiteness
and range before they reach the shared trainer (:mod:`joynexus.schemas.rows`).
No request costs the server a consumer: the workload records are read from one
watcher this process keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError, ObjectNotFoundError
from nats.micro import add_service
from nats.micro.request import Request

from joynexus.agents.datasets import default_root, resolve_dataset
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.broker.direct import read_subject
from joynexus.broker.kvmirror import KVMirror
from joynexus.broker.policy import PolicyRecords
from joynexus.broker.quotas import QuotaBook
from joynexus.broker.rpc import Responder
from joynexus.broker.subjects import CURSOR_KEYS, parse_job_subject
from joynexus.broker.tq import TrainingQueue
from joynexus.broker.usage import Meter, UsageQuery
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import (
    InvalidSpec,
    JoyNexusError,
    PayloadTooLarge,
    QuotaExceeded,
    RateLimited,
    ShapeMismatch,
    UnknownJob,
    UnknownTenant,
)
from joynexus.schemas.identities import (
    APPLIED_KEY,
    AdminReply,
    AuthApplied,
    TenantIdentity,
    TenantInfo,
    TenantRequest,
    is_applied_key,
)
from joynexus.schemas.inference import FeatureSchemaSpec, decode_msgpack
from joynexus.schemas.jobs import JobMetadata, JobState, TenantTaskPolicy, TrainingJob, check_name
from joynexus.schemas.quotas import Quota
from joynexus.schemas.rows import check_values
from joynexus.schemas.scheduler import ErrorBody
from joynexus.schemas.workloads import (
    CONTENT_TYPE,
    MSGPACK,
    ApiReply,
    CloseJob,
    CreateWorkload,
    EventEntry,
    NamedWorkload,
    OpenJob,
    PolicyQuery,
    PutData,
    ReadEvents,
    VideoQuery,
    WorkloadRecord,
    WorkloadSpec,
    video_object_name,
)

log = logging.getLogger(__name__)

#: Publishes version 1 of a new workload's policy; returns its schema signature.
InitPolicy = Callable[[WorkloadRecord], Awaitable[str]]

VERBS: dict[str, type[Any]] = {
    "create_workload": CreateWorkload,
    "get_workload": NamedWorkload,
    "list_workloads": NamedWorkload,
    "cancel_workload": NamedWorkload,
    "open_job": OpenJob,
    "close_job": CloseJob,
    "abort_job": CloseJob,
    "read_events": ReadEvents,
    "put_data": PutData,
    "get_policy": PolicyQuery,
    "get_video": VideoQuery,
    "usage": UsageQuery,
}

ADMIN_VERBS = ("tenant_add", "tenant_set", "tenant_remove", "tenant_list")

#: Tenant names that would collide with internal keys (``cursor.<tenant>.<wl>`` in
#: the workloads bucket, ``version.<tenant>.<wl>`` in the tenants bucket, ...).
RESERVED_TENANTS = frozenset({"cursor", "version", "global", "applied", "admin", "svc", "hb",
                              "mgr", "all", "service", "control", "responder"})
_BCRYPT = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")
_TERMINAL = frozenset({JobState.COMPLETED.value, JobState.DROPPED.value, JobState.FAILED.value})
#: Keys of the workloads bucket that are not workload records.
_NOT_RECORDS = (CURSOR_KEYS,)

#: Verbs whose body carries data (rows, a spec); every other request is small.
BIG_VERBS = frozenset({"put_data", "create_workload"})
MAX_SMALL_REQUEST = 64 * 1024

#: Longest long-poll of read_events (the SDK's request timeout must exceed it).
MAX_EVENTS_WAIT_S = 20.0
MAX_EVENTS_PAGE = 1000


class ControlPlane:
    def __init__(
        self,
        broker: Broker,
        *,
        init_policy: InitPolicy,
        instance: str = "control-0",
        open_job_ttl_s: float = 600.0,
        datasets_root: str | Path | None = None,
    ) -> None:
        self.b = broker
        self.n = broker.names
        self.sched = SchedulerClient(broker, by=instance)
        self.init_policy = init_policy
        self.instance = instance
        self._service: Any = None
        self._kv: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lock = asyncio.Lock()  # one create at a time: slot allocation is check-then-write
        self._ids: Any = None
        self._policies = PolicyRecords(broker)
        self._tq = TrainingQueue(broker)
        # Job events seen per tenant (a core subscription): wakes read_events long-polls.
        self._ticks: dict[str, int] = {}
        self._tick = asyncio.Condition()
        self._job_sub: Any = None
        # Jobs a tenant opened and has not closed: job id -> when (monotonic). A job
        # still open after open_job_ttl_s (its client died) is failed: it holds a slot.
        self.open_job_ttl_s = open_job_ttl_s
        self._opened: dict[str, float] = {}
        self._opened_by: dict[str, str] = {}  # job id -> tenant
        #: Where tenants' datasets live (<root>/<tenant>/..., or the quota's own root).
        self.datasets_root = Path(datasets_root) if datasets_root else default_root()
        self.quotas = QuotaBook(broker)
        self.rpc = Responder(
            broker, "control", limit=lambda t: self.quotas.get(t).max_requests_in_flight
        )
        # Workload records, from one watcher over the bucket: key -> record.
        self._records_mirror = KVMirror(
            broker, self.n.workloads_bucket, WorkloadRecord,
            skip=lambda key: key.startswith(_NOT_RECORDS),
            belongs=lambda key, rec: self.n.workload_key(rec.tenant_id, rec.spec.name) == key,
        )
        self._records_by_key = self._records_mirror.values
        # Training Queue bytes a tenant put, per open job (released when the job ends).
        self._tq_bytes: dict[str, dict[str, int]] = {}
        # Usage metering (broker.usage): folds busy intervals, queue puts and job ends
        # into a checkpoint; answers the usage verb (the tenant's own figures only).
        self.meter = Meter(broker, instance=f"{instance}-meter")

    async def start(self, wait_layout_s: float = 30.0) -> None:
        # The deployment's layout may still be being made (the server owner's auth
        # sync runs ensure_layout as the server starts): wait for it a while.
        deadline = asyncio.get_running_loop().time() + wait_layout_s
        while True:
            try:
                self._kv = await self.b.js.key_value(self.n.workloads_bucket)
                self._ids = await self.b.js.key_value(self.n.identities_bucket)
                break
            except BucketNotFoundError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        self._job_sub = await self.b.nc.subscribe(self.n.all_jobs, cb=self._on_job_event)
        await self.quotas.start()
        await self._records_mirror.start(10.0)
        nc = await self.rpc.connection()
        self._service = await add_service(
            nc,
            name=self.n.control_service,
            version="0.1.0",
            description="JoyNexus control plane: tenants' workload specs and slots",
        )
        await self._service.add_endpoint(name="api", subject=self.n.all_api, handler=self._handle)
        await self._service.add_endpoint(
            name="admin", subject=self.n.all_admin, handler=self._handle_admin
        )
        await self.b.nc.flush()  # subscribed on the server before start() returns
        await nc.flush()
        self._spawn(self._adopt_open_jobs())
        self._spawn(self._expire_open_jobs())
        self._spawn(self.meter.run())

    async def _on_job_event(self, msg: Any) -> None:
        try:
            tenant, job_id, state = parse_job_subject(msg.subject)
        except InvalidSpec:
            return
        if state in _TERMINAL:  # its rows leave the Training Queue with it
            held = self._tq_bytes.get(tenant)
            if held is not None:
                held.pop(job_id, None)
                if not held:
                    self._tq_bytes.pop(tenant, None)
        async with self._tick:
            self._ticks[tenant] = self._ticks.get(tenant, 0) + 1
            self._tick.notify_all()

    async def stop(self) -> None:
        if self._job_sub is not None:
            with contextlib.suppress(Exception):
                await self._job_sub.unsubscribe()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.rpc.stop()
        await self.quotas.stop()
        await self._records_mirror.stop()

    async def _put_record(self, rec: WorkloadRecord) -> None:
        key = self.n.workload_key(rec.tenant_id, rec.spec.name)
        await self._kv.put(key, encode(rec))
        self._records_mirror.put(key, rec)

    async def _handle(self, request: Request) -> None:
        """Check the reply subject and the tenant's in-flight bound; never wait here
        (nats-py runs one callback at a time per subscription)."""
        parts = request.subject.split(".")
        tenant: str | None = parts[2] if len(parts) == 4 else None
        try:
            check_name("tenant", tenant or "")
        except InvalidSpec:
            tenant = None
        if not self.rpc.allowed(request, tenant):
            return
        if tenant is None:
            self._spawn(self._serve(request, "_"))
            return
        verb = parts[3]
        size = len(request.data or b"")
        if size > (self.b.max_payload if verb in BIG_VERBS else MAX_SMALL_REQUEST):
            # Refused before any decoding: a flood of big bodies costs a length check.
            e2 = PayloadTooLarge(
                f"{verb} request of {size} bytes; at most {MAX_SMALL_REQUEST} for this verb"
            )
            self._spawn(self._reply_now(request, ApiReply(error=ErrorBody(code=e2.code, message=str(e2)))))
            return
        try:
            self.rpc.admit(tenant)
        except RateLimited as e:
            self._spawn(self._reply_now(request, ApiReply(error=ErrorBody(code=e.code, message=str(e)))))
            return
        task = self.rpc.spawn(self._serve(request, tenant))
        who: str = tenant
        task.add_done_callback(lambda _t: self.rpc.release(who))

    async def _reply_now(self, request: Request, reply: Any) -> None:
        with contextlib.suppress(Exception):
            await request.respond(encode(reply))

    async def _handle_admin(self, request: Request) -> None:
        if self.rpc.allowed(request, None):
            self._spawn(self._serve_admin(request))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, request: Request, tenant: str) -> None:
        verb = request.subject.split(".")[-1]

        async def call() -> Any:
            check_name("tenant", tenant)  # a token, never a wildcard
            if verb not in VERBS:
                raise InvalidSpec(
                    f"unknown API verb {metrics.clip(verb, 40)!r}; verbs are {sorted(VERBS)}"
                )
            if (request.headers or {}).get(CONTENT_TYPE) == MSGPACK:
                req = decode_msgpack(request.data, VERBS[verb], what=f"{verb} request")
            else:
                req = decode(request.data or b"{}", VERBS[verb], what=f"{verb} request")
            return await getattr(self, f"_{verb}")(tenant, req)

        await self._answer(request, verb, ApiReply, call)

    async def _answer(
        self,
        request: Request,
        verb: str,
        reply_type: type[ApiReply] | type[AdminReply],
        call: Callable[[], Awaitable[Any]],
    ) -> None:
        """Run ``call`` in a span continuing the caller's trace; answer its reply, or
        the error as ``reply_type(error=...)``; keep serving whatever happens."""
        try:
            with tracing.tracer.start_as_current_span(
                f"control.{verb}", context=tracing.extract(request.headers)
            ):
                reply = await call()
        except JoyNexusError as e:  # clipped: a tenant's 1 MB name is not echoed back
            reply = reply_type(error=ErrorBody(code=e.code, message=metrics.clip(e, 600)))
        except Exception:  # a bug: log it, tell the caller only a reference, keep serving
            ref = uuid.uuid4().hex[:12]
            log.exception("control request %s failed (ref %s)", metrics.clip(request.subject), ref)
            reply = reply_type(error=ErrorBody(
                code="error", message=f"internal error (reference {ref} in the control plane's log)"
            ))
        with contextlib.suppress(Exception):
            await request.respond(encode(reply))

    async def _records(self, tenant: str) -> list[WorkloadRecord]:
        """The tenant's workload records (from this process's watcher: no server resources)."""
        return sorted(
            (r for r in self._records_by_key.values() if r.tenant_id == tenant),
            key=lambda r: (r.created_at, r.spec.name),
        )

    async def _get(self, tenant: str, name: str) -> WorkloadRecord:
        try:
            check_name("workload", name)
        except InvalidSpec as e:
            raise UnknownTenant(f"tenant {tenant!r} has no workload named like that ({e})") from e
        try:
            entry = await self._kv.get(self.n.workload_key(tenant, name))
        except KeyNotFoundError as e:
            raise UnknownTenant(f"tenant {tenant!r} has no workload {name!r}") from e
        return decode(entry.value, WorkloadRecord)

    def _bounded_spec(self, tenant: str, spec: WorkloadSpec, q: Quota) -> WorkloadSpec:
        """The spec as the service will run it: every number within the tenant's quota
        (else QuotaExceeded), the operator's priority, the dataset resolved in the
        tenant's own space."""
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
        if spec.task_type == "eval":
            bound("episodes", spec.episodes, q.max_eval_episodes)
        if spec.eval_every:
            bound("eval_episodes", spec.eval_episodes, q.max_eval_episodes)
        if spec.eval_videos:
            bound("eval_videos", spec.eval_videos, q.max_eval_videos)
            bound("video_frames", spec.video_frames, q.max_video_frames)
            # 0 = the camera's size: bounded here as the largest it may be.
            bound("video_size", spec.video_size or spec.image_size, q.max_video_size)
        sched = msgspec.structs.replace(s, priority=q.priority)  # the class's, never the tenant's
        spec = msgspec.structs.replace(spec, scheduling=sched)
        if spec.task_type == "sft" and spec.dataset:
            spec = msgspec.structs.replace(
                spec, dataset=resolve_dataset(self.datasets_root, tenant, spec.dataset,
                                              q.dataset_root)
            )
        return spec

    async def _create_workload(self, tenant: str, req: CreateWorkload) -> ApiReply:
        q = self.quotas.get(tenant)
        spec = await asyncio.to_thread(self._bounded_spec, tenant, req.spec, q)
        async with self._lock:
            every = await self._records(tenant)
            # The evaluator's periodic evaluations (eval_every) are not the tenant's to count.
            records = [r for r in every if not r.periodic]
            active = [r for r in records if r.state == "active"]
            for rec in every:
                if rec.spec.name == spec.name:
                    if rec.spec == spec:
                        return ApiReply(workload=rec)  # a retried create
                    raise InvalidSpec(
                        f"tenant {tenant!r} already has a workload named {spec.name!r}; pick another name"
                    )
                if rec.state == "active" and rec.spec.task_type == spec.task_type != "eval":
                    raise InvalidSpec(
                        f"tenant {tenant!r} already runs an active {spec.task_type} workload "
                        f"({rec.spec.name!r}); cancel it first or wait for it to finish"
                    )
            if len(records) >= q.max_workloads:
                raise QuotaExceeded(
                    f"tenant {tenant!r} has {len(records)} workloads, its quota's max_workloads; "
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
                    f"{q.max_concurrent_evals}); wait for one to finish"
                )
            if spec.init_from_workload:
                await self._get(tenant, spec.init_from_workload)
            record = WorkloadRecord(tenant_id=tenant, spec=spec, created_at=time.time())
            signature = await self.init_policy(record)
            if spec.task_type == "eval":  # no jobs, no training: the evaluator picks it up
                record = msgspec.structs.replace(record, schema_signature=signature)
                await self._put_record(record)
                return ApiReply(workload=record)
            record = WorkloadRecord(
                tenant_id=tenant,
                spec=spec,
                created_at=record.created_at,
                schema_signature=signature,
            )
            s = spec.scheduling
            await self.sched.set_policy(
                TenantTaskPolicy(
                    tenant_id=tenant,
                    task_type=spec.task_type,
                    priority=s.priority,
                    max_in_flight=s.max_in_flight,
                    max_active_rollouts=s.max_active_rollouts,
                    completion_target=s.completion_target,
                    max_policy_staleness=s.max_policy_staleness,
                )
            )
            await self.sched.set_version(tenant, spec.name, 1)
            await self._put_record(record)
            return ApiReply(workload=record)

    async def _get_workload(self, tenant: str, req: NamedWorkload) -> ApiReply:
        return ApiReply(workload=await self._get(tenant, req.name))

    async def _list_workloads(self, tenant: str, _req: NamedWorkload) -> ApiReply:
        return ApiReply(workloads=await self._records(tenant))

    async def _cancel_workload(self, tenant: str, req: NamedWorkload) -> ApiReply:
        rec = await self._get(tenant, req.name)
        if rec.state == "active":
            rec = WorkloadRecord(
                tenant_id=rec.tenant_id,
                spec=rec.spec,
                state="cancelled",
                created_at=rec.created_at,
                schema_signature=rec.schema_signature,
            )
            await self._put_record(rec)
        return ApiReply(workload=rec)

    async def _open_job(self, tenant: str, req: OpenJob) -> ApiReply:
        rec = await self._get(tenant, req.workload)
        spec = rec.spec
        if spec.source != "tenant" or spec.task_type not in ("rl", "sft"):
            raise InvalidSpec(
                f"workload {req.workload!r} is fed by the service ({spec.task_type}, source "
                f"{spec.source!r}); create one with source='tenant' to submit your own data"
            )
        if rec.state != "active":
            raise InvalidSpec(f"workload {req.workload!r} is {rec.state}; it takes no more data")
        q = self.quotas.get(tenant)
        opened = sum(1 for who in self._opened_by.values() if who == tenant)
        if opened >= q.max_open_jobs:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {opened} jobs open (quota {q.max_open_jobs}); "
                "close_job or abort_job one first"
            )
        most = max(q.max_rollout_steps, q.max_batch_size)
        if not 1 <= req.sample_count <= most:
            raise QuotaExceeded(f"sample_count must be 1..{most}, got {req.sample_count}")
        instruction = spec.instruction
        if not instruction:
            from joynexus.agents.workloads import workload_schema

            instruction = (await asyncio.to_thread(workload_schema, spec))[1]
        job = await self.sched.reserve(
            tenant,
            spec.task_type,
            policy_key=spec.name,
            domain=spec.env or Path(spec.dataset).name,  # no server path in job records
            sample_count=req.sample_count,
            behavior_policy_version=req.behavior_policy_version,
            producer_role="tenant",
            metadata=JobMetadata(
                schema_signature=rec.schema_signature,
                extra={"instruction": instruction, "advantage": spec.advantage},
            ),
        )
        if job is not None:
            self._opened[job.job_id] = asyncio.get_running_loop().time()
            self._opened_by[job.job_id] = tenant
        return ApiReply(job=job, refused="" if job else self.sched.last_refusal)

    async def _close_job(self, tenant: str, req: CloseJob) -> ApiReply:
        job = await self._tenant_job(tenant, req.job_id, "close_job")
        nxt = JobState.NEEDS_ADVANTAGES if job.task_type == "rl" else JobState.READY
        job = await self.sched.mark(job.job_id, nxt)
        self._opened.pop(job.job_id, None)
        self._opened_by.pop(job.job_id, None)
        return ApiReply(job=job)

    async def _abort_job(self, tenant: str, req: CloseJob) -> ApiReply:
        job = await self._tenant_job(tenant, req.job_id, "abort_job")
        self._opened.pop(job.job_id, None)
        self._opened_by.pop(job.job_id, None)
        if job.state != JobState.RESERVED or job.producer_role != "tenant":
            return ApiReply(job=job)  # closed already (or not the tenant's to give up)
        why = f"aborted by the tenant: {req.reason}" if req.reason else "aborted by the tenant"
        return ApiReply(job=await self.sched.fail(job.job_id, why))

    async def _adopt_open_jobs(self) -> None:
        """Start the clock for tenant jobs opened before this control plane started
        (a restart must not let a dead client's job hold its slot forever)."""
        try:
            keys = await self._kv.keys()
        except Exception:  # nats-py raises NoKeysError on an empty bucket
            return
        now = asyncio.get_running_loop().time()
        for key in keys:
            try:
                entry = await self._kv.get(key)
                rec = decode(entry.value, WorkloadRecord)
                if rec.spec.source != "tenant" or rec.spec.task_type not in ("rl", "sft"):
                    continue
                jobs = await self.sched.list_jobs(
                    rec.tenant_id, policy_key=rec.spec.name, states=[JobState.RESERVED]
                )
            except Exception as e:  # one unreadable record must not stop the others
                log.warning("adopting open jobs of %s failed: %s", key, e)
                continue
            for job in jobs:
                if job.producer_role == "tenant":
                    self._opened.setdefault(job.job_id, now)
                    self._opened_by.setdefault(job.job_id, job.tenant_id)

    async def _expire_open_jobs(self) -> None:
        """Fail the jobs tenants opened and never closed (their client died mid-submit)."""
        every = max(0.2, min(30.0, self.open_job_ttl_s / 4))
        while True:
            raise_if_cancelled()
            await asyncio.sleep(every)
            now = asyncio.get_running_loop().time()
            for job_id, opened in list(self._opened.items()):
                if now - opened < self.open_job_ttl_s:
                    continue
                self._opened.pop(job_id, None)
                who = self._opened_by.pop(job_id, "")
                try:
                    job = await self.sched.get_job(job_id)
                    if job.state == JobState.RESERVED:
                        await self.sched.fail(
                            job_id,
                            f"the tenant did not close it within {self.open_job_ttl_s:.0f}s "
                            "of open_job (its client stopped mid-submit?)",
                        )
                except Exception as e:  # the scheduler restarting: try again next round
                    raise_if_cancelled()
                    log.warning("expiring open job %s failed: %s", job_id, e)
                    self._opened[job_id] = opened
                    self._opened_by[job_id] = who

    # ------------------------------------------------------------ the tenant's own data
    async def _tenant_job(self, tenant: str, job_id: str, verb: str) -> TrainingJob:
        """One of the tenant's jobs; another tenant's is refused like an unknown one."""
        try:
            job = await self.sched.get_job(job_id)
        except UnknownJob:
            job = None
        if job is not None and job.tenant_id != tenant:
            await metrics.security(
                self.b,
                tenant,
                action=verb,
                subject=self.n.api(tenant, verb),
                reason=f"tenant {tenant!r} named job {job_id!r} of tenant {job.tenant_id!r}",
                source="control",
            )
        if job is None or job.tenant_id != tenant:  # never reveal another tenant's job
            raise UnknownJob(f"tenant {tenant!r} has no job {job_id!r}")
        return job

    async def _read_events(self, tenant: str, req: ReadEvents) -> ApiReply:
        if not isinstance(req.after_seq, int) or req.after_seq > 1 << 62:
            raise InvalidSpec("after_seq must be a stream sequence (an integer)")
        if req.after_seq < 0:  # from now on: where the log ends
            info = await self.b.js.stream_info(self.n.jobs_stream)
            return ApiReply(last_seq=info.state.last_seq)
        limit = max(1, min(req.limit, MAX_EVENTS_PAGE))
        wait_s = req.wait_s if math.isfinite(req.wait_s) else 0.0  # NaN would park it forever
        deadline = asyncio.get_running_loop().time() + min(max(wait_s, 0.0), MAX_EVENTS_WAIT_S)
        while True:
            tick = self._ticks.get(tenant, 0)
            items, last = await read_subject(
                self.b, self.n.jobs_stream, self.n.tenant_jobs(tenant), req.after_seq + 1,
                limit=limit,
            )
            left = deadline - asyncio.get_running_loop().time()
            if items or left <= 0:
                break
            # Wait for one of this tenant's events (re-read at least every second:
            # a core message can be seen just before the stream has stored it).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait_tick(tenant, tick), min(left, 1.0))
        return ApiReply(
            events=[EventEntry(seq=seq, event=msgspec.Raw(data)) for seq, data in items],
            last_seq=last,
        )

    async def _wait_tick(self, tenant: str, tick: int) -> None:
        async with self._tick:
            while self._ticks.get(tenant, 0) == tick:
                await self._tick.wait()

    async def _put_data(self, tenant: str, req: PutData) -> ApiReply:
        job = await self._tenant_job(tenant, req.job_id, "put_data")
        if job.producer_role != "tenant" or job.state != JobState.RESERVED:
            raise InvalidSpec(
                f"job {req.job_id!r} takes no data from you (state {job.state.value}, produced "
                f"by {job.producer_role!r}); open one with open_job and put before close_job"
            )
        if not req.fields:
            raise InvalidSpec("put_data got no fields")
        q = self.quotas.get(tenant)
        size = sum(len(t.data) for t in req.fields.values())
        held = self._tq_bytes.setdefault(tenant, {})
        in_use = sum(held.values())
        if in_use + size > q.tq_bytes:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {in_use} bytes in the Training Queue; {size} more would "
                f"pass its quota of {q.tq_bytes} bytes: close or abort open jobs first"
            )
        try:
            data = {metrics.clip(name, 64): t.to_array(name) for name, t in req.fields.items()}
            fs = (await self._policies.latest(tenant, job.policy_key)).feature_schema
            _check_rows(data, fs, job.policy_key)
            check_values(data, fs, job.policy_key)
            held[job.job_id] = held.get(job.job_id, 0) + size
            meta = await self._tq.async_put(data, tenant_id=tenant, partition_id=job.partition_id)
        except (InvalidSpec, ShapeMismatch) as e:
            # Bad rows: the job will never be closed; end it now so it holds no slot.
            await self.sched.fail(job.job_id, f"refused data: {e}")
            raise
        return ApiReply(job=job, rows=len(meta.rows))

    async def _get_policy(self, tenant: str, req: PolicyQuery) -> ApiReply:
        check_name("workload", req.workload)
        rec = await self._policies.get(tenant, req.workload, req.version)
        if req.limit <= 0:
            return ApiReply(policy=rec)
        if req.offset < 0:
            raise InvalidSpec(f"offset must be >= 0, got {req.offset}")
        # Replies are JSON (bytes as base64): keep a slice well under max_payload.
        limit = min(req.limit, self.b.max_payload // 2)
        weights = await self._policies.load_weights(rec)
        return ApiReply(policy=rec, data=weights[req.offset : req.offset + limit])

    async def _usage(self, tenant: str, req: UsageQuery) -> ApiReply:
        """The tenant's own usage (never another's: the tenant is the subject's)."""
        if not math.isfinite(req.since) or req.since < 0:
            raise InvalidSpec(f"since must be a time in epoch seconds >= 0, got {req.since}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.meter.ready.wait(), 10.0)
        return ApiReply(data=orjson.dumps(self.meter.report(tenant=tenant, since=req.since)))

    async def _get_video(self, tenant: str, req: VideoQuery) -> ApiReply:
        """A slice of one of the tenant's own evaluation videos: the record is looked
        up under the requester's tenant, the object named from it (another tenant's
        evaluation is an unknown workload)."""
        rec = await self._get(tenant, req.workload)
        if not isinstance(req.index, int) or not 0 <= req.index < len(rec.videos):
            raise InvalidSpec(
                f"workload {req.workload!r} has {len(rec.videos)} videos; index must be 0.."
                f"{len(rec.videos) - 1}, got {req.index!r}"
            )
        if req.offset < 0:
            raise InvalidSpec(f"offset must be >= 0, got {req.offset}")
        store = await self.b.js.object_store(self.n.weights_store)
        try:
            obj = await store.get(video_object_name(tenant, rec.spec.name, rec.videos[req.index]))
        except (ObjectNotFoundError, NotFoundError) as e:
            raise UnknownTenant(
                f"video {req.index} of workload {req.workload!r} is missing from the store"
            ) from e
        data = obj.data
        limit = min(req.limit if req.limit > 0 else self.b.max_payload // 2, self.b.max_payload // 2)
        return ApiReply(workload=rec, data=(data or b"")[req.offset : req.offset + limit])

    # ------------------------------------------------------------ the operator API
    async def _serve_admin(self, request: Request) -> None:
        verb = request.subject.split(".")[-1]

        async def call() -> Any:
            if verb not in ADMIN_VERBS:
                raise InvalidSpec(f"unknown admin verb {verb!r}; verbs are {list(ADMIN_VERBS)}")
            req = decode(request.data or b"{}", TenantRequest, what=f"{verb} request")
            return await getattr(self, f"_{verb}")(req)

        await self._answer(request, verb, AdminReply, call)

    async def _identity(self, tenant: str) -> TenantIdentity | None:
        try:
            entry = await self._ids.get(tenant)
        except KeyNotFoundError:
            return None
        return decode(entry.value, TenantIdentity) if entry.value else None

    async def _wait_applied(self, revision: int, wait_s: float) -> str:
        """'yes' once every server's auth sync (one per node) applied ``revision``;
        'off' when none answers for this namespace (authorization off, or an
        external server); 'pending' if one did not apply it in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        # An auth sync finds a new bucket at once (an advisory) or within 0.5 s.
        discover_deadline = loop.time() + min(wait_s, 5.0)
        applied: dict[str, int] = {}
        watcher = await self._ids.watch(f"{APPLIED_KEY}.>")
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    entry = await watcher.updates(timeout=0.25)
                    if entry is not None and entry.operation in ("DEL", "PURGE"):
                        applied.pop(entry.key, None)
                    elif entry is not None and entry.value:
                        applied[entry.key] = decode(entry.value, AuthApplied).revision
                if applied and all(r >= revision for r in applied.values()):
                    return "yes"
                now = loop.time()
                if not applied and now >= discover_deadline:
                    return "off"
                if now >= deadline:
                    return "pending"
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _tenant_info(self, ident: TenantIdentity) -> TenantInfo:
        records = await self._records(ident.tenant_id)
        return TenantInfo(
            tenant_id=ident.tenant_id,
            user=ident.user,
            created_at=ident.created_at,
            rotated_at=ident.rotated_at,
            workloads=len(records),
            active_workloads=sum(1 for r in records if r.state == "active"),
            quota=ident.quota,
            usage=self.usage(ident.tenant_id),
        )

    def usage(self, tenant: str) -> dict[str, int]:
        """What ``tenant`` holds now, against its quota (status shows it)."""
        return {
            "tq_bytes": sum(self._tq_bytes.get(tenant, {}).values()),
            "open_jobs": sum(1 for who in self._opened_by.values() if who == tenant),
            "requests_in_flight": self.rpc.in_flight.get(tenant, 0),
        }

    async def _tenant_add(self, req: TenantRequest) -> AdminReply:
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
        async with self._lock:
            old = await self._identity(tenant)
            if old is not None and not req.rotate:
                raise InvalidSpec(
                    f"tenant {tenant!r} already has credentials; rotate them "
                    f"(`joynexus tenant add {tenant} --rotate`) to issue new ones"
                )
            now = time.time()
            ident = TenantIdentity(
                tenant_id=tenant,
                user=self.n.tenant_user(tenant),
                password_hash=req.password_hash,
                created_at=old.created_at if old else now,
                rotated_at=now if old else 0.0,
                quota=req.quota if req.quota is not None else (old.quota if old else None),
            )
            revision = await self._ids.put(tenant, encode(ident))
            self.quotas.update(ident)
        applied = await self._wait_applied(revision, req.wait_s)
        return AdminReply(tenant=await self._tenant_info(ident), applied=applied)  # type: ignore[arg-type]

    async def _tenant_set(self, req: TenantRequest) -> AdminReply:
        tenant = check_name("tenant", req.tenant)
        if req.quota is None:
            raise InvalidSpec("tenant_set needs quota (joynexus tenant set NAME --quota KEY=VALUE)")
        async with self._lock:
            old = await self._identity(tenant)
            if old is None:
                raise UnknownTenant(f"no tenant {tenant!r}; add it first (joynexus tenant add)")
            ident = msgspec.structs.replace(old, quota=req.quota)
            revision = await self._ids.put(tenant, encode(ident))
            self.quotas.update(ident)
        applied = await self._wait_applied(revision, req.wait_s)
        return AdminReply(tenant=await self._tenant_info(ident), applied=applied)  # type: ignore[arg-type]

    async def _tenant_remove(self, req: TenantRequest) -> AdminReply:
        tenant = check_name("tenant", req.tenant)
        async with self._lock:
            ident = await self._identity(tenant)
            if ident is None:
                raise UnknownTenant(f"tenant {tenant!r} has no credentials to revoke")
            await self._ids.delete(tenant)
            # The delete marker's revision, or a later one: applying either applies ours.
            entry_rev = await self._last_revision()
        cancelled = []
        if req.cancel_workloads:
            for rec in await self._records(tenant):
                if rec.state == "active":
                    await self._cancel_workload(tenant, NamedWorkload(name=rec.spec.name))
                    cancelled.append(rec.spec.name)
        applied = await self._wait_applied(entry_rev, req.wait_s)
        return AdminReply(tenant=await self._tenant_info(ident), applied=applied, cancelled=cancelled)  # type: ignore[arg-type]

    async def _last_revision(self) -> int:
        info = await self.b.js.stream_info(f"KV_{self.n.identities_bucket}")
        return int(info.state.last_seq)

    async def _tenant_list(self, _req: TenantRequest) -> AdminReply:
        infos = []
        for key in await self._identity_keys():
            try:
                ident = await self._identity(key)
            except Exception:  # a record that does not decode: list the others
                log.warning("identity record %r does not decode", metrics.clip(key, 64))
                continue
            if ident is not None:
                infos.append(await self._tenant_info(ident))
        return AdminReply(tenants=infos)

    async def _identity_keys(self) -> list[str]:
        try:
            keys = await self._ids.keys()
        except Exception:  # nats-py raises NoKeysError on an empty bucket
            return []
        return sorted(k for k in keys if not is_applied_key(k))


def _check_rows(data: dict[str, Any], fs: FeatureSchemaSpec, workload: str) -> None:
    """Rows the tenant hands in must fit its workload's schema (else its jobs would
    fail at training time, far from the mistake)."""
    h, w = fs.image_hw
    want: dict[str, tuple[int, ...]] = {
        f"obs_image_{slot}": (fs.channels, h, w) for slot in fs.camera_slots
    }
    want["obs_state"] = (fs.state_dim,)
    want["actions"] = (fs.action_horizon, fs.action_dim)
    for name, shape in want.items():
        arr = data.get(name)
        if arr is None:
            raise InvalidSpec(f"workload {workload!r} needs field {name!r} of shape [B, {', '.join(map(str, shape))}]")
        if tuple(arr.shape[1:]) != shape:
            raise ShapeMismatch(
                f"field {name!r} of workload {workload!r}: expected [B, "
                f"{', '.join(map(str, shape))}], got {list(arr.shape)}"
            )

