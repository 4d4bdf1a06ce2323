"""What every job of the control plane shares: its state and the lookups of a
tenant's own workload records and jobs.

:class:`ControlBase` declares the state :class:`~joynexus.agents.control.agent.ControlPlane`
builds; the workload, submission, data and operator parts are mixins over it.
See docs/ARCHITECTURE.md ("Layout and import root",
"Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.js.errors import KeyNotFoundError

from joynexus.agents.control.checks import cancelled, ended, open_jobs_of
from joynexus.agents.control.door import IngressPace
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.eventlog import JobEventLog
from joynexus.broker.kvmirror import KVMirror
from joynexus.broker.policy import PolicyRecords, WeightsCache
from joynexus.broker.quotas import QuotaBook
from joynexus.broker.responder import Server
from joynexus.broker.subjects import Names
from joynexus.broker.tq import TrainingQueue
from joynexus.broker.usage import Meter
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import InvalidSpec, UnknownJob, UnknownTenant
from joynexus.schemas.jobs import TrainingJob, WorkloadEnded, check_name
from joynexus.schemas.workloads import WorkloadRecord

#: Publishes version 1 of a new workload's policy; returns its schema signature.
InitPolicy = Callable[[WorkloadRecord], Awaitable[str]]


class ControlBase:
    b: Broker
    n: Names
    sched: SchedulerClient
    init_policy: InitPolicy
    instance: str
    _kv: Any
    _ids: Any
    _lock: asyncio.Lock  # one create at a time: slot allocation is check-then-write
    _policies: PolicyRecords
    _weights: WeightsCache
    _log: JobEventLog
    _tq: TrainingQueue
    # Job events seen per tenant (a core subscription): wakes read_events long-polls.
    _ticks: dict[str, int]
    _tick: asyncio.Condition
    # Jobs a tenant opened and has not closed: job id -> when (monotonic); job id -> tenant.
    open_job_ttl_s: float
    _opened: dict[str, float]
    _opened_by: dict[str, str]
    # open_job calls waiting for admission now, per tenant (at most half its in-flight bound).
    _open_waits: Counter[str]
    #: Where tenants' datasets live (<root>/<tenant>/..., or the quota's own root).
    datasets_root: Path
    quotas: QuotaBook
    rpc: Server
    _records_mirror: KVMirror[WorkloadRecord]
    _records_by_key: dict[str, WorkloadRecord]
    # Training Queue bytes a tenant put, per open job (released when the job ends).
    _tq_bytes: dict[str, dict[str, int]]
    _tq_pace: IngressPace  # each tenant's Training Queue bytes a second
    meter: Meter

    async def revoke_tenant_keys(self, tenant: str) -> list[str]:
        """Delete the tenant's gateway API keys (agents/control/apikeys.py)."""
        raise NotImplementedError

    async def _put_record(self, rec: WorkloadRecord) -> None:
        key = self.n.workload_key(rec.tenant_id, rec.spec.name)
        await self._kv.put(key, encode(rec))
        self._records_mirror.put(key, rec)

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

    @staticmethod
    async def _instruction(spec: Any, rec: WorkloadRecord | None = None) -> str:
        """The instruction a workload's policy is conditioned on: its record's, else
        the spec's, else the task's or the dataset's own (``workload_schema``)."""
        got = rec.policy_instruction() if rec is not None else spec.instruction
        if got:
            return got
        from joynexus.agents.producers import workload_schema

        return str((await asyncio.to_thread(workload_schema, spec))[1])

    async def _cancel(self, tenant: str, name: str) -> WorkloadRecord:
        """Cancel the workload, then append its end to the job log (where its
        events end for the SDK, and a restarted scheduler takes it as ended)."""
        async with self._lock:
            rec = await self._get(tenant, name)
            if rec.state != "active":
                return rec
            rec = cancelled(rec, time.time())
            await self._put_record(rec)
        if rec.spec.task_type != "eval":
            await self._log.append_workload_end(
                WorkloadEnded(
                    tenant_id=tenant, workload=name, generation=rec.generation,
                    state="cancelled", reason="cancelled by its tenant",
                    at=rec.finished_at, by=self.instance,
                )
            )
        return rec

    async def _end_workload(self, end: WorkloadEnded) -> None:
        """A workload generation's end from the job log becomes its record's state."""
        async with self._lock:
            try:
                rec = await self._get(end.tenant_id, end.workload)
            except UnknownTenant:
                return
            new = ended(rec, end)
            if new is not None:
                await self._put_record(new)

    async def _apply_logged_ends(self) -> None:
        """Ends appended while no control plane watched (a restart): applied once."""
        for end in await self._log.workload_ends():
            await self._end_workload(end)

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

    def usage(self, tenant: str) -> dict[str, int]:
        """What ``tenant`` holds now, against its quota (status shows it)."""
        return {
            "tq_bytes": sum(self._tq_bytes.get(tenant, {}).values()),
            "open_jobs": open_jobs_of(self._opened_by, tenant),
            "requests_in_flight": self.rpc.in_flight.get(tenant, 0),
        }

    def _forget_open(self, job_id: str) -> str:
        """Stop the open-job clock of ``job_id``; the tenant that held it ("" if none)."""
        self._opened.pop(job_id, None)
        return self._opened_by.pop(job_id, "")
