"""Gaussian heads: a mean action chunk with a learned std and a critic (PPO applies).

:class:`GaussianPolicy` is the family's base (log-probabilities, entropy, the
PPO loss, sampling); ``oft_mlp`` (:class:`OFTMLPHead`) decodes the whole chunk
in one MLP pass from the pooled features. ``oft_attn`` (``heads.token``) is
one too.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch
from torch import nn

from joynexus.agents.models.heads.base import (
    ActionHead,
    HeadConfig,
    mlp_layers,
    register,
    weighted_mean,
)
from joynexus.agents.models.heads.ppo import PPOBatch, ppo_objective
from joynexus.schemas.errors import ShapeMismatch

__all__ = ["LOG_2PI", "LOG_STD_MAX", "LOG_STD_MIN", "GaussianPolicy", "OFTMLPHead"]

LOG_STD_MIN, LOG_STD_MAX = -5.0, 1.0
LOG_2PI = math.log(2.0 * math.pi)


class GaussianPolicy(ActionHead):
    """A head whose action chunk is the mean of a diagonal Gaussian (in normalised
    action units) with a learned log-std per action dimension, plus a critic.

    Subclasses give ``_predict`` (the mean chunk). The
    behaviour log-probability of a taken chunk is tractable (``log_prob``), so RL
    trains these heads with PPO (``ppo_loss``); the critic (a value head on the
    head's own inputs) gives the values GAE bootstraps from. SFT trains the mean
    only (``loss``); the std and the critic are left for RL.
    """

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        self.log_std = nn.Parameter(torch.full((cfg.action_dim,), math.log(cfg.init_std)))
        self.critic_norm = nn.LayerNorm(cfg.feature_dim)
        self.critic = mlp_layers(cfg.feature_dim + cfg.state_dim, cfg.hidden, 1)

    @abc.abstractmethod
    def _predict(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> torch.Tensor:
        """The mean chunk [B, H, A] in normalised action units."""

    def std_A(self, std_floor: float = 0.0) -> torch.Tensor:
        """The policy's std per action dimension in normalised units, at least
        ``std_floor`` (env action units) / the action's data std."""
        std = self.log_std.clamp(LOG_STD_MIN, LOG_STD_MAX).exp()
        if std_floor > 0:
            std = torch.maximum(std, std_floor / self.action_std)
        return std

    def action_std_A(self, std_floor: float = 0.0) -> torch.Tensor:
        """The policy's std in the env's action units (what a producer samples with)."""
        return self.std_A(std_floor) * self.action_std

    def act(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, **kw: Any) -> torch.Tensor:
        """The mean chunk, in the env's action units."""
        return self.denorm_action(self._predict(feats_B_D, state_B_S))

    def loss(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
             weight_B: torch.Tensor | None = None) -> torch.Tensor:
        """SFT: L1 or MSE of the mean chunk to the target chunk, in normalised units."""
        pred_B_H_A = self._predict(feats_B_D, state_B_S)
        self._check_target(target, tuple(pred_B_H_A.shape))
        target = self.norm_action(target)
        err = (pred_B_H_A - target).abs() if self.cfg.loss == "l1" else (pred_B_H_A - target) ** 2
        return weighted_mean(err.flatten(1).mean(1), weight_B)

    def critic_parameters(self) -> list[nn.Parameter]:
        """The critic's weights (modules named ``critic*``): an optimizer group of their own."""
        return [p for n, p in self.named_parameters() if n.split(".")[0].startswith("critic")]

    def value(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> torch.Tensor:
        """The critic's V(s) [B]."""
        self._check(feats_B_D, state_B_S)
        x = torch.cat([self.critic_norm(feats_B_D), self.norm_state(state_B_S)], dim=-1)
        return self.critic(x).squeeze(-1)

    def _log_prob(self, mean_B_H_A: torch.Tensor, actions_B_H_A: torch.Tensor,
                  std_floor: float, mask_B_H: torch.Tensor | None = None) -> torch.Tensor:
        self._check_target(actions_B_H_A, tuple(mean_B_H_A.shape))
        std_A = self.std_A(std_floor)
        z = (self.norm_action(actions_B_H_A) - mean_B_H_A) / std_A
        per_B_H = (-0.5 * z * z - std_A.log() - 0.5 * LOG_2PI).sum(-1)
        if mask_B_H is not None:
            if tuple(mask_B_H.shape) != tuple(per_B_H.shape):
                raise ShapeMismatch(f"{self.type_name}: chunk mask must be {list(per_B_H.shape)}, "
                                    f"got {list(mask_B_H.shape)}")
            per_B_H = per_B_H * mask_B_H.to(per_B_H)
        return per_B_H.sum(1)

    def log_prob(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, actions_B_H_A: torch.Tensor,
                 std_floor: float = 0.0, mask_B_H: torch.Tensor | None = None) -> torch.Tensor:
        """log pi(chunk | obs) [B] of chunks in the env's action units (density of the
        normalised chunk: the constant Jacobian of the normalisation cancels in ratios).
        With ``mask_B_H`` only the chunk steps it marks count (the steps a decision
        executed; a row with none gets 0)."""
        return self._log_prob(self._predict(feats_B_D, state_B_S), actions_B_H_A, std_floor, mask_B_H)

    def entropy(self, std_floor: float = 0.0) -> torch.Tensor:
        """Entropy of one chunk's distribution (the same for every observation)."""
        std_A = self.std_A(std_floor)
        per_A = 0.5 * (1.0 + LOG_2PI) + std_A.log()
        return per_A.sum() * self.cfg.action_horizon

    def ppo_loss(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, actions_B_H_A: torch.Tensor,
                 ppo: PPOBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Clipped-ratio PPO on the taken chunks plus the critic's loss to the returns."""
        b = feats_B_D.shape[0]
        for name, t in (("old_logp", ppo.old_logp_B), ("advantages", ppo.adv_B), ("returns", ppo.returns_B)):
            if tuple(t.shape) != (b,):
                raise ShapeMismatch(f"{self.type_name}: PPO {name} must be [{b}], got {list(t.shape)}")
        adv_B = ppo.adv_B.to(feats_B_D)
        rows_B = ppo.rows_B()
        if rows_B is not None and tuple(rows_B.shape) != (b,):
            raise ShapeMismatch(f"{self.type_name}: PPO chunk mask must be [{b}, H], got {list(rows_B.shape)}")
        if ppo.normalize_adv:  # over the decisions: the rows the policy term reads
            sel = adv_B if rows_B is None else adv_B[rows_B]
            if sel.numel() > 1:
                adv_B = (adv_B - sel.mean()) / (sel.std() + 1e-6)
        logp_B = self.log_prob(feats_B_D, state_B_S, actions_B_H_A, ppo.std_floor, ppo.mask_B_H)
        return ppo_objective(
            logp_B, ppo.old_logp_B.to(logp_B), adv_B, self.value(feats_B_D, state_B_S),
            ppo.returns_B.to(logp_B), clip=ppo.clip, vf_coef=ppo.vf_coef,
            old_values_B=None if ppo.old_values_B is None else ppo.old_values_B.to(logp_B),
            entropy=self.entropy(ppo.std_floor), ent_coef=ppo.ent_coef,
            rows_B=rows_B, policy_coef=ppo.policy_coef,
        )

    def sample(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, std_floor: float = 0.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """A chunk drawn from the policy, in the env's action units."""
        mean_B_H_A = self._predict(feats_B_D, state_B_S)
        eps = torch.randn(mean_B_H_A.shape, generator=generator or self.generator).to(mean_B_H_A)
        return self.denorm_action(mean_B_H_A + eps * self.std_A(std_floor))


@register("oft_mlp")
class OFTMLPHead(GaussianPolicy):
    """Parallel decoding of the whole action chunk in one MLP pass (OpenVLA-OFT style).

    ``act`` answers the mean chunk; as a :class:`GaussianPolicy` it also has a
    learned std and a critic for PPO."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        self.norm = nn.LayerNorm(cfg.feature_dim)
        self.net = mlp_layers(cfg.feature_dim + cfg.state_dim, cfg.hidden, cfg.action_horizon * cfg.action_dim)

    def _predict(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> torch.Tensor:
        """The chunk in normalised action units."""
        self._check(feats_B_D, state_B_S)
        x = torch.cat([self.norm(feats_B_D), self.norm_state(state_B_S)], dim=-1)
        return self.net(x).view(-1, self.cfg.action_horizon, self.cfg.action_dim)
