"""Workload CRUD of the control plane: create (bounded by the quota, the first
policy version published, the admission policy registered), get, list, cancel.

The checks are pure (:mod:`joynexus.agents.control.checks`); this module does
the I/O around them.
See docs/ARCHITECTURE.md
("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from joynexus.agents.control.base import ControlBase
from joynexus.agents.control.checks import bound_spec, check_create
from joynexus.agents.datasets import resolve_checkpoint, resolve_dataset, resolve_export
from joynexus.schemas.jobs import WorkloadPolicy
from joynexus.schemas.quotas import Quota
from joynexus.schemas.workloads import (
    ApiReply,
    CreateWorkload,
    NamedWorkload,
    WorkloadRecord,
    WorkloadSpec,
)


class WorkloadsAPI(ControlBase):
    def _bounded_spec(self, tenant: str, spec: WorkloadSpec, q: Quota) -> WorkloadSpec:
        """The spec as the service will run it: every number within the tenant's quota
        (else QuotaExceeded), the operator's priority, the dataset resolved in the
        tenant's own space (and so the exported head or LeRobot checkpoint it starts from)."""
        spec = bound_spec(tenant, spec, q)
        if spec.task_type in ("sft", "custom") and spec.dataset:
            spec = msgspec.structs.replace(
                spec, dataset=resolve_dataset(self.datasets_root, tenant, spec.dataset,
                                              q.dataset_root)
            )
        if spec.init_from_export:
            spec = msgspec.structs.replace(
                spec, init_from_export=resolve_export(self.datasets_root, tenant,
                                                      spec.init_from_export, q.dataset_root)
            )
        if spec.init_from_checkpoint:
            spec = msgspec.structs.replace(
                spec, init_from_checkpoint=resolve_checkpoint(self.datasets_root, tenant,
                                                              spec.init_from_checkpoint, q.dataset_root)
            )
        return spec

    async def _create_workload(self, tenant: str, req: CreateWorkload) -> ApiReply:
        q = self.quotas.get(tenant)
        spec = await asyncio.to_thread(self._bounded_spec, tenant, req.spec, q)
        async with self._lock:
            checked = check_create(tenant, spec, await self._records(tenant), q)
            if isinstance(checked, WorkloadRecord):
                return ApiReply(workload=checked)  # a retried create
            generation = checked
            if spec.init_from_workload:
                await self._get(tenant, spec.init_from_workload)
            record = WorkloadRecord(
                tenant_id=tenant, spec=spec, generation=generation, created_at=time.time()
            )
            signature = await self.init_policy(record)
            record = msgspec.structs.replace(record, instruction=await self._instruction(spec))
            if spec.task_type == "eval":  # no jobs, no training: the evaluator picks it up
                record = msgspec.structs.replace(record, schema_signature=signature)
                await self._put_record(record)
                return ApiReply(workload=record)
            record = msgspec.structs.replace(record, schema_signature=signature)
            s = spec.scheduling
            await self.sched.set_policy(
                WorkloadPolicy(
                    tenant_id=tenant,
                    task_type=spec.task_type,
                    workload=spec.name,
                    generation=generation,
                    priority=s.priority,
                    weight=s.weight,
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
        return ApiReply(workload=await self._cancel(tenant, req.name))
