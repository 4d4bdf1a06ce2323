"""Several tenants' heads of one architecture decoded in one batched call.

On the CPU a small head's act costs its op calls, not its arithmetic: 16 requests of
8 tenants spent as long in their 8 head calls as in the shared backbone forward.
Heads of the same type and config (they differ only in weights) run here as ONE
set of batched matrix products over their stacked weights, ``[tenants, rows, ...]``
(the idea of multi-LoRA serving's grouped GEMM, Punica/S-LoRA, for whole heads):
the same functions as each head's own ``act``, to float rounding. Stacked weights
are kept (LRU, bounded in bytes) and used again while every tensor stacked is the
same object at the same version (``Tensor._version`` counts in-place writes), so a
head trained or reloaded in place is read as it is now. Heads without a stacked
form here go on alone. The cache is shared by the engines of a process (an
``EnginePool``'s forward threads), under a lock.
See docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from joynexus.agents.models.heads.base import NORM_CLIP, ActionHead, time_embedding
from joynexus.agents.models.heads.flow import FlowMatchingHead
from joynexus.agents.models.heads.gaussian import OFTMLPHead
from joynexus.schemas.errors import ShapeMismatch

__all__ = ["arch_key", "stackable", "stacked_act"]


def arch_key(head: ActionHead) -> tuple[object, ...]:
    """Heads with equal keys can be stacked: the same class and the same sizes (what
    their ``act`` computes with; the seed, loss and initial std play no part in it)."""
    c = head.cfg
    return (type(head), c.feature_dim, c.state_dim, c.action_dim, c.action_horizon, c.hidden,
            c.flow_steps)


def stackable(head: ActionHead) -> bool:
    return type(head) in (OFTMLPHead, FlowMatchingHead)


#: Stacked weights kept for reuse, by the stacked tensors' ids: (those tensors, their
#: versions, the stack). At most CACHE_BYTES of stacks (least recently used go first).
_cache: OrderedDict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], tuple[int, ...], torch.Tensor]] = (
    OrderedDict()
)
_cache_bytes = 0
_cache_lock = threading.Lock()
CACHE_BYTES = 32 * 2**20


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    global _cache_bytes
    key = tuple(id(t) for t in tensors)
    versions = tuple(t._version for t in tensors)
    with _cache_lock:
        hit = _cache.get(key)  # the entry holds its tensors, so no other can have their ids
        if hit is not None and hit[1] == versions:
            _cache.move_to_end(key)
            return hit[2]
    out = torch.stack([t.detach() for t in tensors])
    with _cache_lock:
        old = _cache.pop(key, None)
        if old is not None:
            _cache_bytes -= old[2].nbytes
        _cache[key] = (tuple(tensors), versions, out)
        _cache_bytes += out.nbytes
        while _cache_bytes > CACHE_BYTES and len(_cache) > 1:
            _, (_, _, gone) = _cache.popitem(last=False)
            _cache_bytes -= gone.nbytes
    return out


def _pad(xs: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """``[T, rows, ...]``: each tenant's rows, zero rows after them."""
    out = xs[0].new_zeros((len(xs), rows, *xs[0].shape[1:]))
    for i, x in enumerate(xs):
        out[i, : x.shape[0]] = x
    return out


def _layer_norm(norms: Sequence[nn.LayerNorm], x_T_R_D: torch.Tensor) -> torch.Tensor:
    d = x_T_R_D.shape[-1]
    y = F.layer_norm(x_T_R_D, (d,), eps=norms[0].eps)
    return y * _stack([n.weight for n in norms])[:, None] + _stack([n.bias for n in norms])[:, None]


def _norm_state(heads: Sequence[ActionHead], s_T_R_S: torch.Tensor) -> torch.Tensor:
    mean = _stack([h.state_mean for h in heads])[:, None]
    std = _stack([h.state_std for h in heads])[:, None]
    return ((s_T_R_S - mean) / std).clamp(-NORM_CLIP, NORM_CLIP)


def _denorm(heads: Sequence[ActionHead], z_T_R_H_A: torch.Tensor) -> torch.Tensor:
    std = _stack([h.action_std for h in heads])[:, None, None]
    mean = _stack([h.action_mean for h in heads])[:, None, None]
    return z_T_R_H_A * std + mean


#: A layer of a stacked MLP: a linear's stacked (weight [T, in, out], bias [T, 1, out] or
#: None), or a GELU's ``approximate``.
Layer = tuple[torch.Tensor, torch.Tensor | None] | str


