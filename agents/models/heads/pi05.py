"""``pi05_expert``: π0.5's action expert as a tenant head over a shared prefix cache.

The resident π0.5 base (``agents.models.pi05_base``) gives each row its prefix's
per-layer keys and values once, under no grad, for every tenant of a group; this head
is one tenant's own Gemma expert (as deep as the base, 8 query heads and 1 key/value
head of the base's head size, adaptive RMSNorm conditioned on the flow time) whose
action tokens attend to those keys and values and to each other. It is LeRobot's
``PI05Pytorch`` expert path (``embed_suffix``, ``denoise_step``, ``sample_actions``,
flow matching with ``x_t = t * noise + (1 - t) * actions`` and target ``noise - actions``,
time ~ Beta(1.5, 1) scaled into [0.001, 1]), its parameters named as LeRobot's
(``pi05_lerobot_keys``), actions padded to ``MAX_ACTION_DIM`` inside; the loss and the
sampling loop are ``heads/expert.CacheExpertHead``'s, shared with ``smolvla_expert``.

``HeadConfig.expert_state="token"`` adds LeRobot π0's state token (its ``embed_suffix``):
``state_proj`` maps the normalised state to ONE suffix token before the action tokens,
the state token attending to the prefix and itself, the actions to the prefix, the
state token and each other. The prompt keeps its digits; the token gives the expert the
continuous state, which a frozen random base's digits do not carry to it. LeRobot's
``PI05Policy`` has no such input, so a token head has no LeRobot names (``pi05_lerobot_keys``
refuses it).

See docs/ARCHITECTURE.md, "Model families: the π0.5 base".
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from joynexus.agents.models.features import unpack_tokens
from joynexus.agents.models.heads import base
from joynexus.agents.models.heads.expert import MAX_ACTION_DIM, CacheExpertHead, sinusoidal_time
from joynexus.agents.models.pi05_base import MASK_VALUE, apply_rope, rope_cos_sin
from joynexus.schemas.errors import InvalidSpec

__all__ = ["EXPERT_HEADS", "Pi05ExpertHead", "expert_from_lerobot", "pi05_lerobot_keys"]

#: LeRobot's expert attention layout (its joint forward reshapes to 8 heads).
EXPERT_HEADS = 8


class AdaRMSNorm(nn.Module):
    """openpi's adaptive RMSNorm: scale, shift and a residual gate from the time condition."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(width, 3 * width)
        nn.init.zeros_(self.dense.weight)

    def forward(self, x: torch.Tensor, cond_B_W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
        normed = x * torch.rsqrt(var + self.eps)
        scale, shift, gate = self.dense(cond_B_W)[:, None, :].chunk(3, dim=-1)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


class ExpertAttention(nn.Module):
    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(width, EXPERT_HEADS * head_dim, bias=False)
        self.k_proj = nn.Linear(width, head_dim, bias=False)
        self.v_proj = nn.Linear(width, head_dim, bias=False)
        self.o_proj = nn.Linear(EXPERT_HEADS * head_dim, width, bias=False)


class ExpertMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, 4 * width, bias=False)
        self.up_proj = nn.Linear(width, 4 * width, bias=False)
        self.down_proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class ExpertLayer(nn.Module):
    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.input_layernorm = AdaRMSNorm(width)
        self.self_attn = ExpertAttention(width, head_dim)
        self.post_attention_layernorm = AdaRMSNorm(width)
        self.mlp = ExpertMLP(width)


class Expert(nn.Module):
    def __init__(self, width: int, depth: int, head_dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ExpertLayer(width, head_dim) for _ in range(depth))
        self.norm = AdaRMSNorm(width)


