"""What the prefix-cache action experts share: ``CacheExpertHead``, flow matching over a base's
per-layer key/value cache as LeRobot's π0.5 and SmolVLA train and sample it.

A subclass gives ``_cache`` (the packed token features -> per-layer keys and values and the
real-token mask), ``velocity`` (one ``denoise_step``) and, if its suffix reads the state
(``pi05_expert``'s ``expert_state="token"``), ``_suffix_state``; this class gives the loss
(``x_t = t * noise + (1 - t) * actions``, target ``noise - actions``, time ~ Beta(1.5, 1)
scaled into [0.001, 1], the mean squared error over the real action dims) and ``act``
(Euler from t=1 to t=0, LeRobot's ``sample_actions``), actions padded to ``MAX_ACTION_DIM``
inside. Draws come from the head's own generator, so they are the same grouped or alone.

See docs/ARCHITECTURE.md, "Model families: the π0.5 base" and
"Model families: the SmolVLA base".
"""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from joynexus.agents.models.heads import base
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = ["MAX_ACTION_DIM", "CacheExpertHead", "sinusoidal_time"]

#: Actions are padded to this width inside an expert (LeRobot's ``max_action_dim``).
MAX_ACTION_DIM = 32


def sinusoidal_time(t_B: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """LeRobot's ``create_sinusoidal_pos_embedding`` (float64 on the CPU, as it computes it)."""
    dtype = torch.float64 if t_B.device.type == "cpu" else torch.float32
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=dtype, device=t_B.device)
    period = min_period * (max_period / min_period) ** fraction
    sin_input = (1.0 / period * 2 * math.pi)[None, :] * t_B[:, None]
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1).to(t_B.dtype)


class CacheExpertHead(base.ActionHead):
    """A tenant's flow-matching action expert over a base's prefix cache (packed token features)."""

    reads: ClassVar[Literal["pooled", "tokens"]] = "tokens"

    def __init__(self, cfg: base.HeadConfig) -> None:
        super().__init__(cfg)
        if cfg.action_dim > MAX_ACTION_DIM:
            raise InvalidSpec(f"{self.type_name}: action_dim={cfg.action_dim} exceeds max_action_dim={MAX_ACTION_DIM}")
        if cfg.hidden % 2:
            raise InvalidSpec(f"{self.type_name}: hidden={cfg.hidden} (the expert's width) must be even")

    @abc.abstractmethod
    def _cache(self, feats_B_L_C: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Per-layer (keys, values) and the real-token mask ``[B, L]`` of packed features."""

    @abc.abstractmethod
    def velocity(self, cache: list[tuple[torch.Tensor, torch.Tensor]], real_B_L: torch.Tensor,
                 x_B_H_M: torch.Tensor, t_B: torch.Tensor, state_B_S: torch.Tensor | None = None) -> torch.Tensor:
        """The expert's velocity ``[B, H, MAX_ACTION_DIM]`` at flow time ``t``; ``state_B_S`` is
        ``_suffix_state``'s (None unless the suffix reads the state)."""

    def _suffix_state(self, state_B_S: torch.Tensor) -> torch.Tensor | None:
        """The state the expert's suffix reads, or None (the default: the state is in the prefix)."""
        return None

    def _check_feats(self, feats: torch.Tensor, state_B_S: torch.Tensor) -> None:
        if feats.ndim != 3 or state_B_S.shape != (feats.shape[0], self.cfg.state_dim):
            raise ShapeMismatch(
                f"{self.type_name}: state must be [B={feats.shape[0]}, {self.cfg.state_dim}], got {list(state_B_S.shape)}"
            )

    def _pad(self, a_B_H_A: torch.Tensor) -> torch.Tensor:
        return F.pad(a_B_H_A, (0, MAX_ACTION_DIM - a_B_H_A.shape[-1]))

    def loss(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
             weight_B: torch.Tensor | None = None) -> torch.Tensor:
        """Flow matching: mean squared velocity error over the real action dims."""
        self._check_feats(feats_B_D, state_B_S)
        c = self.cfg
        b = feats_B_D.shape[0]
        self._check_target(target, (b, c.action_horizon, c.action_dim))
        cache, real = self._cache(feats_B_D)
        actions = self._pad(self.norm_action(target))
        # Beta(1.5, 1) is U ** (1 / 1.5).
        noise = torch.randn(actions.shape, generator=self.generator).to(actions)
        t_B = (torch.rand((b,), generator=self.generator) ** (1 / 1.5) * 0.999 + 0.001).to(actions)
        te = t_B[:, None, None]
        v = self.velocity(cache, real, te * noise + (1 - te) * actions, t_B, self._suffix_state(state_B_S))
        err = ((noise - actions) - v)[..., : c.action_dim] ** 2
        return base.weighted_mean(err.mean((1, 2)), weight_B)

    def act(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, noise: torch.Tensor | None = None,
            steps: int | None = None, **kw: Any) -> torch.Tensor:
        """``sample_actions`` over the cache: Euler from t=1 (``noise``, ``[B, H, A]`` or
        ``[B, H, MAX_ACTION_DIM]``) to t=0 in ``steps`` (default ``flow_steps``); actions ``[B, H, A]``."""
        self._check_feats(feats_B_D, state_B_S)
        c = self.cfg
        b = feats_B_D.shape[0]
        if noise is None:
            noise = torch.randn((b, c.action_horizon, MAX_ACTION_DIM), generator=self.generator)
        if noise.shape[-1] == c.action_dim and c.action_dim != MAX_ACTION_DIM:
            noise = self._pad(noise)
        self._check_target(noise, (b, c.action_horizon, MAX_ACTION_DIM))
        cache, real = self._cache(feats_B_D)
        x = noise.to(feats_B_D)
        n = steps or c.flow_steps
        dt = -1.0 / n
        st = self._suffix_state(state_B_S.to(x.device))
        for k in range(n):
            t_B = torch.full((b,), 1.0 + k * dt, dtype=torch.float32, device=x.device)
            x = x + dt * self.velocity(cache, real, x, t_B, st)
        return self.denorm_action(x[..., : c.action_dim])
