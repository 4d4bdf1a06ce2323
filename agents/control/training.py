"""The training client's door (``train_call``, ``train_result``): a tenant's call
on its own ``custom`` workload becomes a job, and its result comes back.

``train_call`` checks the call (``schemas.training.TrainCall`` validates itself;
here: the tenant's own active custom workload, a head the client drives, rows
within its quota, open jobs within its bound) and reserves a ``custom`` job
carrying it; admission (``scheduling.max_in_flight``) bounds the calls in
flight, and may make it wait. A row call then sends its rows with
``put_data`` (checked by ``check_call_rows``: exactly the fields the call
reads, the outputs' shapes, finite values) and ``close_job``; any other call
is ready at once. ``train_result`` answers the result the actor wrote for the
call, waiting for the tenant's job events; a call that failed before the actor
recorded a result answers its job's reason.

See docs/ARCHITECTURE.md, "The training client".
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from pathlib import Path

from joynexus.agents.control.base import ControlBase
from joynexus.agents.control.checks import open_jobs_of
from joynexus.agents.control.submissions import open_wait_s
from joynexus.broker.slots import waiting
from joynexus.broker.trainercalls import CallStore
from joynexus.broker.trainerstate import TrainerStateStore
from joynexus.schemas.errors import Conflict, InvalidSpec, QuotaExceeded, UnknownJob
from joynexus.schemas.jobs import TERMINAL_STATES, JobMetadata, JobState, check_name
from joynexus.schemas.quotas import Quota
from joynexus.schemas.training import HEAD_FAMILIES, ROW_OPS, TrainCall, TrainResultQuery
from joynexus.schemas.workloads import ApiReply, WorkloadRecord

__all__ = ["MAX_RESULT_WAIT_S", "TrainingAPI", "check_train_call"]

#: The longest one train_result waits for its call's result.
MAX_RESULT_WAIT_S = 20.0


def check_train_call(tenant: str, rec: WorkloadRecord, call: TrainCall, q: Quota, opened: int) -> None:
    """May ``tenant`` (with ``opened`` jobs open) make ``call`` on its workload ``rec``?"""
    spec = rec.spec
    if spec.task_type != "custom":
        raise InvalidSpec(
            f"workload {call.workload!r} is {spec.task_type}; the training client drives "
            "task_type='custom' workloads"
        )
    if rec.state != "active":
        raise InvalidSpec(f"workload {call.workload!r} is {rec.state}; it takes no more calls")
    if spec.action_module not in HEAD_FAMILIES:
        raise InvalidSpec(
            f"the training client drives heads {sorted(HEAD_FAMILIES)}, not {spec.action_module!r}"
        )
    if call.op in ROW_OPS:
        if call.sample_count > q.max_batch_size:
            raise QuotaExceeded(
                f"{call.op} of {call.sample_count} rows is over tenant {tenant!r}'s quota "
                f"(max_batch_size {q.max_batch_size})"
            )
        if opened >= q.max_open_jobs:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {opened} jobs open (quota {q.max_open_jobs}); "
                "finish sending the rows of one first"
            )


class TrainingAPI(ControlBase):
    _calls: CallStore | None = None

    def _call_store(self) -> CallStore:
        if self._calls is None:
            self._calls = CallStore(self.b)
        return self._calls

    async def _train_call(self, tenant: str, req: TrainCall) -> ApiReply:
        rec = await self._get(tenant, req.workload)
        spec = rec.spec
        check_train_call(tenant, rec, req, self.quotas.get(tenant),
                         open_jobs_of(self._opened_by, tenant))
        if req.client:
            current = await self._call_store().client(tenant, req.workload)
            if current is None or current.epoch < req.client:  # no start gave it
                raise Conflict(
                    f"workload {req.workload!r} started no training client {req.client} (the "
                    f"latest is {0 if current is None else current.epoch}); make a training "
                    "client to call it"
                )
            if current.epoch != req.client:
                started = time.strftime("%H:%M:%S UTC", time.gmtime(current.started_at))
                raise Conflict(
                    f"workload {req.workload!r} has a newer training client (started "
                    f"{started}): this one's calls are refused; make a new training client "
                    "to go on (it continues after every call already made)"
                )
        if req.again and req.client:  # asked again after no reply: its job may exist
            # Filtered in the scheduler by (client, seq): the reply is that call's job(s),
            # not the workload's whole history, whichever call a tenant marks ``again``.
            mine = {"client": str(req.client), "seq": str(req.seq)}
            for j in await self.sched.list_jobs(tenant, workload=spec.name,
                                                generation=rec.generation, extra=mine):
                x = j.metadata.extra  # checked here too (a scheduler of an older release)
                if j.task_type == "custom" and all(x.get(k) == v for k, v in mine.items()):
                    if j.state in TERMINAL_STATES and not await self._call_store().get_result(
                            tenant, spec.name, j.job_id):
                        break  # ended unapplied (an abort): reserve it anew
                    return ApiReply(job=j)
        instruction = await self._instruction(spec, rec)
        async with waiting():  # a long poll holds none of the tenant's working slots
            r = await self.sched.reserve_reply(
                tenant, "custom", workload=spec.name, generation=rec.generation,
                domain=spec.env or Path(spec.dataset).name,  # no server path in job records
                sample_count=req.sample_count, producer_role="tenant",
                metadata=JobMetadata(schema_signature=rec.schema_signature,
                                     extra={"instruction": instruction, **req.extra()}),
                wait_s=open_wait_s(req.wait_s),
            )
        job = r.job
        if job is None:
            return ApiReply(refused=r.refused, refusal=r.refusal, position=r.position,
                            waited_s=r.waited_s)
        if req.op in ROW_OPS:  # its rows come next (put_data, close_job): the open-job clock
            self._opened[job.job_id] = asyncio.get_running_loop().time()
            self._opened_by[job.job_id] = tenant
            return ApiReply(job=job)
        return ApiReply(job=await self.sched.mark(job.job_id, JobState.READY))

    async def _train_result(self, tenant: str, req: TrainResultQuery) -> ApiReply:
        check_name("workload", req.workload)
        if not req.job_id:  # where a new training client starts (and, started, its epoch)
            epoch = await self._call_store().new_client(tenant, req.workload) if req.start else 0
            return ApiReply(last_seq=await self._last_call(tenant, req.workload), client=epoch)
        job = await self._tenant_job(tenant, req.job_id, "train_result")
        if job.workload != req.workload or job.task_type != "custom":
            raise UnknownJob(f"workload {req.workload!r} has no call {req.job_id!r}")
        wait_s = req.wait_s if math.isfinite(req.wait_s) else 0.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait_s, 0.0), MAX_RESULT_WAIT_S)
        store = self._call_store()
        while True:
            tick = self._ticks.get(tenant, 0)
            data = await store.get_result(tenant, job.workload, job.job_id)
            if data is not None:
                return ApiReply(job=job, data=data)
            if job.state in TERMINAL_STATES:
                raise InvalidSpec(f"call {job.job_id} {job.state.value}: {job.reason or 'no result'}")
            left = deadline - loop.time()
            if left <= 0:
                return ApiReply(job=job)  # not yet: ask again
            with contextlib.suppress(TimeoutError):
                async with waiting():  # without the tenant's working slot
                    await asyncio.wait_for(self._wait_tick(tenant, tick), min(left, 1.0))
            job = await self.sched.get_job(job.job_id)

    async def _last_call(self, tenant: str, workload: str) -> int:
        """The last call a new client follows: the last applied, or a later one still
        to apply (a previous client's calls in flight: reserved with their rows on the
        way, ready or leased)."""
        rec = await self._get(tenant, workload)
        head = await TrainerStateStore(self.b).head(tenant, workload)
        applied = 0 if head is None else head[0].last_call_seq
        waiting = await self.sched.list_jobs(tenant, workload=workload, generation=rec.generation,
                                             states=[JobState.RESERVED, JobState.READY, JobState.LEASED])
        return max([applied, *(int(j.metadata.extra.get("seq", "0") or 0) for j in waiting
                               if j.task_type == "custom")])

    async def _wait_tick(self, tenant: str, tick: int) -> None:  # the data gateway's
        raise NotImplementedError