@base.register("pi05_expert")
class Pi05ExpertHead(CacheExpertHead):
    """One tenant's π0.5 action expert; reads the prefix cache as packed token features
    (``loss`` and ``act``: ``CacheExpertHead``'s flow matching, as ``PI05Pytorch``'s)."""

    state_token: ClassVar[bool] = True

    def __init__(self, cfg: base.HeadConfig) -> None:
        super().__init__(cfg)
        if cfg.kv_layers < 1 or cfg.feature_dim % (2 * cfg.kv_layers):
            raise InvalidSpec(
                f"pi05_expert: feature_dim={cfg.feature_dim} must be the π0.5 base's cache width "
                f"(kv_layers={cfg.kv_layers} x 2 x head_dim); build the head from the base's describe()"
            )
        self.head_dim = cfg.feature_dim // (2 * cfg.kv_layers)
        w = cfg.hidden
        self.expert = Expert(w, cfg.kv_layers, self.head_dim)
        self.action_in_proj = nn.Linear(MAX_ACTION_DIM, w)
        self.action_out_proj = nn.Linear(w, MAX_ACTION_DIM)
        self.time_mlp_in = nn.Linear(w, w)
        self.time_mlp_out = nn.Linear(w, w)
        # Built last: the other weights are the same draws with or without it (seeded builds).
        self.state_proj = nn.Linear(cfg.state_dim, w) if cfg.expert_state == "token" else None

    # -- the expert ------------------------------------------------------------------
    def _cache(self, feats_B_L_C: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Per-layer (keys, values) ``[B, 1, L, hd]`` and the real-token mask of packed features."""
        kv_B_L_C, real_B_L = unpack_tokens(feats_B_L_C, self.cfg.feature_dim, "pi05_expert")
        b, L, _ = kv_B_L_C.shape
        per = kv_B_L_C.view(b, L, self.cfg.kv_layers, 2, 1, self.head_dim).permute(2, 3, 0, 4, 1, 5)
        return [(per[i, 0], per[i, 1]) for i in range(self.cfg.kv_layers)], real_B_L

    def _suffix_state(self, state_B_S: torch.Tensor) -> torch.Tensor | None:
        """The state the suffix token reads (normalised, as LeRobot's normaliser gives π0 its
        state), or None for a prompt-only head."""
        return None if self.state_proj is None else self.norm_state(state_B_S)

    def velocity(self, cache: list[tuple[torch.Tensor, torch.Tensor]], real_B_L: torch.Tensor,
                 x_B_H_M: torch.Tensor, t_B: torch.Tensor, state_B_S: torch.Tensor | None = None) -> torch.Tensor:
        """LeRobot's ``denoise_step``: the expert's velocity ``[B, H, MAX_ACTION_DIM]`` at time ``t``;
        with ``state_B_S`` (normalised; token heads) π0's state token leads the suffix."""
        b, h, _ = x_B_H_M.shape
        w = self.cfg.hidden
        cond = sinusoidal_time(t_B, w)
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(cond))))
        x = self.action_in_proj(x_B_H_M)
        n = h
        dev = x.device
        if state_B_S is not None and self.state_proj is not None:
            x = torch.cat([self.state_proj(state_B_S.to(x.dtype))[:, None, :], x], 1)
            n = h + 1
        pos = real_B_L.sum(1, keepdim=True) + torch.arange(n, device=dev)[None, :]
        cos, sin = rope_cos_sin(pos, self.head_dim)
        if n == h:  # actions only: every suffix token sees the prefix and every action
            keep = torch.cat([real_B_L, torch.ones(b, h, dtype=torch.bool, device=dev)], 1)[:, None, None, :]
        else:  # π0's blocks: the state token sees the prefix and itself, the actions see everything
            suffix = torch.ones(n, n, dtype=torch.bool, device=dev)
            suffix[0, 1:] = False
            keep = torch.cat([real_B_L[:, None, :].expand(b, n, -1), suffix[None].expand(b, -1, -1)], 2)[:, None]
        mask = torch.where(keep, 0.0, MASK_VALUE).to(x.dtype)
        for layer, (pk, pv) in zip(self.expert.layers, cache, strict=True):
            assert isinstance(layer, ExpertLayer)
            att = layer.self_attn
            hs, gate = layer.input_layernorm(x, cond)
            q = apply_rope(att.q_proj(hs).view(b, n, EXPERT_HEADS, -1).transpose(1, 2), cos, sin)
            k = apply_rope(att.k_proj(hs).view(b, n, 1, -1).transpose(1, 2), cos, sin)
            v = att.v_proj(hs).view(b, n, 1, -1).transpose(1, 2)
            keys = torch.cat([pk.to(k.dtype), k], 2).expand(-1, EXPERT_HEADS, -1, -1)
            vals = torch.cat([pv.to(v.dtype), v], 2).expand(-1, EXPERT_HEADS, -1, -1)
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=self.head_dim**-0.5)
            x = x + att.o_proj(o.transpose(1, 2).reshape(b, n, -1)) * gate
            hs, gate = layer.post_attention_layernorm(x, cond)
            x = x + layer.mlp(hs) * gate
        out, _ = self.expert.norm(x[:, n - h:], cond)
        return self.action_out_proj(out.float())


def pi05_lerobot_keys(head_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This head's weights under the names of LeRobot's ``PI05Policy`` state dict (a token
    head's have none: ``PI05Policy`` has no continuous state input, so it is refused)."""
    if any(k.startswith("state_proj.") for k in head_state):
        raise InvalidSpec("this pi05_expert reads the state as a suffix token (expert_state='token'): "
                          "LeRobot's PI05Policy has no such input, so its weights have no PI05Policy names")
    out = {}
    for k, v in head_state.items():
        if k.startswith("expert."):
            out["model.paligemma_with_expert.gemma_expert.model." + k[len("expert."):]] = v
        elif k.split(".")[0] in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
            out["model." + k] = v
    return out


def expert_from_lerobot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The expert's weights of a LeRobot ``PI05Policy`` state dict (``model.safetensors`` as its
    ``save_pretrained`` writes it) under this head's names: what a tenant's head loads to start
    from a LeRobot checkpoint (the normalisation buffers stay the head's own)."""
    expert = "model.paligemma_with_expert.gemma_expert.model."
    out = {}
    for k, v in state.items():
        if k.startswith(expert) and not k.startswith(expert + "embed_tokens"):
            out["expert." + k[len(expert):]] = v
        elif k.startswith("model.") and k.split(".")[1] in ("action_in_proj", "action_out_proj", "time_mlp_in",
                                                             "time_mlp_out"):
            out[k[len("model."):]] = v
    if not out:
        raise InvalidSpec("no π0.5 action expert in this state dict: expected LeRobot PI05Policy names "
                          "(model.paligemma_with_expert.gemma_expert.*, model.action_in_proj.*)")
    return out
