"""The data gateway: a tenant's only door to its own data (it has no JetStream
access). Job events (``read_events``, paged by stream sequence, long-polled),
rows into its open jobs' Training Queue partitions (``put_data``, checked for
shape, dtype and range first), its policy versions and weights
(``get_policy``), evaluation videos (``get_video``) and usage (``usage``).

See docs/ARCHITECTURE.md ("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import orjson
from nats.js.errors import NotFoundError, ObjectNotFoundError

from joynexus.agents.control.base import ControlBase
from joynexus.agents.control.checks import (
    TERMINAL_STATES,
    check_after_seq,
    check_put_data,
    check_rows,
    check_since,
    check_tq_room,
    events_page,
    video_slice,
    weights_slice,
)
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import metrics
from joynexus.broker.direct import last_seq_of, read_subject
from joynexus.broker.slots import waiting
from joynexus.broker.subjects import is_workload_end, parse_job_subject
from joynexus.broker.usage import UsageQuery
from joynexus.schemas.base import decode
from joynexus.schemas.errors import (
    Conflict,
    InvalidSpec,
    JoyNexusError,
    ShapeMismatch,
    UnknownTenant,
)
from joynexus.schemas.jobs import WorkloadEnded, check_name
from joynexus.schemas.rows import check_values
from joynexus.schemas.samples import dims_of
from joynexus.schemas.training import HEAD_FAMILIES, TrainCall, check_call_rows
from joynexus.schemas.workloads import (
    ApiReply,
    EventEntry,
    PolicyQuery,
    PutData,
    ReadEvents,
    VideoQuery,
    video_object_name,
)


class DataGateway(ControlBase):
    async def _on_job_event(self, msg: Any) -> None:
        try:
            tenant, job_id, state = parse_job_subject(msg.subject)
        except InvalidSpec:
            return
        if is_workload_end(msg.subject):
            with contextlib.suppress(JoyNexusError):
                self.rpc.spawn(self._end_workload(decode(msg.data, WorkloadEnded)))
        if state in TERMINAL_STATES:  # its rows leave the Training Queue with it
            held = self._tq_bytes.get(tenant)
            if held is not None:
                held.pop(job_id, None)
                if not held:
                    self._tq_bytes.pop(tenant, None)
        async with self._tick:
            self._ticks[tenant] = self._ticks.get(tenant, 0) + 1
            self._tick.notify_all()

    async def _read_events(self, tenant: str, req: ReadEvents) -> ApiReply:
        check_after_seq(req.after_seq)
        if req.after_seq < 0:  # from now on: after the tenant's own last event (the
            # stream's last sequence would tell it the other tenants' event rate)
            return ApiReply(last_seq=await last_seq_of(self.b, self.n.jobs_stream,
                                                       self.n.tenant_jobs(tenant)))
        limit, wait_s = events_page(req)
        deadline = asyncio.get_running_loop().time() + wait_s
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
                async with waiting():  # without the tenant's working slot
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
        check_put_data(job, req)
        size = sum(len(t.data) for t in req.fields.values())
        held = self._tq_bytes.setdefault(tenant, {})
        check_tq_room(tenant, sum(held.values()), size, self.quotas.get(tenant))
        counted = False
        try:
            data = {metrics.clip(name, 64): t.to_array(name) for name, t in req.fields.items()}
            policy = await self._policies.latest(tenant, job.workload)
            fs = policy.feature_schema
            if job.task_type == "custom":  # a training client's call: the fields it reads
                check_call_rows(
                    TrainCall.from_extra(job.metadata.extra), HEAD_FAMILIES.get(policy.head_type, ""),
                    {k: tuple(a.shape[1:]) for k, a in data.items()},
                    dims_of(fs.action_horizon, fs.action_dim, fs.state_dim, fs.channels, fs.image_hw),
                    fs.camera_slots,
                )
            else:
                check_rows(data, fs, job.workload)
            check_values(data, fs, job.workload)
            held[job.job_id] = held.get(job.job_id, 0) + size
            counted = True
            wait = self._tq_pace.delay(tenant, size, time.monotonic(), self.quotas.get(tenant).tq_bytes_per_s)
            if wait > 0:
                await asyncio.sleep(min(wait, 30.0))
            meta = await self._tq.async_put(data, tenant_id=tenant, partition_id=job.partition_id,
                                            at_row=req.offset)
            if not meta.fields:  # a repeat of a put whose reply was lost: nothing more held
                held[job.job_id] -= size
        except (InvalidSpec, ShapeMismatch) as e:
            # Bad rows: the job will never be closed; end it now so it holds no slot.
            await self.sched.fail(job.job_id, f"refused data: {e}")
            raise
        except Conflict:  # refused at its offset: nothing written, nothing to hold
            # (Another failure, a store timeout, may have written: it stays counted until
            # the job ends; a put asked again then finds its rows and adds nothing.)
            if counted and job.job_id in held:
                held[job.job_id] -= size
            raise
        return ApiReply(job=job, rows=len(meta.rows))

    async def _get_policy(self, tenant: str, req: PolicyQuery) -> ApiReply:
        check_name("workload", req.workload)
        rec = await self._policies.get(tenant, req.workload, req.version)
        if req.limit <= 0:
            return ApiReply(policy=rec)
        part = weights_slice(req.offset, req.limit, self.b.max_payload)
        weights = await self._weights.get(rec.object_name,
                                          lambda: self._policies.load_weights(rec))
        return ApiReply(policy=rec, data=weights[part])

    async def _usage(self, tenant: str, req: UsageQuery) -> ApiReply:
        """The tenant's own usage (never another's: the tenant is the subject's)."""
        check_since(req.since)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.meter.ready.wait(), 10.0)
        out = self.meter.report(tenant=tenant, since=req.since)
        quick = SchedulerClient(self.b, by=self.sched.by, call_timeout_s=0.5, deadline_s=0.5)
        with contextlib.suppress(JoyNexusError, TimeoutError):  # no scheduler: usage still
            snap = await quick.snapshot()
            # Its share of the trainer now against its weighted fair share, its queue depth.
            out["trainer_share"] = next((msgspec.to_builtins(x) for x in snap.shares
                                         if x.tenant_id == tenant), {})
        return ApiReply(data=orjson.dumps(out))

    async def _get_video(self, tenant: str, req: VideoQuery) -> ApiReply:
        """A slice of one of the tenant's own evaluation videos: the record is looked
        up under the requester's tenant, the object named from it (another tenant's
        evaluation is an unknown workload)."""
        rec = await self._get(tenant, req.workload)
        index, part = video_slice(rec, req, self.b.max_payload)
        store = await self.b.js.object_store(self.n.weights_store)
        try:
            obj = await store.get(video_object_name(tenant, rec.spec.name, rec.videos[index]))
        except (ObjectNotFoundError, NotFoundError) as e:
            raise UnknownTenant(
                f"video {req.index} of workload {req.workload!r} is missing from the store"
            ) from e
        return ApiReply(workload=rec, data=(obj.data or b"")[part])
