"""The ``actor_forward`` stage: behaviour log-probabilities and values of an RL job.

PPO needs ``old_logp`` (log-prob of the taken chunk ``actions`` under the
policy the rollout acted with, with the std floor it sampled with) and the
critic's ``values`` for GAE; computing them here, on the resident frozen base
at the job's ``behavior_policy_version``, keeps the producers free of a model.
The stage is leased and retried exactly like the advantage stage (durable
consumer ``stage-actor-forward``); every work call claims all rows under a
task of its own, so a retry rewrites both fields whole.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from joynexus.agents.jobextra import (
    MAX_EXPLORATION_STD,
    exploration_floor,
    extra_number,
    uses_actor_forward,
    uses_decisions,
)
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.features import canonicalize_request
from joynexus.agents.models.grouped import encode_for
from joynexus.agents.models.heads.base import HEADS
from joynexus.agents.models.heads.gaussian import GaussianPolicy
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import PolicyStore, feature_schema_of
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.agents.stage import StageWorker
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.jobs import TrainingJob
from joynexus.schemas.samples import ACTIONS_FIELD, DECISION_FIELD, STATE_FIELD, image_field

STAGE = "actor_forward"
OLD_LOGP_FIELD = "old_logp"
VALUES_FIELD = "values"
#: Rows per backbone forward (bounds the stage's memory for long rollouts).
FORWARD_ROWS = 64
#: Tenant modules kept loaded (one per (tenant, policy, version)).
CACHE = 8


def gaussian_head(action_module: str) -> bool:
    """Heads of this type have a tractable likelihood and a critic (PPO applies)."""
    cls = HEADS.get(action_module)
    return cls is not None and issubclass(cls, GaussianPolicy)


def chunk_mask(decision_len_M: np.ndarray, horizon: int) -> np.ndarray:
    """bool [M, horizon]: the chunk steps each row's decision executed (none on rows
    executed open loop from an earlier decision)."""
    n_M = np.asarray(decision_len_M, dtype=np.int64).reshape(-1, 1)
    return np.arange(horizon)[None, :] < n_M


def forward_rows(
    backbone: Backbone, module: TenantModule, schema: Any, data: dict[str, np.ndarray],
    instruction: str, std_floor: float = 0.0, rows: int = FORWARD_ROWS,
) -> tuple[np.ndarray, np.ndarray]:
    """(old_logp [M], values [M]) of the taken chunks under ``module`` (pure compute).

    With ``DECISION_FIELD`` in ``data`` a row's log-probability is that of the chunk
    steps its decision executed (0 on rows that were not decisions)."""
    head = module.head
    if not isinstance(head, GaussianPolicy):
        raise InvalidSpec(
            f"head {module.head_type!r} has no tractable likelihood; its RL jobs skip actor_forward"
        )
    actions = np.ascontiguousarray(data[ACTIONS_FIELD], dtype=np.float32)
    if actions.ndim == 2:
        actions = actions[:, None, :]
    m = len(actions)
    mask = chunk_mask(data[DECISION_FIELD], actions.shape[1]) if DECISION_FIELD in data else None
    logp = np.empty(m, dtype=np.float32)
    values = np.empty(m, dtype=np.float32)
    head.eval()
    with torch.no_grad():
        for s in range(0, m, rows):
            e = min(m, s + rows)
            batch = canonicalize_request(
                schema,
                {c: data[image_field(c)][s:e] for c in schema.camera_slots},
                instruction,
                data[STATE_FIELD][s:e],
            )
            feats = encode_for(backbone, batch, head)  # pooled or token features, as the head reads
            state = batch.state_B_S.to(feats.device)
            mask_rows = None if mask is None else torch.from_numpy(mask[s:e]).to(feats.device)
            logp[s:e] = head.log_prob(
                feats, state, torch.from_numpy(actions[s:e]).to(feats.device), std_floor, mask_rows
            ).cpu().numpy()
            values[s:e] = head.value(feats, state).cpu().numpy()
    return logp, values


class ActorForwardAgent:
    """The ``actor_forward`` stage worker (role ``actor-forward``)."""

    def __init__(
        self,
        broker: Broker,
        backbone: Backbone,
        *,
        instance: str,
        ack_wait_s: float = 30.0,
    ) -> None:
        self.backbone = backbone
        self.tq = TrainingQueue(broker)
        self.policies = PolicyStore(broker)
        self.modules: OrderedDict[tuple[str, str, int], TenantModule] = OrderedDict()
        self.worker = StageWorker(
            broker,
            SchedulerClient(broker, by=instance),
            STAGE,
            self.work,
            ack_wait_s=ack_wait_s,
        )

    async def run(self, stop: asyncio.Event | None = None) -> None:
        await self.worker.run(stop)

    async def module(self, job: TrainingJob) -> tuple[TenantModule, Any]:
        """The tenant's module at the job's behaviour version, and its record."""
        key = (job.tenant_id, job.workload, job.behavior_policy_version)
        record = await self.policies.get(job.tenant_id, job.workload, job.behavior_policy_version)
        if key not in self.modules:
            self.modules[key] = await self.policies.load_module(record)
            while len(self.modules) > CACHE:
                self.modules.popitem(last=False)
        self.modules.move_to_end(key)
        return self.modules[key], record

    async def work(self, job: TrainingJob) -> int | None:
        module, record = await self.module(job)
        schema = feature_schema_of(record)
        fields = [STATE_FIELD, ACTIONS_FIELD, *[image_field(c) for c in schema.camera_slots]]
        if uses_decisions(job):
            fields.append(DECISION_FIELD)
        # A claim task of this work call's own: a retry (even of the same lease) reads every row.
        meta = await self.tq.async_get_meta(
            fields,
            job.sample_count or 1 << 30,
            tenant_id=job.tenant_id,
            partition_id=job.partition_id,
            task_name=f"af-{job.attempt}-{secrets.token_hex(4)}",
        )
        if not meta.rows:
            raise InvalidSpec(f"job {job.job_id}: its partition has no rows with fields {fields}")
        data = await self.tq.async_get_data(meta)
        logp, values = await asyncio.to_thread(
            forward_rows,
            self.backbone,
            module,
            schema,
            data,
            job.metadata.extra.get("instruction", ""),
            exploration_floor(job),
        )
        await self.tq.async_put(
            {OLD_LOGP_FIELD: logp, VALUES_FIELD: values}, tenant_id=job.tenant_id, metadata=meta
        )
        return len(meta.rows)


__all__ = [
    "MAX_EXPLORATION_STD",
    "OLD_LOGP_FIELD",
    "STAGE",
    "VALUES_FIELD",
    "ActorForwardAgent",
    "chunk_mask",
    "exploration_floor",
    "extra_number",
    "forward_rows",
    "gaussian_head",
    "uses_actor_forward",
    "uses_decisions",
]
