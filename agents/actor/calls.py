"""The training client's calls, computed on one tenant's module (torch, no I/O).

``forward`` answers the head's outputs (``schemas.training``: a Gaussian head's
mean chunk, log-std and value; a flow head's velocity at the rows' point and
time); ``forward_backward`` takes a built-in loss of those outputs and
accumulates its gradients in the module's parameters; ``backward`` recomputes
the outputs (the base is frozen: the same features) and back-propagates the
gradients a client's own loss gave them, accumulating too; ``optim_step``
applies what accumulated with the tenant's AdamW (this step's lr, betas,
weight decay, gradient clip) and counts a version. Every call is all or
nothing: non-finite gradients or weights leave the module as it was and
raise ``InvalidSpec``. The loop that leases, commits and answers is
:mod:`joynexus.agents.actor.custom`.

See docs/ARCHITECTURE.md, "The training client".
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from joynexus.agents.advantage import awr_weights
from joynexus.agents.models.heads.base import weighted_mean
from joynexus.agents.models.heads.flow import FlowMatchingHead
from joynexus.agents.models.heads.gaussian import LOG_STD_MAX, LOG_STD_MIN, GaussianPolicy
from joynexus.agents.models.heads.ppo import PPOBatch
from joynexus.agents.models.heads.tenant import TenantModule, all_finite
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.samples import (
    ACTIONS_FIELD,
    ADVANTAGES_FIELD,
    FLOW_T_FIELD,
    FLOW_XT_FIELD,
    OLD_LOGP_FIELD,
    RETURNS_FIELD,
)
from joynexus.schemas.training import OUTPUT_GRADS, TrainCall

__all__ = ["KEEP_RESULTS", "CallLog", "apply_rows", "optim_step", "outputs", "zero_grad"]

#: Results a tenant's state keeps (a re-delivered call answers its stored result).
KEEP_RESULTS = 64


@dataclass
class CallLog:
    """Which of a workload's calls are applied: the last sequence number and the
    latest results by call job id (committed with the module, atomically)."""

    last_seq: int = 0
    results: OrderedDict[str, bytes] = field(default_factory=OrderedDict)

    def record(self, job_id: str, seq: int, result: bytes) -> list[str]:
        """Remember ``job_id``'s result as call ``seq``; returns the forgotten job ids."""
        self.last_seq = max(self.last_seq, seq)
        self.results[job_id] = result
        gone = []
        while len(self.results) > KEEP_RESULTS:
            gone.append(self.results.popitem(last=False)[0])
        return gone

    def to_dict(self) -> dict[str, Any]:
        return {"last_seq": self.last_seq, "results": dict(self.results)}

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> CallLog:
        d = d or {}
        return CallLog(int(d.get("last_seq", 0)), OrderedDict(d.get("results", {})))


def _t(data: dict[str, np.ndarray], name: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data[name], dtype=np.float32)).to(device)


def outputs(module: TenantModule, feats: torch.Tensor, state: torch.Tensor,
            data: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The head's outputs for the rows, with their graph (``schemas.training``)."""
    head = module.head
    b = feats.shape[0]
    if isinstance(head, GaussianPolicy):
        # Both in the env's action units: the policy is N(mean, exp(log_std)), as its
        # rollouts sample it (the head keeps its std in normalised units).
        log_std = head.log_std.clamp(LOG_STD_MIN, LOG_STD_MAX) + head.action_std.log()
        return {
            "mean": head.denorm_action(head._predict(feats, state)),
            "log_std": log_std.unsqueeze(0).expand(b, -1),
            "value": head.value(feats, state),
        }
    if isinstance(head, FlowMatchingHead):
        xt = _t(data, FLOW_XT_FIELD, feats.device)
        t = _t(data, FLOW_T_FIELD, feats.device)
        head._check(feats, state)
        v = head.velocity(xt.reshape(b, -1), t, head._cond(feats, state))
        return {"velocity": v.view(xt.shape)}
    raise InvalidSpec(f"head {module.head_type!r} is not driven by the training client")


def _loss(module: TenantModule, call: TrainCall, feats: torch.Tensor, state: torch.Tensor,
          data: dict[str, np.ndarray]) -> tuple[torch.Tensor, dict[str, float]]:
    """A built-in loss of the call's rows, and its diagnostics."""
    head = module.head
    s = call.settings
    actions = _t(data, ACTIONS_FIELD, feats.device)
    if call.loss == "flow_matching":
        if not isinstance(head, FlowMatchingHead):
            raise InvalidSpec(f"loss flow_matching trains flow heads, not {module.head_type!r}")
        return head.loss(feats, state, actions), {}
    if not isinstance(head, GaussianPolicy):
        raise InvalidSpec(f"loss {call.loss!r} trains Gaussian heads, not {module.head_type!r}")
    if call.loss == "ppo":
        ppo = PPOBatch(
            old_logp_B=_t(data, OLD_LOGP_FIELD, feats.device).reshape(-1),
            adv_B=_t(data, ADVANTAGES_FIELD, feats.device).reshape(-1),
            returns_B=_t(data, RETURNS_FIELD, feats.device).reshape(-1),
            clip=s.get("clip", 0.2), vf_coef=s.get("vf_coef", 0.5), ent_coef=s.get("ent_coef", 0.0),
            std_floor=s.get("std_floor", 0.0),
        )
        return head.ppo_loss(feats, state, actions, ppo)
    err_B = ((head.denorm_action(head._predict(feats, state)) - actions) ** 2).flatten(1).mean(1)
    if call.loss == "awr":
        adv = np.asarray(data[ADVANTAGES_FIELD], dtype=np.float32).reshape(-1)
        w = torch.from_numpy(awr_weights(adv, beta=s.get("beta", 1.0))).to(feats.device)
        return weighted_mean(err_B, w), {}
    return err_B.mean(), {}


def _grads(module: TenantModule) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in module.head.parameters()]


