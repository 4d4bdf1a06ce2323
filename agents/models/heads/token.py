"""Tenant heads that read token features (the paper's QwenOFT and QwenGR00T heads).

``oft_attn`` (action-placeholder queries cross-attending the tokens; a
:class:`GaussianPolicy`, so PPO applies) and ``gr00t_flow`` (flow matching
over action tokens; RL by advantage weights) read the packed token features
``[B, L, D + 1]`` and mask pads out of every attention, so a row's output does
not depend on the padding of the group it was batched with. Tokens are
projected to ``cfg.hidden`` first, keeping a head well under 1% of the bench
base. Importing ``joynexus.agents.models.heads`` registers both.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from joynexus.agents.models.features import unpack_tokens
from joynexus.agents.models.heads.base import (
    ActionHead,
    HeadConfig,
    mlp_layers,
    register,
    time_embedding,
    weighted_mean,
)
from joynexus.agents.models.heads.gaussian import GaussianPolicy
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = ["GR00TFlowHead", "OFTAttnHead", "TokenAttention"]


def _num_heads(width: int) -> int:
    """Attention heads for a width: 4 when it divides, else 2, else 1."""
    return next(n for n in (4, 2, 1) if width % n == 0)


class TokenAttention(nn.Module):
    """Multi-head attention of queries ``[B, Q, d]`` over a memory ``[B, L, d]``,
    keys where ``real_B_L`` is False left out (every row must have a real key).

    The keys have no bias: softmax ignores a shift shared by every key, so its
    gradient is zero up to rounding, which Adam would blow up into steps of noise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = _num_heads(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)

    def memory(self, mem_B_L_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, heads, L, d/heads]`` (computed once per memory)."""
        b, L, d = mem_B_L_d.shape
        k = self.k(mem_B_L_d).view(b, L, self.heads, d // self.heads).transpose(1, 2)
        v = self.v(mem_B_L_d).view(b, L, self.heads, d // self.heads).transpose(1, 2)
        return k, v

    def attend(self, x_B_Q_d: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
               real_B_L: torch.Tensor | None = None) -> torch.Tensor:
        b, q_len, d = x_B_Q_d.shape
        q = self.q(x_B_Q_d).view(b, q_len, self.heads, d // self.heads).transpose(1, 2)
        mask = None if real_B_L is None else real_B_L[:, None, None, :]
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)
        return self.o(o.transpose(1, 2).reshape(b, q_len, d))

    def forward(self, x_B_Q_d: torch.Tensor, mem_B_L_d: torch.Tensor,
                real_B_L: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(x_B_Q_d, self.memory(mem_B_L_d), real_B_L)


def _state_encoder(state_dim: int, width: int) -> nn.Sequential:
    """The normalised robot state -> the head's width (two layers, as GR00T's state encoder)."""
    return nn.Sequential(nn.Linear(state_dim, width), nn.GELU(), nn.Linear(width, width))


def _ffn(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


class _TokenReader(nn.Module):
    """LayerNorm + projection of the backbone's tokens to the head's width."""

    def __init__(self, feature_dim: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(feature_dim)
        self.proj = nn.Linear(feature_dim, width)

    def forward(self, h_B_L_D: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(h_B_L_D))


def _check_tokens(head: ActionHead, x_B_L_C: torch.Tensor, state_B_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, mask) of a token head's input, shapes checked against its config."""
    c = head.cfg
    h_B_L_D, real_B_L = unpack_tokens(x_B_L_C, c.feature_dim, head.type_name)
    if state_B_S.shape != (x_B_L_C.shape[0], c.state_dim):
        raise ShapeMismatch(
            f"{head.type_name}: state must be [B={x_B_L_C.shape[0]}, {c.state_dim}], got {list(state_B_S.shape)}"
        )
    return h_B_L_D, real_B_L


