"""The control plane's hook that publishes version 1 of a new workload's action
module: fresh weights, or a copy of a version of another of the tenant's
workloads (SFT then RL); an evaluation publishes nothing, its version is checked.

See docs/ARCHITECTURE.md ("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio

from joynexus.agents.models.heads import HeadConfig, TenantModule
from joynexus.agents.models.policyio import PolicyStore, feature_schema_of, module_from_weights
from joynexus.agents.producers.schema import feature_dim, normalization_stats, workload_schema
from joynexus.broker.connection import Broker
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadRecord


class PolicyInitializer:
    """Publishes version 1 of a new workload's policy (the control plane's hook)."""

    def __init__(self, broker: Broker) -> None:
        self.store = PolicyStore(broker)

    async def __call__(self, record: WorkloadRecord) -> str:
        spec = record.spec
        schema, _ = await asyncio.to_thread(workload_schema, spec)
        if spec.task_type == "eval":  # evaluates an existing version: check it, publish nothing
            src = await self.store.get(record.tenant_id, spec.init_from_workload, spec.init_from)
            if feature_schema_of(src).backbone_key() != schema.backbone_key() or (
                src.feature_schema.state_dim,
                src.feature_schema.action_dim,
            ) != (schema.state_dim, schema.action_dim):
                raise InvalidSpec(
                    f"{spec.init_from_workload!r} v{src.version} ({src.schema_signature}) cannot act in "
                    f"{spec.env} ({schema.signature()}): cameras, image size, state and action dims must match"
                )
            return src.schema_signature
        cfg = HeadConfig(
            feature_dim=feature_dim(spec.base_model),
            state_dim=schema.state_dim,
            action_dim=schema.action_dim,
            action_horizon=schema.action_horizon,
            hidden=spec.head_hidden,
            seed=spec.seed,
        )
        module = TenantModule(record.tenant_id, spec.action_module, cfg, lr=spec.learning_rate)
        module.set_normalization(await asyncio.to_thread(normalization_stats, spec))
        if spec.init_from_workload:
            src = await self.store.get(record.tenant_id, spec.init_from_workload, spec.init_from)
            if (
                feature_schema_of(src).signature() != schema.signature()
                or src.head_type != spec.action_module
            ):
                raise InvalidSpec(
                    f"cannot start {spec.name!r} from {spec.init_from_workload!r} v{src.version}: its head "
                    f"({src.head_type}, {src.schema_signature}) differs from this workload's "
                    f"({spec.action_module}, {schema.signature()})"
                )
            loaded = module_from_weights(src, await self.store.load_weights(src))
            module.head.load_state_dict(loaded.head.state_dict())
        try:
            await self.store.publish(
                record.tenant_id, spec.name, module, schema, spec.base_model, version=1
            )
        except InvalidSpec:
            pass  # v1 exists: a retried create
        return schema.signature()

