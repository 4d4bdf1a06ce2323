"""Tenant heads to and from published policy versions (the torch side of the policy store).

``broker/policy.py`` keeps versions as records and safetensors bytes and never
imports torch; this module converts between those and a :class:`TenantModule`
with its :class:`FeatureSchema`, and :class:`PolicyStore` adds publishing and
loading a head.

See docs/ARCHITECTURE.md, "Layout and import root" (why the store is split).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any

import numpy as np

from joynexus.agents.featureschema import (
    FeatureSchema,
    feature_dim,
    feature_schema_of,
    kv_layers,
    schema_spec,
)
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.broker.policy import PolicyRecords
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.inference import PolicyRecord
from joynexus.schemas.workloads import WorkloadSpec

__all__ = [
    "PolicyStore",
    "feature_schema_of",
    "fresh_module",
    "module_from_weights",
    "schema_spec",
    "weights_bytes",
]


# -- conversions (pure) --------------------------------------------------------


def weights_bytes(module: TenantModule, version: int | None = None) -> bytes:
    """The head's weights as safetensors bytes, with the same metadata as
    ``TenantModule.export_safetensors`` (so ``import_safetensors`` reads them);
    ``version`` (default ``module.version``) is the published policy version."""
    from safetensors.torch import save

    tensors = {k: v.detach().cpu().contiguous() for k, v in module.head.state_dict().items()}
    meta = {
        "tenant": module.tenant,
        "head_type": module.head_type,
        "version": str(module.version if version is None else version),
        "config": json.dumps(asdict(module.cfg)),
    }
    return bytes(save(tensors, metadata=meta))


def fresh_module(tenant: str, spec: WorkloadSpec, schema: FeatureSchema,
                 stats: dict[str, dict[str, list[float]]]) -> TenantModule:
    """``spec``'s head for ``tenant`` with fresh weights (from ``spec.seed``) and the
    normalisation ``stats``: what version 1 is (``producers.init.publish_fresh``)."""
    cfg = HeadConfig(
        feature_dim=feature_dim(spec.base_model),
        state_dim=schema.state_dim,
        action_dim=schema.action_dim,
        action_horizon=schema.action_horizon,
        hidden=spec.head_hidden,
        seed=spec.seed,
        kv_layers=kv_layers(spec.base_model, spec.action_module),
        expert_state=spec.expert_state,
    )
    module = TenantModule(tenant, spec.action_module, cfg, lr=spec.learning_rate)
    module.set_normalization(stats)
    return module


def module_from_weights(record: PolicyRecord, data: bytes) -> TenantModule:
    """Rebuild the tenant's head (eval use) from a record and its safetensors bytes."""
    from safetensors.torch import load

    try:
        cfg = HeadConfig(**record.head_config)
        module = TenantModule(record.tenant_id, record.head_type, cfg)
        module.head.load_state_dict(load(data))
    except InvalidSpec:
        raise
    except Exception as e:  # bad bytes or a state dict of another shape
        raise InvalidSpec(
            f"policy {record.tenant_id}.{record.workload} v{record.version}: weights "
            f"{record.object_name!r} do not load into a {record.head_type} head ({e}); republish them"
        ) from e
    module.version = record.version
    module.head.eval()
    return module


# -- the store ------------------------------------------------------------------


class PolicyStore(PolicyRecords):
    """Publish, look up, load and watch tenant policy versions."""

    async def publish(
        self,
        tenant_id: str,
        workload: str,
        module: TenantModule,
        schema: FeatureSchema,
        base_model: str | None = None,
        *,
        version: int | None = None,
    ) -> PolicyRecord:
        """Publish ``module``'s head weights as a new version (weights first, record second).

        ``version`` defaults to the latest published + 1 (1 for the first);
        an explicit one must be above the latest. Raises ``Conflict`` if
        another publisher wrote the key meanwhile.
        """
        base_model = base_model or schema.base_model
        if schema.base_model != base_model:
            raise InvalidSpec(
                f"schema is for base model {schema.base_model!r} but base_model={base_model!r}; "
                "build the FeatureSchema with the engine's base model"
            )
        cfg = module.cfg
        if cfg.state_dim != schema.state_dim:
            raise InvalidSpec(
                f"head state_dim={cfg.state_dim} but schema state_dim={schema.state_dim}; they must match"
            )
        if module.head_type != "value" and (cfg.action_dim, cfg.action_horizon) != (
            schema.action_dim,
            schema.action_horizon,
        ):
            raise InvalidSpec(
                f"head predicts {cfg.action_horizon}x{cfg.action_dim} actions but the schema says "
                f"{schema.action_horizon}x{schema.action_dim}; they must match"
            )
        return await self.publish_weights(
            tenant_id,
            workload,
            lambda v: weights_bytes(module, v),
            head_type=module.head_type,
            head_config=asdict(cfg),
            feature_schema=schema_spec(schema),
            schema_signature=schema.signature(),
            base_model=base_model,
            version=version,
        )

    async def load_module(self, record: PolicyRecord) -> TenantModule:
        """Weights fetched and loaded into a fresh head (the parse runs off the event loop)."""
        data = await self.load_weights(record)
        return await asyncio.to_thread(module_from_weights, record, data)

    async def action_std(self, record: PolicyRecord, floor: float = 0.0) -> np.ndarray:
        """A Gaussian head's std per action dimension in the env's action units, at
        least ``floor``: what its rollouts (and a sampled evaluation) sample with."""
        head: Any = (await self.load_module(record)).head
        return head.action_std_A(floor).detach().cpu().numpy().astype(np.float32)