@register("oft_attn")
class OFTAttnHead(GaussianPolicy):
    """Action placeholder tokens cross-attending over the backbone's tokens -> the chunk."""

    reads = "tokens"

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden
        self.reader = _TokenReader(cfg.feature_dim, d)
        self.queries = nn.Parameter(torch.randn(cfg.action_horizon, d) * 0.02)
        self.state_in = _state_encoder(cfg.state_dim, d)
        self.q_norm = nn.LayerNorm(d)
        self.cross = TokenAttention(d)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = _ffn(d)
        self.out_norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, cfg.action_dim)
        # The critic (modules named critic*: their own optimizer group), in place of
        # GaussianPolicy's pooled-feature critic: one learned query attention-pools the
        # actor's projected tokens (detached: the critic never moves the actor's reader).
        self.critic_query = nn.Parameter(torch.randn(1, d) * 0.02)
        self.critic_attn = TokenAttention(d)
        self.critic_norm = nn.LayerNorm(d)
        self.critic = mlp_layers(d + cfg.state_dim, cfg.hidden, 1)

    def _check(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> None:
        _check_tokens(self, feats_B_D, state_B_S)

    def _predict(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> torch.Tensor:
        """The mean chunk [B, H, A] in normalised action units."""
        h_B_L_D, real_B_L = _check_tokens(self, feats_B_D, state_B_S)
        mem_B_L_d = self.reader(h_B_L_D)
        q_B_H_d = self.queries[None] + self.state_in(self.norm_state(state_B_S))[:, None, :]
        q_B_H_d = q_B_H_d + self.cross(self.q_norm(q_B_H_d), mem_B_L_d, real_B_L)
        q_B_H_d = q_B_H_d + self.ffn(self.ffn_norm(q_B_H_d))
        return self.out(self.out_norm(q_B_H_d))

    def value(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> torch.Tensor:
        """The critic's V(s) [B] from attention-pooled tokens + the normalised state."""
        h_B_L_D, real_B_L = _check_tokens(self, feats_B_D, state_B_S)
        mem_B_L_d = self.reader(h_B_L_D).detach()
        q_B_1_d = self.critic_query[None].expand(h_B_L_D.shape[0], -1, -1)
        pooled_B_d = self.critic_attn(q_B_1_d, mem_B_L_d, real_B_L)[:, 0]
        x = torch.cat([self.critic_norm(pooled_B_d), self.norm_state(state_B_S)], dim=-1)
        return self.critic(x).squeeze(-1)


@register("gr00t_flow")
class GR00TFlowHead(ActionHead):
    """Velocity of the noisy chunk's action tokens from a decoder block over the tokens."""

    reads = "tokens"
    t_dim = 32

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden
        self.reader = _TokenReader(cfg.feature_dim, d)
        self.action_in = nn.Linear(cfg.action_dim, d)
        self.step_pos = nn.Parameter(torch.randn(cfg.action_horizon, d) * 0.02)
        self.time_in = nn.Sequential(nn.Linear(self.t_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.state_in = _state_encoder(cfg.state_dim, d)
        self.self_norm = nn.LayerNorm(d)
        self.self_attn = TokenAttention(d)
        self.cross_norm = nn.LayerNorm(d)
        self.cross = TokenAttention(d)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = _ffn(d)
        self.out_norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, cfg.action_dim)

    def _check(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> None:
        _check_tokens(self, feats_B_D, state_B_S)

    def _context(self, feats: torch.Tensor, state_B_S: torch.Tensor) -> tuple[
            tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        """What every Euler step reuses: the cross-attention's keys/values, the mask and
        the state token."""
        h_B_L_D, real_B_L = _check_tokens(self, feats, state_B_S)
        kv = self.cross.memory(self.reader(h_B_L_D))
        return kv, real_B_L, self.state_in(self.norm_state(state_B_S))

    def velocity(self, x_B_H_A: torch.Tensor, t_B: torch.Tensor,
                 ctx: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """v(x_t, t | tokens, state) [B, H, A] in normalised action units."""
        kv, real_B_L, state_B_d = ctx
        a_B_H_d = self.action_in(x_B_H_A) + self.step_pos[None] + self.time_in(time_embedding(t_B, self.t_dim))[:, None]
        seq = torch.cat([state_B_d[:, None], a_B_H_d], dim=1)  # [B, 1 + H, d]: the state token first
        z = self.self_norm(seq)
        seq = seq + self.self_attn(z, z)
        seq = seq + self.cross.attend(self.cross_norm(seq), kv, real_B_L)
        seq = seq + self.ffn(self.ffn_norm(seq))
        return self.out(self.out_norm(seq[:, 1:]))

    def loss(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
             weight_B: torch.Tensor | None = None) -> torch.Tensor:
        ctx = self._context(feats_B_D, state_B_S)
        b = feats_B_D.shape[0]
        c = self.cfg
        self._check_target(target, (b, c.action_horizon, c.action_dim))
        x1 = self.norm_action(target)
        # The head's own generator: the same draws whether this tenant runs grouped or alone.
        noise = torch.randn(x1.shape, generator=self.generator).to(x1)
        t_B = torch.rand((b,), generator=self.generator).to(x1)
        xt = (1.0 - t_B[:, None, None]) * noise + t_B[:, None, None] * x1
        v = self.velocity(xt, t_B, ctx)
        return weighted_mean(((v - (x1 - noise)) ** 2).flatten(1).mean(1), weight_B)

    def act(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, noise: torch.Tensor | None = None,
            steps: int | None = None, **kw: Any) -> torch.Tensor:
        """Euler-integrate from ``noise`` ``[B, horizon, action_dim]`` (drawn from the head's
        generator if None); deterministic given the noise."""
        ctx = self._context(feats_B_D, state_B_S)
        b = feats_B_D.shape[0]
        x = self.noise_chunk(b, noise).to(feats_B_D)
        n = steps or self.cfg.flow_steps
        if not (isinstance(n, int) and 1 <= n <= 1000):
            raise InvalidSpec(f"{self.type_name}: Euler steps must be an integer in 1..1000, got {n!r}")
        dt = 1.0 / n
        for k in range(n):
            t_B = torch.full((b,), k * dt, dtype=x.dtype, device=x.device)
            x = x + dt * self.velocity(x, t_B, ctx)
        return self.denorm_action(x)
