"""The head registry and what every head shares: ``HeadConfig``, ``ActionHead``.

Heads are chosen by type name from the one registry (``@register``,
``build_head``, ``HEADS``); importing any module of ``agents.models.heads``
registers every family (the package imports them). Every head has
``loss(feats, state, target)`` and ``act(feats, state)`` and normalises with its
data's statistics held as buffers (so they travel with the weights). Also the
layers and losses several families use (``mlp_layers``, ``time_embedding``,
``weighted_mean``).

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from joynexus.agents.models.seeding import seeded
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = [
    "HEADS",
    "NORM_CLIP",
    "ActionHead",
    "HeadConfig",
    "build_head",
    "mlp_layers",
    "register",
    "time_embedding",
    "weighted_mean",
]

@dataclass(frozen=True)
class HeadConfig:
    """Sizes and knobs of one tenant's head. Validates itself."""

    feature_dim: int
    state_dim: int
    action_dim: int = 7
    action_horizon: int = 8
    hidden: int = 32
    loss: Literal["l1", "mse"] = "l1"  # oft_mlp only
    flow_steps: int = 4  # flow_matching: Euler steps at act()
    seed: int = 0  # init weights and the head's own noise generator
    #: Gaussian heads: initial policy std per action dimension, in normalised action units.
    init_std: float = 0.3
    #: ``pi05_expert`` only: the base's cache layers the expert attends to (its own depth);
    #: ``feature_dim`` is then the cache's width, ``kv_layers * 2 * kv_heads * head_dim``.
    kv_layers: int = 0
    #: ``pi05_expert`` only: where the expert reads the robot state. "prompt": only as the
    #: base's discretised prompt digits (π0.5, LeRobot's PI05); "token": also as one
    #: continuous suffix token before the actions (``state_proj``, LeRobot π0's layout).
    expert_state: Literal["prompt", "token"] = "prompt"

    def __post_init__(self) -> None:
        if self.expert_state not in ("prompt", "token"):
            raise InvalidSpec(f"HeadConfig.expert_state={self.expert_state!r:.40}: choose 'prompt' or 'token'")
        if not isinstance(self.kv_layers, int) or not 0 <= self.kv_layers <= 64:
            raise InvalidSpec(f"HeadConfig.kv_layers={self.kv_layers!r}: an integer in [0, 64]")
        for name in ("feature_dim", "state_dim", "action_dim", "action_horizon", "hidden", "flow_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidSpec(f"HeadConfig.{name}={v!r}: must be an integer >= 1")
        if not (isinstance(self.init_std, (int, float)) and 1e-3 <= self.init_std <= 10.0):
            raise InvalidSpec(f"HeadConfig.init_std={self.init_std!r}: must be a number in [0.001, 10]")
        if self.loss not in ("l1", "mse"):
            raise InvalidSpec(f"HeadConfig.loss={self.loss!r}: choose 'l1' or 'mse'")


class ActionHead(nn.Module, abc.ABC):
    """Base of tenant heads: ``loss`` for training, ``act`` for decoding (both abstract)."""

    type_name: str = ""
    #: What the head reads from the shared backbone forward: "pooled" (``feats_B_D``
    #: [B, D]) or "tokens" (the packed last hidden states and mask [B, L, D + 1],
    #: ``features.pack_tokens``); ``grouped.features_for`` hands each head its kind.
    reads: ClassVar[Literal["pooled", "tokens"]] = "pooled"
    #: Whether the head can take the state as a suffix token (``HeadConfig.expert_state``).
    state_token: ClassVar[bool] = False
    state_mean: torch.Tensor
    state_std: torch.Tensor
    action_mean: torch.Tensor
    action_std: torch.Tensor

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        if cfg.expert_state != "prompt" and not self.state_token:
            raise InvalidSpec(f"{self.type_name}: expert_state={cfg.expert_state!r} is for pi05_expert only")
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(cfg.seed + 1)
        # Normalisation statistics (LeRobot's mean/std of the training data): buffers, so
        # they are part of the weights and travel with every checkpoint, published
        # version and export. Identity until ``TenantModule.set_normalization``.
        self.register_buffer("state_mean", torch.zeros(cfg.state_dim))
        self.register_buffer("state_std", torch.ones(cfg.state_dim))
        self.register_buffer("action_mean", torch.zeros(cfg.action_dim))
        self.register_buffer("action_std", torch.ones(cfg.action_dim))

    def norm_state(self, state_B_S: torch.Tensor) -> torch.Tensor:
        """State in units of the training data's spread, clipped to +-NORM_CLIP."""
        z = (state_B_S - self.state_mean) / self.state_std
        return z.clamp(-NORM_CLIP, NORM_CLIP)

    @torch.no_grad()
    def prefix_state(self, state_B_S: torch.Tensor) -> torch.Tensor:
        """The state as a base's prompt takes it (π0.5 discretises it into 256 bins of [-1, 1],
        after LeRobot's normaliser): ``PREFIX_STATE_SPAN`` of this data's standard deviations."""
        return (self.norm_state(state_B_S) / PREFIX_STATE_SPAN).clamp(-1.0, 1.0)

    def norm_action(self, action_B_H_A: torch.Tensor) -> torch.Tensor:
        return (action_B_H_A - self.action_mean) / self.action_std

    def denorm_action(self, z_B_H_A: torch.Tensor) -> torch.Tensor:
        return z_B_H_A * self.action_std + self.action_mean

    def _check(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> None:
        c = self.cfg
        if feats_B_D.ndim != 2 or feats_B_D.shape[1] != c.feature_dim:
            raise ShapeMismatch(f"{self.type_name}: feats must be [B, {c.feature_dim}], got {list(feats_B_D.shape)}")
        if state_B_S.shape != (feats_B_D.shape[0], c.state_dim):
            raise ShapeMismatch(
                f"{self.type_name}: state must be [B={feats_B_D.shape[0]}, {c.state_dim}], got {list(state_B_S.shape)}"
            )

    def _check_target(self, target: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(target.shape) != shape:
            raise ShapeMismatch(f"{self.type_name}: target must be {list(shape)}, got {list(target.shape)}")

    def noise_chunk(self, batch: int, noise: torch.Tensor | None = None) -> torch.Tensor:
        """A flow's starting noise ``[batch, horizon, action_dim]``: ``noise`` once its
        shape is checked, or drawn from the head's own generator."""
        c = self.cfg
        shape = (batch, c.action_horizon, c.action_dim)
        if noise is None:
            noise = torch.randn(shape, generator=self.generator)
        self._check_target(noise, shape)
        return noise

    @abc.abstractmethod
    def loss(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
             weight_B: torch.Tensor | None = None) -> torch.Tensor:
        """Mean loss over the batch; ``weight_B`` weighs samples (advantage-weighted RL)."""

    @abc.abstractmethod
    def act(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, **kw: Any) -> torch.Tensor:
        """Actions (or values) for a batch of features and robot states."""


HEADS: dict[str, type[ActionHead]] = {}
#: Normalised states are clipped to this many standard deviations.
NORM_CLIP = 10.0
#: How many standard deviations of the training data a prompt's [-1, 1] state spans.
PREFIX_STATE_SPAN = 3.0


def register(type_name: str) -> Callable[[type[ActionHead]], type[ActionHead]]:
    """Class decorator: make a head buildable by ``type_name``."""

    def deco(cls: type[ActionHead]) -> type[ActionHead]:
        if type_name in HEADS and HEADS[type_name] is not cls:
            raise InvalidSpec(f"head type {type_name!r} is already registered to {HEADS[type_name].__name__}")
        cls.type_name = type_name
        HEADS[type_name] = cls
        return cls

    return deco


def build_head(type_name: str, cfg: HeadConfig) -> ActionHead:
    """Build a registered head; weights are initialized from ``cfg.seed`` only."""
    cls = HEADS.get(type_name)
    if cls is None:
        raise InvalidSpec(f"unknown action module {type_name!r}: choose one of {sorted(HEADS)}")
    with seeded(cfg.seed):
        return cls(cfg)


def weighted_mean(loss_B: torch.Tensor, weight_B: torch.Tensor | None) -> torch.Tensor:
    if weight_B is None:
        return loss_B.mean()
    if weight_B.shape != loss_B.shape:
        raise ShapeMismatch(f"sample weights must be [{loss_B.shape[0]}], got {list(weight_B.shape)}")
    w_B = weight_B.to(loss_B)
    return (loss_B * w_B).sum() / w_B.sum().clamp_min(1e-8)


def mlp_layers(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, d_out))


def time_embedding(t_B: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
    ang_B_F = t_B[:, None] * freqs[None, :] * 1000.0
    return torch.cat([ang_B_F.sin(), ang_B_F.cos()], dim=-1)