def _set_grads(module: TenantModule, grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(module.head.parameters(), grads, strict=True):
        p.grad = g


def accumulated(module: TenantModule) -> list[torch.Tensor | None]:
    """The gradients accumulated so far (saved with the tenant's state)."""
    return _grads(module)


def restore_accumulated(module: TenantModule, grads: list[torch.Tensor | None] | None) -> None:
    """Put saved accumulated gradients back (None or a mismatched list: none)."""
    params = list(module.head.parameters())
    if not grads or len(grads) != len(params):
        _set_grads(module, [None] * len(params))
        return
    _set_grads(module, [None if g is None or g.shape != p.shape else g.to(p) for p, g in zip(params, grads, strict=True)])


def apply_rows(module: TenantModule, call: TrainCall, feats: torch.Tensor, state: torch.Tensor,
               data: dict[str, np.ndarray]) -> tuple[float | None, dict[str, float], dict[str, np.ndarray]]:
    """A row call on its rows' features: (loss, metrics, outputs as arrays)."""
    head = module.head
    if call.op == "forward":
        head.eval()
        with torch.no_grad():
            outs = outputs(module, feats, state, data)
        return None, {}, {k: v.detach().cpu().numpy().astype(np.float32) for k, v in outs.items()}
    head.train()
    before = _grads(module)
    gen_state = head.generator.get_state()
    try:
        if call.op == "forward_backward":
            loss, stats = _loss(module, call, feats, state, data)
            if not bool(torch.isfinite(loss)):
                raise InvalidSpec(f"non-finite loss ({float(loss.detach())}); no gradient kept")
            loss.backward()
            value: float | None = float(loss.detach())
        else:  # backward: the client's gradients of the outputs
            outs = outputs(module, feats, state, data)
            # An all-zero gradient (an output the loss did not use) adds nothing: left out,
            # so the parameters only it reaches keep no gradient (as a built-in loss's).
            pairs = [(outs[o], grad) for o, g in OUTPUT_GRADS.items() if o in outs and g in data
                     for grad in (_t(data, g, feats.device),) if bool(grad.any())]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g.reshape(o.shape) for o, g in pairs])
            value, stats = None, {}
        grads = [p.grad for p in head.parameters() if p.grad is not None]
        if not all_finite(grads):
            raise InvalidSpec("non-finite gradients; the accumulated gradients are as before")
    except BaseException:
        _set_grads(module, before)
        head.generator.set_state(gen_state)
        raise
    return value, dict(stats), {}


def zero_grad(module: TenantModule) -> None:
    module.optimizer.zero_grad(set_to_none=True)


def optim_step(module: TenantModule, call: TrainCall) -> dict[str, float]:
    """Apply the accumulated gradients (all or nothing) and count a version."""
    head = module.head
    if call.learning_rate is not None:
        module.set_lr(call.learning_rate)
    for group in module.optimizer.param_groups:
        if call.betas is not None:
            group["betas"] = (float(call.betas[0]), float(call.betas[1]))
        if call.weight_decay is not None:
            group["weight_decay"] = float(call.weight_decay)
    params = [p for p in head.parameters() if p.grad is not None]
    if not all_finite([p.grad for p in params if p.grad is not None]):
        raise InvalidSpec("the accumulated gradients are not finite; zero_grad and try again")
    stats: dict[str, float] = {}
    if call.grad_clip is not None and params:
        norm = float(torch.nn.utils.clip_grad_norm_(params, call.grad_clip))
        stats["grad_norm"] = norm if math.isfinite(norm) else -1.0
    before = module._snapshot()
    module.optimizer.step()
    if not module.finite():
        module._restore(before)
        raise InvalidSpec("the step overflowed to non-finite weights; step undone")
    module.optimizer.zero_grad(set_to_none=True)
    module.version += 1
    return stats