def _linear_of(layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    w_T_I_O = _stack([lin.weight for lin in layers]).transpose(1, 2)
    b = None if layers[0].bias is None else _stack([lin.bias for lin in layers])[:, None]
    return w_T_I_O, b


def _apply(layer: tuple[torch.Tensor, torch.Tensor | None], x_T_R_I: torch.Tensor) -> torch.Tensor:
    w, b = layer
    return torch.bmm(x_T_R_I, w) if b is None else torch.baddbmm(b, x_T_R_I, w)


def _mlp_of(nets: Sequence[nn.Sequential], start: int = 0) -> list[Layer]:
    """``heads.mlp_layers`` (Linear, GELU, Linear, GELU, Linear) from layer ``start`` on,
    stacked once per call (a flow head runs it once per step)."""
    out: list[Layer] = []
    for i, layer in enumerate(nets[0]):
        if i < start:
            continue
        if isinstance(layer, nn.Linear):
            out.append(_linear_of([n[i] for n in nets]))  # type: ignore[misc]
        elif isinstance(layer, nn.GELU):
            out.append(layer.approximate)
        else:
            raise TypeError(f"no stacked form for {type(layer).__name__}")
    return out


def _run(layers: Sequence[Layer], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = F.gelu(x, approximate=layer) if isinstance(layer, str) else _apply(layer, x)
    return x


def _oft(heads: Sequence[OFTMLPHead], f: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    x = torch.cat([_layer_norm([h.norm for h in heads], f), _norm_state(heads, s)], dim=-1)
    c = heads[0].cfg
    z = _run(_mlp_of([h.net for h in heads]), x).view(len(heads), -1, c.action_horizon, c.action_dim)
    return _denorm(heads, z)


def _flow(heads: Sequence[FlowMatchingHead], f: torch.Tensor, s: torch.Tensor,
          noise_T_R_N: torch.Tensor) -> torch.Tensor:
    """``FlowMatchingHead.act``'s Euler loop, its first layer split the same way."""
    c = heads[0].cfg
    t = len(heads)
    x_in = torch.cat([_layer_norm([h.norm for h in heads], f), _norm_state(heads, s)], dim=-1)
    cond = _apply(_linear_of([h.cond for h in heads]), x_in)
    n_act, n = noise_T_R_N.shape[-1], c.flow_steps
    dt = 1.0 / n
    first: list[nn.Linear] = [h.net[0] for h in heads]  # type: ignore[misc]
    w = _stack([lin.weight for lin in first])  # [T, H, N + C + t_dim]
    w_x, w_c, w_t = w.split([n_act, cond.shape[-1], heads[0].t_dim], dim=2)
    t_K = torch.arange(n, dtype=f.dtype) * dt
    temb_T_K_E = time_embedding(t_K, heads[0].t_dim).expand(t, -1, -1)
    t_part = torch.bmm(temb_T_K_E, w_t.transpose(1, 2))  # [T, K, H]
    c_part = torch.baddbmm(_stack([lin.bias for lin in first])[:, None], cond, w_c.transpose(1, 2))
    rest = _mlp_of([h.net for h in heads], start=1)
    w_x_T_I_H = w_x.transpose(1, 2)
    x = noise_T_R_N
    for k in range(n):
        h = torch.bmm(x, w_x_T_I_H) + c_part + t_part[:, k : k + 1]
        x = x + dt * _run(rest, h)
    return _denorm(heads, x.view(t, -1, c.action_horizon, c.action_dim))


@torch.no_grad()
def stacked_act(
    heads: Sequence[ActionHead],
    feats: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    noises: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Each head's ``act(feats[i], states[i], noise=noises[i])`` in one batched call.

    The heads share :func:`arch_key` and are :func:`stackable`; a flow head without
    noise draws it from its own generator, as its ``act`` would. Raises on anything
    else (the caller decodes them one by one)."""
    if not heads or len({arch_key(h) for h in heads}) != 1 or not stackable(heads[0]):
        raise ValueError("stacked_act: give heads of one stackable architecture")
    c = heads[0].cfg
    for h, x, st in zip(heads, feats, states, strict=True):
        h._check(x, st)
    rows = [int(x.shape[0]) for x in feats]
    r = max(rows)
    f, s = _pad(feats, r), _pad(states, r)
    if isinstance(heads[0], OFTMLPHead):
        out = _oft(heads, f, s)  # type: ignore[arg-type]
    else:
        drawn = []
        for h, b, nz in zip(heads, rows, noises or [None] * len(heads), strict=True):
            shape = (b, c.action_horizon, c.action_dim)
            if nz is None:
                nz = torch.randn(shape, generator=h.generator)
            elif tuple(nz.shape) != shape:
                raise ShapeMismatch(f"noise: expected {list(shape)}, got {list(nz.shape)}")
            drawn.append(nz.reshape(b, -1).to(f))
        out = _flow(heads, f, s, _pad(drawn, r))  # type: ignore[arg-type]
    return [out[i, :b] for i, b in enumerate(rows)]
