"""Tenant action modules: the only trainable part of a tenant's policy.

Each tenant owns a small head, its optimizer state and its version counter;
nothing here is shared or averaged across tenants. Heads are chosen by type
name from the one registry (``@register``, ``build_head``, ``HEADS``):
``oft_mlp`` (a :class:`GaussianPolicy` with a critic), ``flow_matching`` and
``value``. Every head has ``loss(feats, state, target)`` and ``act(feats,
state)``, normalises with its data's statistics held as buffers (so they
travel with the weights), and ``TenantModule`` bundles head, AdamW and version.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = [
    "HEADS",
    "ActionHead",
    "FlowMatchingHead",
    "GaussianPolicy",
    "HeadConfig",
    "OFTMLPHead",
    "PPOBatch",
    "TenantModule",
    "ValueHead",
    "build_head",
    "ppo_objective",
    "register",
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

    def __post_init__(self) -> None:
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
    state_mean: torch.Tensor
    state_std: torch.Tensor
    action_mean: torch.Tensor
    action_std: torch.Tensor

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
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
#: Smallest standard deviation used (a dimension constant in the data is left unscaled around its mean).
MIN_STD = 1e-2


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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
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


LOG_STD_MIN, LOG_STD_MAX = -5.0, 1.0
LOG_2PI = math.log(2.0 * math.pi)
#: |log pi - log pi_old| beyond this is clamped in the PPO ratio (exp(20) ~ 5e8).
MAX_LOG_RATIO = 20.0
#: The critic's smallest learning rate (its own optimizer group).
CRITIC_LR = 1e-3
#: The adaptive PPO step keeps the policy's learning rate within these factors of the spec's.
MIN_LR_FACTOR, MAX_LR_FACTOR = 1e-3, 10.0


@dataclass(frozen=True)
class PPOBatch:
    """What a PPO step needs besides the batch and the taken actions (one per row):
    the behaviour policy's log-probabilities of those actions, the advantages and
    the returns (GAE targets of the critic)."""

    old_logp_B: torch.Tensor
    adv_B: torch.Tensor
    returns_B: torch.Tensor
    #: The critic's values at collection (clipped value loss when given).
    old_values_B: torch.Tensor | None = None
    clip: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    #: Floor under the policy's std, in the env's action units (the tenant's exploration_std).
    std_floor: float = 0.0
    #: Normalise the advantages over the batch (mean 0, std 1).
    normalize_adv: bool = True
    #: Optimizer passes over the batch in the one step (the job still makes one version).
    epochs: int = 1
    #: Which steps of each row's chunk its decision executed ([B, H] bool; rows whose
    #: mask is all False were executed open loop from an earlier decision: they train
    #: the critic, not the policy). None: every row is a decision over its whole chunk.
    mask_B_H: torch.Tensor | None = None
    #: Weight of the policy terms (0 while the critic warms up: only the critic learns).
    policy_coef: float = 1.0
    #: Target KL per step (k3 estimate against the behaviour policy, after the step):
    #: the policy's learning rate is divided by 1.5 above 2x the target and multiplied
    #: by 1.5 below half of it (an adaptive PPO step); further epochs stop past 1.5x.
    #: 0: fixed learning rate.
    target_kl: float = 0.0

    def to(self, device: torch.device | str) -> PPOBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PPOBatch(
            mv(self.old_logp_B), mv(self.adv_B), mv(self.returns_B),  # type: ignore[arg-type]
            mv(self.old_values_B), self.clip, self.vf_coef, self.ent_coef, self.std_floor,
            self.normalize_adv, self.epochs, mv(self.mask_B_H), self.policy_coef, self.target_kl,
        )

    def rows_B(self) -> torch.Tensor | None:
        """Rows that are decisions (the policy's samples), or None for all."""
        return None if self.mask_B_H is None else self.mask_B_H.any(dim=1)


def ppo_objective(
    logp_B: torch.Tensor,
    old_logp_B: torch.Tensor,
    adv_B: torch.Tensor,
    values_B: torch.Tensor,
    returns_B: torch.Tensor,
    *,
    clip: float = 0.2,
    vf_coef: float = 0.5,
    old_values_B: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ent_coef: float = 0.0,
    dual_clip: float | None = 3.0,
    rows_B: torch.Tensor | None = None,
    policy_coef: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped-ratio PPO loss plus the critic's loss (pure).

    policy loss = -mean(min(r A, clip(r, 1 - clip, 1 + clip) A)), r = exp(logp - old_logp)
    (the log-ratio clamped to +-MAX_LOG_RATIO, so it stays finite), and with
    ``dual_clip`` c (dual-clip PPO) a negative-advantage term is bounded by c A, so a
    ratio that ran away (a stale behaviour version, a chunk in the tails) cannot
    dominate the step;
    value loss = mean((V - R)^2), or with ``old_values_B`` the clipped form
    mean(max((V - R)^2, (old + clip(V - old, -clip, clip) - R)^2)), times 0.5;
    total = policy_coef * (policy - ent_coef * entropy) + vf_coef * value. With
    ``rows_B`` (bool) the policy terms and their statistics average over those rows
    only (the decisions); the critic learns from every row. Returns (total, stats).
    """
    if not (0.0 < clip < 1.0):
        raise InvalidSpec(f"PPO clip={clip!r}: must be in (0, 1)")
    shapes = {t.shape for t in (logp_B, old_logp_B, adv_B, values_B, returns_B)}
    if len(shapes) != 1 or logp_B.ndim != 1:
        raise ShapeMismatch(f"PPO inputs must all be [B]; got {sorted(tuple(s) for s in shapes)}")
    # Clamped before exp: a chunk far in the tail of both policies (tiny data std,
    # an open-loop chunk element) can move its log-prob by more than exp's range in
    # one step; such rows are clipped anyway (no gradient), the loss stays finite.
    log_ratio_B = (logp_B - old_logp_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_B = log_ratio_B.exp()
    surr_B = torch.minimum(ratio_B * adv_B, ratio_B.clamp(1.0 - clip, 1.0 + clip) * adv_B)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise InvalidSpec(f"PPO dual_clip={dual_clip!r}: must be > 1")
        surr_B = torch.where(adv_B < 0, torch.maximum(surr_B, dual_clip * adv_B), surr_B)
    w_B = torch.ones_like(surr_B) if rows_B is None else rows_B.to(surr_B)
    n_rows = w_B.sum().clamp_min(1.0)
    policy = -(surr_B * w_B).sum() / n_rows
    v_err_B = (values_B - returns_B) ** 2
    if old_values_B is not None:
        v_clip_B = old_values_B + (values_B - old_values_B).clamp(-clip, clip)
        v_err_B = torch.maximum(v_err_B, (v_clip_B - returns_B) ** 2)
    value = 0.5 * v_err_B.mean()
    pol = policy
    if entropy is not None and ent_coef:
        pol = pol - ent_coef * entropy
    total = policy_coef * pol + vf_coef * value
    with torch.no_grad():
        stats = {
            "policy_loss": float(policy),
            "value_loss": float(value),
            "clip_frac": float((((ratio_B - 1.0).abs() > clip).float() * w_B).sum() / n_rows),
            "approx_kl": float((((ratio_B - 1.0) - log_ratio_B) * w_B).sum() / n_rows),
        }
    return total, stats


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


def time_embedding(t_B: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
    ang_B_F = t_B[:, None] * freqs[None, :] * 1000.0
    return torch.cat([ang_B_F.sin(), ang_B_F.cos()], dim=-1)


@register("flow_matching")
class FlowMatchingHead(ActionHead):
    """Velocity field v(x_t, t | feats, state); x_0 = noise, x_1 = actions (rectified flow)."""

    t_dim = 32

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        self.norm = nn.LayerNorm(cfg.feature_dim)
        self.cond = nn.Linear(cfg.feature_dim + cfg.state_dim, cfg.hidden)
        n_act = cfg.action_horizon * cfg.action_dim
        self.net = mlp_layers(n_act + cfg.hidden + self.t_dim, cfg.hidden, n_act)

    def _cond(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor) -> torch.Tensor:
        return self.cond(torch.cat([self.norm(feats_B_D), self.norm_state(state_B_S)], dim=-1))

    def velocity(self, x_B_N: torch.Tensor, t_B: torch.Tensor, cond_B_C: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x_B_N, cond_B_C, time_embedding(t_B, self.t_dim)], dim=-1))

    def loss(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
             weight_B: torch.Tensor | None = None) -> torch.Tensor:
        self._check(feats_B_D, state_B_S)
        b = feats_B_D.shape[0]
        c = self.cfg
        self._check_target(target, (b, c.action_horizon, c.action_dim))
        x1_B_N = self.norm_action(target).reshape(b, -1)
        # The head's own generator: the same draws whether this tenant runs grouped or alone.
        noise_B_N = torch.randn(x1_B_N.shape, generator=self.generator).to(x1_B_N)
        t_B = torch.rand((b,), generator=self.generator).to(x1_B_N)
        xt_B_N = (1.0 - t_B[:, None]) * noise_B_N + t_B[:, None] * x1_B_N
        v_B_N = self.velocity(xt_B_N, t_B, self._cond(feats_B_D, state_B_S))
        return weighted_mean(((v_B_N - (x1_B_N - noise_B_N)) ** 2).mean(1), weight_B)

    def act(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, noise: torch.Tensor | None = None,
            steps: int | None = None, **kw: Any) -> torch.Tensor:
        """Euler-integrate from ``noise`` ``[B, horizon, action_dim]`` (drawn from the head's generator if None)."""
        self._check(feats_B_D, state_B_S)
        c = self.cfg
        b = feats_B_D.shape[0]
        shape = (b, c.action_horizon, c.action_dim)
        if noise is None:
            noise = torch.randn(shape, generator=self.generator)
        self._check_target(noise, shape)
        x_B_N = noise.reshape(b, -1).to(feats_B_D)
        cond_B_C = self._cond(feats_B_D, state_B_S)
        n = steps or c.flow_steps
        dt = 1.0 / n
        # velocity() with its first layer split by input: the condition's and each step's
        # time-embedding parts are computed once, not per step, and no cat per step
        # (same function, to float rounding: 6e-8; a 4-step act on 2 rows 0.81 vs 1.10 ms).
        first, rest = self.net[0], self.net[1:]
        assert isinstance(first, nn.Linear)
        n_act = x_B_N.shape[1]
        w_x, w_c, w_t = first.weight.split([n_act, cond_B_C.shape[1], self.t_dim], dim=1)
        t_K = torch.arange(n, dtype=x_B_N.dtype, device=x_B_N.device) * dt
        t_part_K_H = torch.nn.functional.linear(time_embedding(t_K, self.t_dim), w_t)
        c_part_B_H = torch.nn.functional.linear(cond_B_C, w_c, first.bias)
        for k in range(n):
            h_B_H = torch.nn.functional.linear(x_B_N, w_x) + c_part_B_H + t_part_K_H[k]
            x_B_N = x_B_N + dt * rest(h_B_H)
        return self.denorm_action(x_B_N.view(shape))


@register("value")
class ValueHead(ActionHead):
    """State value V(s) for RL: one scalar per sample."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__(cfg)
        self.norm = nn.LayerNorm(cfg.feature_dim)
        self.net = mlp_layers(cfg.feature_dim + cfg.state_dim, cfg.hidden, 1)

    def act(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, **kw: Any) -> torch.Tensor:
        self._check(feats_B_D, state_B_S)
        return self.net(torch.cat([self.norm(feats_B_D), self.norm_state(state_B_S)], dim=-1)).squeeze(-1)

    def loss(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
             weight_B: torch.Tensor | None = None) -> torch.Tensor:
        v_B = self.act(feats_B_D, state_B_S)
        self._check_target(target, tuple(v_B.shape))
        return weighted_mean((v_B - target) ** 2, weight_B)


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """One sync per device (AdamW keeps its ``step`` counters on the CPU)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())


def _moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _non_finite_inputs(feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
                       weight_B: torch.Tensor | None) -> str:
    """Which inputs hold NaN/inf (a reason a tenant can act on), or that none does."""
    named = {"targets (actions)": target, "state": state_B_S, "backbone features": feats_B_D}
    if weight_B is not None:
        named["sample weights (advantages)"] = weight_B
    bad = []
    for name, t in named.items():
        if t.is_floating_point():
            n = int((~torch.isfinite(t)).sum())
            if n:
                bad.append(f"{name} hold {n} non-finite (NaN/inf) value(s)")
    if bad:
        return "its " + ", ".join(bad)
    return "its inputs are finite but their magnitudes overflow the loss"


class TenantModule:
    """One tenant's private training state: head, AdamW optimizer, version.

    ``version`` counts optimizer steps applied (the policy version a publisher
    would announce). Nothing in here is shared with another tenant.
    """

    def __init__(self, tenant: str, head_type: str, cfg: HeadConfig, lr: float = 1e-3,
                 weight_decay: float = 0.0, device: str | torch.device = "cpu") -> None:
        if not tenant:
            raise InvalidSpec("TenantModule.tenant is empty: give the tenant id")
        if not (lr > 0 and math.isfinite(lr)):
            raise InvalidSpec(f"TenantModule lr={lr!r}: must be a finite number > 0")
        self.tenant = tenant
        self.head_type = head_type
        self.cfg = cfg
        self.lr = lr
        self.weight_decay = weight_decay
        self.head = build_head(head_type, cfg).to(device)
        # Two groups for a Gaussian head: the policy's (its lr adapts to the PPO step's
        # KL) and the critic's (fixed, at least CRITIC_LR: it starts from scratch in RL).
        critic = self.head.critic_parameters() if isinstance(self.head, GaussianPolicy) else []
        ids = {id(p) for p in critic}
        groups: list[dict[str, Any]] = [
            {"params": [p for p in self.head.parameters() if id(p) not in ids], "name": "policy"}
        ]
        if critic:
            groups.append({"params": critic, "name": "critic", "lr": max(lr, CRITIC_LR)})
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
        self.version = 0
        self._ppo: PPOBatch | None = None
        #: Diagnostics of the last step (PPO: policy/value loss, clip fraction, approx KL).
        self.last_stats: dict[str, float] = {}

    @property
    def gaussian(self) -> bool:
        """The head has a tractable likelihood and a critic (PPO applies)."""
        return isinstance(self.head, GaussianPolicy)

    def stage_ppo(self, ppo: PPOBatch | None) -> None:
        """Make this module's next ``train_step`` a PPO step with these inputs (its
        ``target`` is then the taken action chunks); consumed by that step."""
        if ppo is not None and not self.gaussian:
            raise InvalidSpec(
                f"tenant {self.tenant}: head {self.head_type!r} has no tractable likelihood; "
                "train it with advantage weights (weight_B) instead of PPO"
            )
        self._ppo = ppo

    def set_lr(self, lr: float) -> None:
        """Train at ``lr`` from now on (the policy group; the critic's at least CRITIC_LR)."""
        if not (lr > 0 and math.isfinite(lr)):
            raise InvalidSpec(f"TenantModule lr={lr!r}: must be a finite number > 0")
        self.lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = max(lr, CRITIC_LR) if group.get("name") == "critic" else lr

    def num_params(self) -> int:
        return sum(p.numel() for p in self.head.parameters())

    @torch.no_grad()
    def set_normalization(self, stats: dict[str, dict[str, Any]]) -> None:
        """Take LeRobot-style statistics ``{"observation.state": {"mean", "std"},
        "action": {"mean", "std"}}`` (lists or tensors, one value per dimension; a
        key may be missing: left as it is). std is floored at ``MIN_STD``."""
        h = self.head
        for key, prefix, dim in (("observation.state", "state", self.cfg.state_dim),
                                 ("action", "action", self.cfg.action_dim)):
            entry = stats.get(key) or {}
            if "mean" not in entry or "std" not in entry:
                continue
            mean = torch.as_tensor(entry["mean"], dtype=torch.float32).reshape(-1)
            std = torch.as_tensor(entry["std"], dtype=torch.float32).reshape(-1)
            if mean.numel() != dim or std.numel() != dim:
                raise ShapeMismatch(
                    f"normalisation stats of {key}: {mean.numel()}/{std.numel()} values for {dim} dimensions"
                )
            if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
                raise InvalidSpec(f"normalisation stats of {key} hold NaN/inf")
            getattr(h, f"{prefix}_mean").copy_(mean)
            getattr(h, f"{prefix}_std").copy_(std.clamp_min(MIN_STD))

    def normalization(self) -> dict[str, dict[str, list[float]]]:
        """The statistics the head applies (what ``set_normalization`` took)."""
        h = self.head
        return {
            "observation.state": {"mean": h.state_mean.tolist(), "std": h.state_std.tolist()},
            "action": {"mean": h.action_mean.tolist(), "std": h.action_std.tolist()},
        }

    def train_step(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
                   weight_B: torch.Tensor | None = None) -> float:
        """loss, backward and AdamW step on this tenant's head only; returns the loss.

        After ``stage_ppo`` the step is PPO's (clipped ratio on ``target``, the taken
        chunks, plus the critic's loss); ``weight_B`` is then ignored.

        All or nothing: if the loss raises, the loss or a gradient is non-finite,
        or the step would leave a non-finite weight or optimizer moment, the head,
        its optimizer, its noise generator and ``version`` are as before and
        ``InvalidSpec`` says why (naming the non-finite inputs, if any).
        """
        self.head.train()
        self.optimizer.zero_grad(set_to_none=True)
        gen_state = self.head.generator.get_state()
        ppo, self._ppo = self._ppo, None
        before = None
        if ppo is not None:
            ppo = ppo.to(feats_B_D.device)
        try:
            # PPO takes ``ppo.epochs`` optimizer passes over the job's batch (one version).
            for epoch in range(ppo.epochs if ppo is not None else 1):
                if ppo is not None:
                    assert isinstance(self.head, GaussianPolicy)  # stage_ppo checked it
                    loss, stats = self.head.ppo_loss(feats_B_D, state_B_S, target, ppo)
                    if epoch and ppo.target_kl and stats["approx_kl"] > 1.5 * ppo.target_kl:
                        break  # far enough from the behaviour policy for this job
                else:
                    loss, stats = self.head.loss(feats_B_D, state_B_S, target, weight_B), {}
                if not bool(torch.isfinite(loss)):
                    raise InvalidSpec(
                        f"tenant {self.tenant}: non-finite loss ({loss.item()}): "
                        f"{_non_finite_inputs(feats_B_D, state_B_S, target, weight_B)}; no step taken"
                    )
                loss.backward()
                grads = [p.grad for p in self.head.parameters() if p.grad is not None]
                if not _all_finite(grads):
                    raise InvalidSpec(
                        f"tenant {self.tenant}: non-finite gradients (loss {float(loss.detach()):.4g}): "
                        f"{_non_finite_inputs(feats_B_D, state_B_S, target, weight_B)}; no step taken"
                    )
                if before is None:
                    before = self._snapshot()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if not self.finite():
                    raise InvalidSpec(
                        f"tenant {self.tenant}: the step overflowed to non-finite weights (loss "
                        f"{float(loss.detach()):.4g}); check the magnitudes of its targets; step undone"
                    )
        except BaseException:
            if before is not None:  # the step ran (or raised half way): undo it
                self._restore(before)
            self.optimizer.zero_grad(set_to_none=True)
            self.head.generator.set_state(gen_state)
            raise
        self.optimizer.zero_grad(set_to_none=True)
        if ppo is not None and ppo.target_kl > 0 and ppo.policy_coef > 0:  # not while the critic warms up
            stats = {**stats, **self._adapt_lr(feats_B_D, state_B_S, target, ppo)}
        self.version += 1
        self.last_stats = stats
        return float(loss.detach())

    @torch.no_grad()
    def _adapt_lr(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, target: torch.Tensor,
                  ppo: PPOBatch) -> dict[str, float]:
        """The adaptive PPO step (as rsl_rl's): the KL of the stepped policy from the
        behaviour policy on the decisions, and the policy group's new learning rate."""
        head = self.head
        assert isinstance(head, GaussianPolicy)
        logp_B = head.log_prob(feats_B_D, state_B_S, target, ppo.std_floor, ppo.mask_B_H)
        log_ratio_B = (logp_B - ppo.old_logp_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        rows_B = ppo.rows_B()
        k3_B = log_ratio_B.exp() - 1.0 - log_ratio_B
        kl = float(k3_B.mean() if rows_B is None else k3_B[rows_B].mean()) if k3_B.numel() else 0.0
        group = self.optimizer.param_groups[0]
        lr = float(group["lr"])
        if kl > 2.0 * ppo.target_kl:
            lr /= 1.5
        elif kl < 0.5 * ppo.target_kl:
            lr *= 1.5
        group["lr"] = min(max(lr, self.lr * MIN_LR_FACTOR), self.lr * MAX_LR_FACTOR)
        return {"kl_after": kl, "lr": float(group["lr"])}

    def _snapshot(self) -> tuple[list[torch.Tensor], dict[Any, dict[str, Any]]]:
        params = [p.detach().clone() for p in self.head.parameters()]
        state = {
            p: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
            for p, s in self.optimizer.state.items()
        }
        return params, state

    @torch.no_grad()
    def _restore(self, snap: tuple[list[torch.Tensor], dict[Any, dict[str, Any]]]) -> None:
        params, state = snap
        for p, saved in zip(self.head.parameters(), params, strict=True):
            p.copy_(saved)
        self.optimizer.state.clear()
        for p, s in state.items():
            self.optimizer.state[p] = s

    def finite(self) -> bool:
        """Every weight and optimizer moment is finite."""
        return _all_finite(list(self.head.parameters())) and _all_finite(_moments(self.optimizer))

    @torch.no_grad()
    def act(self, feats_B_D: torch.Tensor, state_B_S: torch.Tensor, **kw: Any) -> torch.Tensor:
        if self.head.training:  # eval() walks every submodule: ~50 us a call, for nothing
            self.head.eval()
        return self.head.act(feats_B_D, state_B_S, **kw)

    def state_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "head_type": self.head_type,
            "config": asdict(self.cfg),
            "version": self.version,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "head": {k: v.detach().clone() for k, v in self.head.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "generator": self.head.generator.get_state(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["head_type"] != self.head_type or HeadConfig(**sd["config"]) != self.cfg:
            raise InvalidSpec(
                f"tenant {self.tenant}: state is for head {sd['head_type']!r} {sd['config']}, this module is "
                f"{self.head_type!r} {asdict(self.cfg)}; build a TenantModule with the saved type and config"
            )
        self.head.load_state_dict(sd["head"])
        try:
            self.optimizer.load_state_dict(sd["optimizer"])
        except ValueError:  # saved with another grouping (an older release): fresh moments
            pass
        self.head.generator.set_state(sd["generator"])
        self.version = int(sd["version"])

    @classmethod
    def from_state_dict(cls, sd: dict[str, Any], device: str | torch.device = "cpu") -> TenantModule:
        m = cls(sd["tenant"], sd["head_type"], HeadConfig(**sd["config"]), lr=sd["lr"],
                weight_decay=sd["weight_decay"], device=device)
        m.load_state_dict(sd)
        return m

    def export_safetensors(self, path: str | Path) -> Path:
        """Head weights as safetensors with a manifest in the metadata (no optimizer)."""
        p = Path(path)
        if p.suffix != ".safetensors":
            p.mkdir(parents=True, exist_ok=True)
            p = p / "head.safetensors"
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        meta = {"tenant": self.tenant, "head_type": self.head_type, "version": str(self.version),
                "config": json.dumps(asdict(self.cfg))}
        save_file(tensors, str(p), metadata=meta)
        return p

    @classmethod
    def import_safetensors(cls, path: str | Path, lr: float = 1e-3) -> TenantModule:
        """Rebuild a module from ``export_safetensors`` output (fresh optimizer, same version)."""
        from safetensors import safe_open

        p = Path(path)
        if p.is_dir():
            p = p / "head.safetensors"
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
        for k in ("tenant", "head_type", "version", "config"):
            if k not in meta:
                raise InvalidSpec(f"{p}: safetensors metadata lacks {k!r}; export it with TenantModule.export_safetensors")
        m = cls(meta["tenant"], meta["head_type"], HeadConfig(**json.loads(meta["config"])), lr=lr)
        m.head.load_state_dict(load_file(str(p)))
        m.version = int(meta["version"])
        return m

