"""Group execution: one shared backbone forward for several tenants.

Compatible rows of different tenants run through the frozen backbone ONCE
(``grouped_forward``, ``grouped_train_step``), the features are split back by
slices, and each tenant's own head decodes or takes its own loss, backward and
AdamW step. Nothing is averaged across tenants, so a tenant's loss curve is
the one it would have alone (``serial_forward`` and ``serial_train_step`` are
the references; the tests hold the tolerance). ``isolated_train_step`` turns
whatever goes wrong with one tenant's item into that item's error
(``InvalidSpec`` unless it is one of ours already), its module untouched,
while the others still step.

See docs/ARCHITECTURE.md, "Policies that learn" (``features_for``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.features import FeatureBatch, TokenFeatures, concat_batches
from joynexus.agents.models.heads.base import ActionHead
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.schemas.errors import InvalidSpec, JoyNexusError

__all__ = [
    "ActRequest",
    "TrainItem",
    "encode_for",
    "features_for",
    "for_base",
    "grouped_forward",
    "grouped_train_step",
    "isolated_train_step",
    "needs_tokens",
    "plan_groups",
    "serial_forward",
    "serial_train_step",
    "shared_features",
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


def _head(head: ActionHead | TenantModule) -> ActionHead:
    return head.head if isinstance(head, TenantModule) else head


def features_for(head: ActionHead | TenantModule, feats: TokenFeatures) -> torch.Tensor:
    """What ``head`` reads of one forward's features: ``feats_B_D`` for a pooled head,
    the packed tokens ``[B, L, D + 1]`` for a token head."""
    kind = _head(head).reads
    if kind == "pooled":
        return feats.pooled()
    if kind == "tokens":
        return feats.tokens()
    raise InvalidSpec(f"head {type(_head(head)).__name__} reads {kind!r}: heads read 'pooled' or 'tokens'")


def needs_tokens(heads: Sequence[ActionHead | TenantModule]) -> bool:
    """Whether a forward for these heads must keep the token features."""
    return any(_head(h).reads == "tokens" for h in heads)


def for_base(backbone: Backbone, batch: FeatureBatch, head: ActionHead | TenantModule) -> FeatureBatch:
    """``batch`` with what ``backbone`` reads of the state in its prompt, if it reads it
    (``reads_state``: the π0.5 base), from the tenant's own normaliser; else ``batch``."""
    if not getattr(backbone, "reads_state", False) or batch.prefix_state_B_S is not None:
        return batch
    return replace(batch, prefix_state_B_S=_head(head).prefix_state(batch.state_B_S))


def encode_for(backbone: Backbone, batch: FeatureBatch, head: ActionHead | TenantModule) -> torch.Tensor:
    """One forward of ``batch`` alone, as ``head`` reads it (the serial reference path)."""
    return features_for(head, backbone.encode_tokens(for_base(backbone, batch, head), tokens=needs_tokens([head])))


def _decode(req: ActRequest, x: torch.Tensor) -> torch.Tensor:
    kw = {} if req.noise is None else {"noise": req.noise}
    return req.tenant.act(x, req.batch.state_B_S.to(x.device), **kw)


def _check_tenants(tenants: Sequence[TenantModule]) -> None:
    ids = [id(t) for t in tenants]
    if len(set(ids)) != len(ids):
        raise InvalidSpec("the same TenantModule appears twice in one group; merge its batches first")


def grouped_forward(backbone: Backbone, requests: Sequence[ActRequest]) -> list[torch.Tensor]:
    """ONE backbone forward over all requests' rows, then per-tenant decode.

    Raises ``IncompatibleBatches`` if the requests cannot share a forward (use
    ``plan_groups`` to split them first).
    """
    shared = concat_batches([for_base(backbone, r.batch, r.tenant) for r in requests])
    feats = backbone.encode_tokens(shared, tokens=needs_tokens([r.tenant for r in requests]))
    return [
        _decode(r, features_for(r.tenant, f)) for r, f in zip(requests, feats.split(shared.slices), strict=True)
    ]


