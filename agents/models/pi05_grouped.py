"""Group execution on the π0.5 base: one prefix forward (the per-layer cache) for all
tenants' rows, then each tenant's own expert over its rows' caches.

The same contract as ``agents.models.grouped`` (which the Qwen base uses): nothing is
averaged across tenants, each tenant's step is its own ``TenantModule.train_step``, and
``serial_forward``/``serial_train_step`` (a prefix forward per tenant) are the references
the tests hold the grouped path to. The one difference: π0.5's prompt carries the state,
so each tenant's head first maps its rows' states into the prompt's [-1, 1]
(``prefix_state``); the forward is still one, under no grad, for every row.

See docs/ARCHITECTURE.md, "Model families: the π0.5 base".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from joynexus.agents.models.features import FeatureBatch, TokenFeatures, check_compatible
from joynexus.agents.models.grouped import ActRequest, TrainItem, features_for
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.pi05_base import Pi05Base
from joynexus.schemas.errors import InvalidSpec

__all__ = ["cache_bytes", "grouped_forward", "grouped_train_step", "serial_forward", "serial_train_step",
           "shared_features"]


def _prefix_state(tenant: TenantModule, batch: FeatureBatch) -> torch.Tensor:
    fn = getattr(tenant.head, "prefix_state", None)
    if fn is not None:
        return fn(batch.state_B_S)
    # A head that does not define it (a pooled or token head on this base): its own
    # normalised state, scaled the same way, is what its prompt carries.
    with torch.no_grad():
        return (tenant.head.norm_state(batch.state_B_S) / 3.0).clamp(-1.0, 1.0)


def shared_features(base: Pi05Base, parts: Sequence[tuple[TenantModule, FeatureBatch]]) -> list[TokenFeatures]:
    """ONE frozen prefix forward over every part's rows -> each part's cache, in order."""
    if not parts:
        raise InvalidSpec("nothing to group: give at least one batch")
    if len({id(t) for t, _ in parts}) != len(parts):
        raise InvalidSpec("the same TenantModule appears twice in one group; merge its batches first")
    check_compatible([b.schema for _, b in parts])
    inputs = base.concat_inputs([base.prepare(b, _prefix_state(t, b)) for t, b in parts])
    slices, start = [], 0
    for _, b in parts:
        slices.append(slice(start, start + b.batch_size))
        start += b.batch_size
    return base.features(inputs).split(slices)


def cache_bytes(feats: Sequence[TokenFeatures]) -> list[int]:
    """Bytes of each part's cache as its head receives it (float32 keys, values and mask)."""
    out = []
    for f in feats:
        assert f.h_B_L_D is not None
        b, L, c = f.h_B_L_D.shape
        out.append(int(b * L * (c + 1) * 4))
    return out


def _decode(req: ActRequest, f: TokenFeatures) -> torch.Tensor:
    x = features_for(req.tenant, f)
    kw = {} if req.noise is None else {"noise": req.noise}
    return req.tenant.act(x, req.batch.state_B_S.to(x.device), **kw)


def grouped_forward(base: Pi05Base, requests: Sequence[ActRequest]) -> list[torch.Tensor]:
    """One prefix forward for all requests, then each tenant's denoising over its rows."""
    feats = shared_features(base, [(r.tenant, r.batch) for r in requests])
    return [_decode(r, f) for r, f in zip(requests, feats, strict=True)]


def serial_forward(base: Pi05Base, requests: Sequence[ActRequest]) -> list[torch.Tensor]:
    """Reference: a prefix forward per request."""
    return [_decode(r, shared_features(base, [(r.tenant, r.batch)])[0]) for r in requests]


def _step(it: TrainItem, f: TokenFeatures) -> float:
    x = features_for(it.tenant, f).detach()
    return it.tenant.train_step(x, it.batch.state_B_S.to(x.device), it.target.to(x.device), it.weight_B)


def grouped_train_step(base: Pi05Base, items: Sequence[TrainItem]) -> list[float]:
    """One shared frozen prefix forward, then each tenant's own loss, backward and AdamW step."""
    feats = shared_features(base, [(it.tenant, it.batch) for it in items])
    return [_step(it, f) for it, f in zip(items, feats, strict=True)]


def serial_train_step(base: Pi05Base, items: Sequence[TrainItem]) -> list[float]:
    """Reference: a prefix forward and a step per tenant."""
    return [_step(it, shared_features(base, [(it.tenant, it.batch)])[0]) for it in items]
