"""Tenant submissions: the jobs a tenant opens on its own ``source='tenant'``
workloads (SFT batches, RL rollouts it ran itself), closes or aborts, and the
clock that fails a job whose client died before closing it.

The rows themselves travel through the data gateway
(:mod:`joynexus.agents.control.data`).
See docs/ARCHITECTURE.md
("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from joynexus.agents.control.base import ControlBase
from joynexus.agents.control.checks import (
    abort_reason,
    check_open_job,
    closed_state,
    expired,
    expiry_period_s,
    open_jobs_of,
    takes_tenant_data,
)
from joynexus.agents.scheduler_verbs import MAX_RESERVE_WAIT_S
from joynexus.broker import kvwatch
from joynexus.broker.connection import raise_if_cancelled
from joynexus.broker.slots import waiting
from joynexus.schemas.base import decode
from joynexus.schemas.errors import QuotaExceeded
from joynexus.schemas.jobs import TERMINAL_STATES, JobMetadata, JobState
from joynexus.schemas.quotas import Quota
from joynexus.schemas.workloads import ApiReply, CloseJob, OpenJob, WorkloadRecord

log = logging.getLogger(__name__)

#: The longest one open_job waits in the admission queue (the scheduler's bound).
MAX_OPEN_WAIT_S = MAX_RESERVE_WAIT_S


def open_wait_s(asked: float) -> float:
    """How long an open_job that asked to wait ``asked`` s waits (0..MAX_OPEN_WAIT_S;
    a hostile NaN or negative: 0)."""
    return min(asked, MAX_OPEN_WAIT_S) if asked > 0 else 0.0


def max_open_waits(quota: Quota) -> int:
    """open_job calls of one tenant that may wait at once: half its requests in flight."""
    return max(1, quota.max_requests_in_flight // 2)


class SubmissionsAPI(ControlBase):
    async def _open_job(self, tenant: str, req: OpenJob) -> ApiReply:
        """Open a job on the tenant's own workload. Refused for a limit that will lift,
        it may wait in the scheduler's admission queue (``req.wait_s``, at most
        :data:`MAX_OPEN_WAIT_S`): a long poll that gives the tenant's working slots
        back while it waits, one of at most half its ``max_requests_in_flight`` at
        once (the rest stay for its other calls). The reply says why it waits and
        its place (``refusal``, ``position``)."""
        rec = await self._get(tenant, req.workload)
        spec = rec.spec
        quota = self.quotas.get(tenant)
        check_open_job(
            tenant, req.workload, rec, req.sample_count, quota,
            open_jobs_of(self._opened_by, tenant),
        )
        wait = open_wait_s(req.wait_s)
        if wait and self._open_waits[tenant] >= max_open_waits(quota):
            raise QuotaExceeded(
                f"tenant {tenant!r} has {self._open_waits[tenant]} open_job calls waiting for "
                f"admission (at most {max_open_waits(quota)}: half its max_requests_in_flight); "
                "wait for one to be admitted"
            )
        instruction = await self._instruction(spec, rec)
        self._open_waits[tenant] += 1
        try:
            async with waiting():  # a long poll holds none of the tenant's working slots
                r = await self.sched.reserve_reply(
                    tenant,
                    spec.task_type,
                    workload=spec.name,
                    generation=rec.generation,
                    domain=spec.env or Path(spec.dataset).name,  # no server path in job records
                    sample_count=req.sample_count,
                    behavior_policy_version=req.behavior_policy_version,
                    producer_role="tenant",
                    metadata=JobMetadata(
                        schema_signature=rec.schema_signature,
                        extra={"instruction": instruction, "advantage": spec.advantage},
                    ),
                    wait_s=wait,
                )
        finally:
            self._open_waits[tenant] -= 1
            if self._open_waits[tenant] <= 0:
                del self._open_waits[tenant]
        job = r.job
        if job is not None:
            self._opened[job.job_id] = asyncio.get_running_loop().time()
            self._opened_by[job.job_id] = tenant
            return ApiReply(job=job, position=r.position, waited_s=r.waited_s)
        return ApiReply(refused=r.refused, refusal=r.refusal, position=r.position,
                        waited_s=r.waited_s)

    async def _close_job(self, tenant: str, req: CloseJob) -> ApiReply:
        job = await self._tenant_job(tenant, req.job_id, "close_job")
        if job.producer_role == "tenant" and job.state not in (JobState.RESERVED, *TERMINAL_STATES):
            return ApiReply(job=job)  # closed before (a close repeated after a lost reply)
        job = await self.sched.mark(job.job_id, closed_state(job.task_type))
        self._forget_open(job.job_id)
        return ApiReply(job=job)

    async def _abort_job(self, tenant: str, req: CloseJob) -> ApiReply:
        job = await self._tenant_job(tenant, req.job_id, "abort_job")
        self._forget_open(job.job_id)
        if job.state != JobState.RESERVED or job.producer_role != "tenant":
            return ApiReply(job=job)  # closed already (or not the tenant's to give up)
        return ApiReply(job=await self.sched.fail(job.job_id, abort_reason(req.reason)))

    async def _adopt_open_jobs(self) -> None:
        """Start the clock for tenant jobs opened before this control plane started
        (a restart must not let a dead client's job hold its slot forever)."""
        keys = await kvwatch.keys(self._kv)
        now = asyncio.get_running_loop().time()
        for key in keys:
            try:
                entry = await self._kv.get(key)
                rec = decode(entry.value, WorkloadRecord)
                if not takes_tenant_data(rec.spec):
                    continue
                jobs = await self.sched.list_jobs(
                    rec.tenant_id, workload=rec.spec.name, states=[JobState.RESERVED]
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
        every = expiry_period_s(self.open_job_ttl_s)
        while True:
            raise_if_cancelled()
            await asyncio.sleep(every)
            now = asyncio.get_running_loop().time()
            for job_id, opened in expired(self._opened, now, self.open_job_ttl_s):
                who = self._forget_open(job_id)
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
