"""The control plane: validates tenants' workload specs and allocates their slots.

Serves ``<ns>.api.<tenant>.<verb>`` as the micro service ``<ns>-control``.
The tenant is taken from the subject (the third token), never from the
payload: once the broker fences tenants to their own API subjects, a tenant
cannot act for another. Creating a workload registers its admission policy
with the scheduler, publishes the first version of its action module (fresh
weights, or a copy of another of the tenant's versions) and stores the
workload record, which the producer agents watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError
from nats.micro import add_service
from nats.micro.request import Request

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import tracing
from joynexus.broker.connection import Broker
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import InvalidSpec, JoyNexusError, UnknownJob, UnknownTenant
from joynexus.schemas.jobs import JobMetadata, JobState, TenantTaskPolicy
from joynexus.schemas.scheduler import ErrorBody
from joynexus.schemas.workloads import (
    ApiReply,
    CloseJob,
    CreateWorkload,
    NamedWorkload,
    OpenJob,
    WorkloadRecord,
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
}


class ControlPlane:
    def __init__(
        self, broker: Broker, *, init_policy: InitPolicy, instance: str = "control-0"
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

    async def start(self) -> None:
        self._kv = await self.b.js.key_value(self.n.workloads_bucket)
        self._service = await add_service(
            self.b.nc,
            name=self.n.control_service,
            version="0.1.0",
            description="JoyNexus control plane: tenants' workload specs and slots",
        )
        await self._service.add_endpoint(name="api", subject=self.n.all_api, handler=self._handle)

    async def stop(self) -> None:
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, request: Request) -> None:
        task = asyncio.ensure_future(self._serve(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, request: Request) -> None:
        parts = request.subject.split(".")
        tenant, verb = parts[2], parts[3]
        try:
            if verb not in VERBS:
                raise InvalidSpec(f"unknown API verb {verb!r}; verbs are {sorted(VERBS)}")
            req = decode(request.data or b"{}", VERBS[verb], what=f"{verb} request")
            with tracing.tracer.start_as_current_span(
                f"control.{verb}", context=tracing.extract(request.headers)
            ):
                reply = await getattr(self, f"_{verb}")(tenant, req)
        except JoyNexusError as e:
            reply = ApiReply(error=ErrorBody(code=e.code, message=str(e)))
        except Exception as e:  # a bug: say so, keep serving
            log.exception("control request %s failed", request.subject)
            reply = ApiReply(error=ErrorBody(code="error", message=f"internal error: {e!r}"))
        with contextlib.suppress(Exception):
            await request.respond(encode(reply))

    async def _records(self, tenant: str) -> list[WorkloadRecord]:
        """The tenant's workload records: one watch over ``<tenant>.*`` (current values only)."""
        watcher = await self._kv.watch(f"{tenant}.*", ignore_deletes=True)
        out = []
        try:
            async for entry in watcher:
                if entry is None:  # the current values have all been delivered
                    break
                if entry.value:
                    out.append(decode(entry.value, WorkloadRecord))
        finally:
            await watcher.stop()
        return out

    async def _get(self, tenant: str, name: str) -> WorkloadRecord:
        try:
            entry = await self._kv.get(self.n.workload_key(tenant, name))
        except KeyNotFoundError as e:
            raise UnknownTenant(f"tenant {tenant!r} has no workload {name!r}") from e
        return decode(entry.value, WorkloadRecord)

    async def _create_workload(self, tenant: str, req: CreateWorkload) -> ApiReply:
        spec = req.spec
        async with self._lock:
            for rec in await self._records(tenant):
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
            if spec.init_from_workload:
                await self._get(tenant, spec.init_from_workload)
            record = WorkloadRecord(tenant_id=tenant, spec=spec, created_at=time.time())
            signature = await self.init_policy(record)
            if spec.task_type == "eval":  # no jobs, no training: the evaluator picks it up
                record = msgspec.structs.replace(record, schema_signature=signature)
                await self._kv.put(self.n.workload_key(tenant, spec.name), encode(record))
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
            await self._kv.put(self.n.workload_key(tenant, spec.name), encode(record))
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
            await self._kv.put(self.n.workload_key(tenant, req.name), encode(rec))
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
        instruction = spec.instruction
        if not instruction:
            from joynexus.agents.workloads import workload_schema

            instruction = (await asyncio.to_thread(workload_schema, spec))[1]
        job = await self.sched.reserve(
            tenant,
            spec.task_type,
            policy_key=spec.name,
            domain=spec.env or spec.dataset,
            sample_count=req.sample_count,
            behavior_policy_version=req.behavior_policy_version,
            producer_role="tenant",
            metadata=JobMetadata(
                schema_signature=rec.schema_signature,
                extra={"instruction": instruction, "advantage": spec.advantage},
            ),
        )
        return ApiReply(job=job, refused="" if job else self.sched.last_refusal)

    async def _close_job(self, tenant: str, req: CloseJob) -> ApiReply:
        try:
            job = await self.sched.get_job(req.job_id)
        except UnknownJob:
            job = None
        if job is None or job.tenant_id != tenant:  # never reveal another tenant's job
            raise UnknownJob(f"tenant {tenant!r} has no job {req.job_id!r}")
        nxt = JobState.NEEDS_ADVANTAGES if job.task_type == "rl" else JobState.READY
        return ApiReply(job=await self.sched.mark(job.job_id, nxt))
