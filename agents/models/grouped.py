"""Group execution: one shared backbone forward for several tenants.

Inference (``grouped_forward``): compatible requests of different tenants are
laid end to end, the frozen backbone runs ONCE over all rows, the features are
split back by recorded slices and each tenant's head decodes its own rows.
``serial_forward`` is the reference: one backbone forward per tenant.

Training (``grouped_train_step``): one shared backbone forward without grad,
features split, then each tenant's private loss, backward and AdamW step on
that tenant's head only. Nothing is averaged or summed across tenants, so a
tenant's loss curve is the one it would have alone, up to the last bits that
batched matmuls may change (see tests for the tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.features import FeatureBatch, concat_batches, split_rows
from joynexus.agents.models.heads import TenantModule
from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "ActRequest",
    "TrainItem",
    "grouped_forward",
    "grouped_train_step",
    "plan_groups",
    "serial_forward",
    "serial_train_step",
]


@dataclass(frozen=True)
class ActRequest:
    """One tenant's inference request; ``noise`` pins flow-matching sampling."""

    tenant: TenantModule
    batch: FeatureBatch
    noise: torch.Tensor | None = None


@dataclass(frozen=True)
class TrainItem:
    """One tenant's training batch and target (actions [B, H, A], or returns [B] for value heads)."""

    tenant: TenantModule
    batch: FeatureBatch
    target: torch.Tensor
    #: Per-sample weights (e.g. advantage weights for RL); None = plain mean.
    weight_B: torch.Tensor | None = None


def plan_groups(batches: Sequence[FeatureBatch]) -> list[list[int]]:
    """Indices grouped by backbone key, in first-seen order (pure)."""
    groups: dict[str, list[int]] = {}
    for i, b in enumerate(batches):
        groups.setdefault(b.schema.backbone_key(), []).append(i)
    return list(groups.values())


def _decode(req: ActRequest, feats_B_D: torch.Tensor) -> torch.Tensor:
    kw = {} if req.noise is None else {"noise": req.noise}
    return req.tenant.act(feats_B_D, req.batch.state_B_S.to(feats_B_D.device), **kw)


def _check_tenants(tenants: Sequence[TenantModule]) -> None:
    ids = [id(t) for t in tenants]
    if len(set(ids)) != len(ids):
        raise InvalidSpec("the same TenantModule appears twice in one group; merge its batches first")


def grouped_forward(backbone: Backbone, requests: Sequence[ActRequest]) -> list[torch.Tensor]:
    """ONE backbone forward over all requests' rows, then per-tenant decode.

    Raises ``IncompatibleBatches`` if the requests cannot share a forward (use
    ``plan_groups`` to split them first).
    """
    shared = concat_batches([r.batch for r in requests])
    feats_N_D = backbone.encode(shared)
    return [_decode(r, f) for r, f in zip(requests, split_rows(feats_N_D, shared.slices), strict=True)]


def serial_forward(backbone: Backbone, requests: Sequence[ActRequest]) -> list[torch.Tensor]:
    """Reference path: one backbone forward per request."""
    return [_decode(r, backbone.encode(r.batch)) for r in requests]


def grouped_train_step(backbone: Backbone, items: Sequence[TrainItem]) -> list[float]:
    """One shared frozen forward, then each tenant's own loss/backward/step. Returns per-tenant losses."""
    _check_tenants([it.tenant for it in items])
    shared = concat_batches([it.batch for it in items])
    feats_N_D = backbone.encode(shared)  # frozen: computed without grad
    losses = []
    for it, f in zip(items, split_rows(feats_N_D, shared.slices), strict=True):
        # detach(): each tenant's graph starts at its own slice of the shared features.
        losses.append(
            it.tenant.train_step(f.detach(), it.batch.state_B_S.to(f.device), it.target.to(f.device), it.weight_B)
        )
    return losses


def serial_train_step(backbone: Backbone, items: Sequence[TrainItem]) -> list[float]:
    """Reference path: a backbone forward and a step per tenant."""
    _check_tenants([it.tenant for it in items])
    return [
        it.tenant.train_step(f, it.batch.state_B_S.to(f.device), it.target.to(f.device), it.weight_B)
        for it in items
        for f in (backbone.encode(it.batch),)
    ]
