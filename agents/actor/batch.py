"""Tensors for one tenant's step: a job's Training Queue columns (numpy, as
``TrainingQueue.async_get_data`` returns them) into the ``TrainItem`` the
grouped step trains on, with the PPO batch staged on the tenant's module or the
AWR weights. Torch only, no connection: the actor's loop fetches, this builds.

Why apart: the shapes are the contract between producer, advantage stage,
``actor_forward`` and actor (``schemas/samples.py``). See docs/ARCHITECTURE.md
("Policies that learn").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from joynexus.agents.actor.decisions import ADVANTAGES_FIELD, RETURNS_FIELD
from joynexus.agents.actor.forward import (
    OLD_LOGP_FIELD,
    chunk_mask,
    exploration_floor,
    extra_number,
)
from joynexus.agents.advantage import awr_weights
from joynexus.agents.models.features import FeatureBatch, FeatureSchema, canonicalize_request
from joynexus.agents.models.grouped import TrainItem
from joynexus.agents.models.heads.ppo import PPOBatch
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.schemas.jobs import TrainingJob
from joynexus.schemas.samples import ACTIONS_FIELD, DECISION_FIELD, STATE_FIELD, image_field


@dataclass(frozen=True)
class StepKnobs:
    """The actor's own training settings (a job's metadata adds its bounded extras)."""

    awr_beta: float = 1.0
    ppo_clip: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    ppo_epochs: int = 1


def _col(data: dict[str, Any], name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data[name], dtype=np.float32).reshape(-1))


def ppo_batch(job: TrainingJob, module: TenantModule, data: dict[str, Any], horizon: int,
              knobs: StepKnobs) -> PPOBatch:
    """The clipped-ratio batch of one RL job: behaviour log-probabilities, advantages,
    returns, the executed part of each chunk, and the job's bounded extras."""
    mask = None
    if DECISION_FIELD in data:
        mask = torch.from_numpy(chunk_mask(data[DECISION_FIELD], horizon))
    # The first critic_warmup updates of the workload (its v1 is where it started)
    # train only the critic.
    warmup = extra_number(job, "critic_warmup", 0, 100_000)
    return PPOBatch(
        old_logp_B=_col(data, OLD_LOGP_FIELD),
        adv_B=_col(data, ADVANTAGES_FIELD),
        returns_B=_col(data, RETURNS_FIELD),
        # No clipped value loss: returns span tens of reward units (a success
        # is worth r / (1 - gamma)) and a +-clip band per behaviour version
        # would hold the critic back for hundreds of updates.
        old_values_B=None,
        clip=knobs.ppo_clip,
        vf_coef=knobs.vf_coef,
        ent_coef=knobs.ent_coef,
        std_floor=exploration_floor(job),
        epochs=knobs.ppo_epochs,
        mask_B_H=mask,
        policy_coef=0.0 if module.version <= warmup else 1.0,
        target_kl=extra_number(job, "target_kl", 0.0, 1.0),
    )


def train_item(
    job: TrainingJob,
    module: TenantModule,
    schema: FeatureSchema,
    data: dict[str, Any],
    *,
    ppo: bool,
    knobs: StepKnobs,
) -> TrainItem:
    """The item of one tenant's step. A PPO job's batch is staged on ``module``
    (``TenantModule.stage_ppo``; the loop clears it after the step, run or not);
    another RL job weighs its rows by exp(A/beta); SFT rows weigh the same."""
    batch: FeatureBatch = canonicalize_request(
        schema,
        {s: data[image_field(s)] for s in schema.camera_slots},
        job.metadata.extra.get("instruction", ""),
        data[STATE_FIELD],
    )
    target = torch.from_numpy(np.ascontiguousarray(data[ACTIONS_FIELD], dtype=np.float32))
    if target.ndim == 2:  # per-step actions: a chunk of one
        target = target[:, None, :]
    weight = None
    if ppo:
        module.stage_ppo(ppo_batch(job, module, data, target.shape[1], knobs))
    elif job.task_type == "rl":
        weight = torch.from_numpy(awr_weights(data[ADVANTAGES_FIELD].reshape(-1), beta=knobs.awr_beta))
    return TrainItem(tenant=module, batch=batch, target=target, weight_B=weight)
