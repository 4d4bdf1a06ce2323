"""One tenant's private training state: ``TenantModule`` (head, AdamW, version).

Each tenant owns a small head, its optimizer state and its version counter;
nothing here is shared or averaged across tenants. A step is all or nothing
(a non-finite loss, gradient or result leaves the module as it was), PPO steps
adapt the policy's learning rate, and a module saves, loads, exports and
imports its weights (safetensors with a manifest).

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from joynexus.agents.models.heads.base import HeadConfig, build_head
from joynexus.agents.models.heads.gaussian import GaussianPolicy
from joynexus.agents.models.heads.ppo import MAX_LOG_RATIO, PPOBatch
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = ["CRITIC_LR", "MAX_LR_FACTOR", "MIN_LR_FACTOR", "MIN_STD", "TenantModule", "all_finite"]

#: The critic's smallest learning rate (its own optimizer group).
CRITIC_LR = 1e-3
#: The adaptive PPO step keeps the policy's learning rate within these factors of the spec's.
MIN_LR_FACTOR, MAX_LR_FACTOR = 1e-3, 10.0
#: Smallest standard deviation used (a dimension constant in the data is left unscaled around its mean).
MIN_STD = 1e-2


def all_finite(tensors: list[torch.Tensor]) -> bool:
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
                if not all_finite(grads):
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
        return all_finite(list(self.head.parameters())) and all_finite(_moments(self.optimizer))

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

