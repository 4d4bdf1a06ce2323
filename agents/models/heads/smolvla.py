"""``smolvla_expert``: SmolVLA's action expert as a tenant head over a shared prefix cache.

The resident SmolVLA base (``agents.models.smolvla_base``) gives each row its prefix's
per-layer keys and values once, under no grad, for every tenant of a group; this head is
one tenant's own expert: Llama layers of its own width (``hidden``; LeRobot's
``expert_width_multiplier`` x the VLM's width), as deep as the base's kept layers, with the
VLM's query/key-value heads and head size. Every ``self_attn_every_n_layers``-th layer
self-attends: its action tokens' keys and values (RoPE at positions after the prefix)
join the prefix's, causal among the actions; the other layers cross-attend: their own
``k_proj``/``v_proj`` map the prefix's cached keys and values (queries with RoPE from 0).
It is LeRobot's ``VLAFlowMatching`` expert path (``embed_suffix``: the action and the
flow time's sine embedding through ``action_time_mlp_in``/``_out``; ``denoise_step``;
``sample_actions``: ``CacheExpertHead``), flow matching with ``x_t = t * noise + (1 - t) * actions`` and target
``noise - actions``, time ~ Beta(1.5, 1) scaled into [0.001, 1]; the loss is the mean over
the real action dims (LeRobot also averages its zero-padded ones). Parameters are named
as LeRobot's (``smolvla_lerobot_keys``); actions are padded to ``MAX_ACTION_DIM`` inside.

See docs/ARCHITECTURE.md, "Model families: the SmolVLA base".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from joynexus.agents.models.features import unpack_tokens
from joynexus.agents.models.heads import base
from joynexus.agents.models.heads.expert import MAX_ACTION_DIM, CacheExpertHead, sinusoidal_time
from joynexus.agents.models.smolvla_base import eager_attention, smolvla_rope
from joynexus.agents.models.smolvla_config import cache_geometry, expert_intermediate
from joynexus.schemas.errors import InvalidSpec

__all__ = ["EXPERT_PREFIX", "PROJECTIONS", "SmolVLAExpertHead", "smolvla_expert_from_lerobot", "smolvla_lerobot_keys"]

#: LeRobot's names: the expert under ``model.vlm_with_expert.lm_expert``, the rest under ``model``.
EXPERT_PREFIX = "model.vlm_with_expert.lm_expert."
PROJECTIONS = ("action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")


class RMSNorm(nn.Module):
    """Llama's RMSNorm (float32 inside, ``weight * x``)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class ExpertAttention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, kv_in: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kv_in, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(kv_in, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)


class ExpertMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        inter = expert_intermediate(width)
        self.gate_proj = nn.Linear(width, inter, bias=False)
        self.up_proj = nn.Linear(width, inter, bias=False)
        self.down_proj = nn.Linear(inter, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertLayer(nn.Module):
    def __init__(self, width: int, g: dict[str, Any], cross: bool) -> None:
        super().__init__()
        self.cross = cross
        kv_in = g["kv_heads"] * g["head_dim"] if cross else width
        self.input_layernorm = RMSNorm(width, g["eps"])
        self.self_attn = ExpertAttention(width, g["heads"], g["kv_heads"], g["head_dim"], kv_in)
        self.post_attention_layernorm = RMSNorm(width, g["eps"])
        self.mlp = ExpertMLP(width)


class Expert(nn.Module):
    def __init__(self, width: int, depth: int, g: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ExpertLayer(width, g, cross=i % g["every_n"] != 0) for i in range(depth))
        self.norm = RMSNorm(width, g["eps"])


@base.register("smolvla_expert")
class SmolVLAExpertHead(CacheExpertHead):
    """One tenant's SmolVLA action expert; reads the prefix cache as packed token features
    (``loss`` and ``act``: ``CacheExpertHead``'s flow matching)."""

    def __init__(self, cfg: base.HeadConfig) -> None:
        super().__init__(cfg)
        self.geometry = cache_geometry(cfg.feature_dim, cfg.kv_layers)
        w = cfg.hidden
        self.lm_expert = Expert(w, cfg.kv_layers, self.geometry)
        self.action_in_proj = nn.Linear(MAX_ACTION_DIM, w)
        self.action_out_proj = nn.Linear(w, MAX_ACTION_DIM)
        self.action_time_mlp_in = nn.Linear(2 * w, w)
        self.action_time_mlp_out = nn.Linear(w, w)

    @torch.no_grad()
    def prefix_state(self, state_B_S: torch.Tensor) -> torch.Tensor:
        """The state as SmolVLA's ``state_proj`` takes it: LeRobot's mean/std normalisation
        (clipped to +-``NORM_CLIP`` standard deviations)."""
        return self.norm_state(state_B_S)

    # -- the expert ------------------------------------------------------------------
    def _cache(self, feats_B_L_C: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Per-layer (keys, values) ``[B, L, kv_heads, head_dim]`` and the real-token mask."""
        kv_B_L_C, real_B_L = unpack_tokens(feats_B_L_C, self.cfg.feature_dim, "smolvla_expert")
        b, L, _ = kv_B_L_C.shape
        g = self.geometry
        per = kv_B_L_C.view(b, L, self.cfg.kv_layers, 2, g["kv_heads"], g["head_dim"]).permute(2, 3, 0, 1, 4, 5)
        return [(per[i, 0], per[i, 1]) for i in range(self.cfg.kv_layers)], real_B_L

    def velocity(self, cache: list[tuple[torch.Tensor, torch.Tensor]], real_B_L: torch.Tensor,
                 x_B_H_M: torch.Tensor, t_B: torch.Tensor, state_B_S: torch.Tensor | None = None) -> torch.Tensor:
        """LeRobot's ``denoise_step``: the expert's velocity ``[B, H, MAX_ACTION_DIM]`` at time ``t``
        (``state_B_S`` is always None: SmolVLA's state is a prefix token, in the cache)."""
        b, h, _ = x_B_H_M.shape
        g = self.geometry
        emb = self.action_in_proj(x_B_H_M)
        te = sinusoidal_time(t_B, self.cfg.hidden).to(emb.dtype)[:, None, :].expand_as(emb)
        x = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([emb, te], 2))))
        dev = x.device
        steps = torch.arange(h, device=dev)[None, :].expand(b, -1)
        pos_self = real_B_L.sum(1, keepdim=True) + steps  # after the prefix's real tokens
        causal = torch.ones(h, h, dtype=torch.bool, device=dev).tril()[None].expand(b, -1, -1)
        keep_cross = real_B_L[:, None, :].expand(-1, h, -1)
        keep_self = torch.cat([keep_cross, causal], 2)
        for layer, (pk, pv) in zip(self.lm_expert.layers, cache, strict=True):
            assert isinstance(layer, ExpertLayer)
            att = layer.self_attn
            hs = layer.input_layernorm(x)
            q = att.q_proj(hs).view(b, h, -1, g["head_dim"])
            if layer.cross:
                L = pk.shape[1]
                k = att.k_proj(pk.to(hs.dtype).reshape(b, L, -1)).view(b, L, -1, g["head_dim"])
                v = att.v_proj(pv.to(hs.dtype).reshape(b, L, -1)).view(b, L, -1, g["head_dim"])
                o = eager_attention(smolvla_rope(q, steps), k, v, keep_cross)
            else:
                k = smolvla_rope(att.k_proj(hs).view(b, h, -1, g["head_dim"]), pos_self)
                v = att.v_proj(hs).view(b, h, -1, g["head_dim"])
                keys, vals = torch.cat([pk.to(k.dtype), k], 1), torch.cat([pv.to(v.dtype), v], 1)
                o = eager_attention(smolvla_rope(q, pos_self), keys, vals, keep_self)
            x = x + att.o_proj(o.to(att.o_proj.weight.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.action_out_proj(self.lm_expert.norm(x).to(torch.float32))


def smolvla_lerobot_keys(head_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This head's weights under the names of LeRobot's ``SmolVLAPolicy`` state dict."""
    out = {}
    for k, v in head_state.items():
        if k.startswith("lm_expert."):
            out[EXPERT_PREFIX + k[len("lm_expert."):]] = v
        elif k.split(".")[0] in PROJECTIONS:
            out["model." + k] = v
    return out


def smolvla_expert_from_lerobot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The expert's weights of a LeRobot ``SmolVLAPolicy`` state dict (``model.safetensors`` as
    its ``save_pretrained`` writes it) under this head's names: what a tenant's head loads to
    start from a LeRobot checkpoint (the normalisation buffers stay the head's own)."""
    out = {}
    for k, v in state.items():
        if k.startswith(EXPERT_PREFIX) and "lm_head" not in k and "embed_tokens" not in k:
            out["lm_expert." + k[len(EXPERT_PREFIX):]] = v
        elif k.startswith("model.") and k.split(".")[1] in PROJECTIONS:
            out[k[len("model."):]] = v
    if not out:
        raise InvalidSpec("no SmolVLA action expert in this state dict: expected LeRobot SmolVLAPolicy names "
                          "(model.vlm_with_expert.lm_expert.*, model.action_in_proj.*)")
    return out