def serial_forward(backbone: Backbone, requests: Sequence[ActRequest]) -> list[torch.Tensor]:
    """Reference path: one backbone forward per request."""
    return [_decode(r, encode_for(backbone, r.batch, r.tenant)) for r in requests]


def grouped_train_step(backbone: Backbone, items: Sequence[TrainItem]) -> list[float]:
    """One shared frozen forward, then each tenant's own loss/backward/step. Returns per-tenant losses."""
    _check_tenants([it.tenant for it in items])
    shared = concat_batches([for_base(backbone, it.batch, it.tenant) for it in items])
    # frozen: computed without grad
    feats = backbone.encode_tokens(shared, tokens=needs_tokens([it.tenant for it in items]))
    losses = []
    for it, part in zip(items, feats.split(shared.slices), strict=True):
        # detach(): each tenant's graph starts at its own slice of the shared features.
        f = features_for(it.tenant, part).detach()
        losses.append(
            it.tenant.train_step(f, it.batch.state_B_S.to(f.device), it.target.to(f.device), it.weight_B)
        )
    return losses


def isolated_train_step(
    backbone: Backbone, items: Sequence[TrainItem],
    features: Sequence[torch.Tensor | JoyNexusError] | None = None,
) -> list[float | JoyNexusError]:
    """``grouped_train_step`` that never lets one item stop the others.

    Per item: its loss, or the ``JoyNexusError`` (``InvalidSpec`` for anything
    that is not one already) that kept it from stepping; such an item's
    module, optimizer and version are unchanged (``TenantModule.train_step`` is
    all or nothing). If the shared backbone forward fails, each item gets a
    forward of its own, so only the items whose own forward fails are lost.
    ``features``: the items' features from a forward the caller shared with
    other work (``shared_features``; a training client's calls).
    """
    _check_tenants([it.tenant for it in items])
    out: list[float | JoyNexusError] = []
    feats = shared_features(backbone, items) if features is None else features
    for it, f in zip(items, feats, strict=True):
        if isinstance(f, JoyNexusError):
            out.append(f)
            continue
        try:
            out.append(
                it.tenant.train_step(f.detach(), it.batch.state_B_S.to(f.device), it.target.to(f.device), it.weight_B)
            )
        except Exception as e:  # one tenant's step must not stop the group
            out.append(_as_error(e, it, "training step"))
    return out


def _as_error(e: Exception, it: TrainItem, what: str) -> JoyNexusError:
    if isinstance(e, JoyNexusError):
        return e
    return InvalidSpec(
        f"tenant {it.tenant.tenant}: its {what} raised {type(e).__name__}: {e} "
        f"(batch of {it.batch.batch_size} rows); no step taken"
    )


def shared_features(backbone: Backbone, items: Sequence[TrainItem]) -> list[torch.Tensor | JoyNexusError]:
    """Each item's backbone features (as its head reads them) from one shared forward,
    or (if that fails) from a forward of its own; an item whose own forward fails gets
    the error."""
    try:
        shared = concat_batches([for_base(backbone, it.batch, it.tenant) for it in items])
        feats = backbone.encode_tokens(shared, tokens=needs_tokens([it.tenant for it in items]))
        return [features_for(it.tenant, f) for it, f in zip(items, feats.split(shared.slices), strict=True)]
    except Exception as e:  # find the item that spoils it, alone
        _release_memory()
        if len(items) == 1:
            return [_as_error(e, items[0], "backbone forward")]
    out: list[torch.Tensor | JoyNexusError] = []
    for it in items:
        try:
            out.append(encode_for(backbone, it.batch, it.tenant))
        except Exception as e:  # that item alone fails
            _release_memory()
            out.append(_as_error(e, it, "backbone forward"))
    return out


def _release_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def serial_train_step(backbone: Backbone, items: Sequence[TrainItem]) -> list[float]:
    """Reference path: a backbone forward and a step per tenant."""
    _check_tenants([it.tenant for it in items])
    return [
        it.tenant.train_step(f, it.batch.state_B_S.to(f.device), it.target.to(f.device), it.weight_B)
        for it in items
        for f in (encode_for(backbone, it.batch, it.tenant),)
    ]
