"""PPO's inputs and objective for heads with a tractable likelihood (pure).

``PPOBatch`` is what a PPO step needs besides the batch and the taken actions;
``ppo_objective`` is the clipped-ratio loss plus the critic's (dual clip, a
clipped value loss, per-row decision masks). ``GaussianPolicy.ppo_loss`` and
``TenantModule``'s adaptive step use them.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = ["MAX_LOG_RATIO", "PPOBatch", "ppo_objective"]

#: |log pi - log pi_old| beyond this is clamped in the PPO ratio (exp(20) ~ 5e8).
MAX_LOG_RATIO = 20.0


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
