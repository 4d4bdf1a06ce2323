"""GRPO-style policy optimisation over ``act`` rollouts, written against the training
client: group-relative advantages, no value head, a clipped importance ratio
computed on the client.

The rollouts are ``reinforce_pushcube.py``'s (``pushcube_rl.rollout``): envs in
groups of ``--group`` that share a reset seed, each step's mean action from the
Inference Queue plus noise with the policy's std, and here also each taken
chunk's log-probability under that behaviour policy, kept on the client. The
advantage of a step is its return-to-go minus the mean of its group at that step
(``--advantage step``; ``episode``: the episode's return minus its group's, GRPO's
outcome advantage, for every step), over the batch's std. Then ``--epochs``
passes over the rollout in minibatches of ``--minibatch`` rows, each a
``forward_backward_custom`` with the clipped surrogate
``-min(r A, clip(r, 1 - eps, 1 + eps) A)``, ``r = exp(logp_new - logp_old)``,
written here (only d(loss)/d(outputs) goes to the service), and an
``optim_step`` (a version each). The ratio's clip is the trust region that
plain REINFORCE lacks: it stops a minibatch from moving a taken action's
probability by more than ``eps`` once it has, so several steps a rollout (and a
larger learning rate) stay safe. A pass whose mean approximate KL to the
behaviour policy exceeds ``--target-kl`` ends the iteration's passes early.
``--entropy-coef`` adds ``c * entropy`` to the objective (negative: the std is
pulled down, so the sampled policy RL improves comes closer to the mean action
the service evaluates).

    python examples/grpo_pushcube.py --nats nats://127.0.0.1:4222 --creds acme.json --init-from my-sft
    python examples/grpo_pushcube.py --local        # self-contained (README: the figure)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from typing import Any

import numpy as np
import pushcube_rl as pc

from joynexus.schemas.samples import ACTIONS_FIELD, STATE_FIELD
from joynexus.sdk import Client

# client-side columns: never sent (only the loss's gradients are)
ADV = "grpo_adv"
OLD_LOGP = "grpo_logp_old"


def outcome_advantages(outcome_N: np.ndarray, group: int, steps: int) -> np.ndarray:
    """GRPO's outcome advantage: each episode's outcome minus its group's mean, over
    the batch's std, the same for every step of the episode (all 0 where every
    group's episodes did alike). [T, N]."""
    centred = pc.group_centred(np.asarray(outcome_N, dtype=np.float32)[None], group)
    adv = np.broadcast_to(centred, (steps, centred.shape[1]))
    return adv / (adv.std() + 1e-6)


#: --advantage: per step (returns-to-go), or per episode (its return, its success).
ADVANTAGES = ("step", "return", "success")


def advantages(kind: str, ro: pc.Rollout, group: int, gamma: float) -> np.ndarray:
    """The rollout's advantages of kind ``kind`` (:data:`ADVANTAGES`), [T, N]."""
    if kind == "step":
        return pc.step_advantages(ro.rewards, group, gamma)
    if kind == "return":
        return outcome_advantages(ro.rewards.sum(0), group, len(ro.rewards))
    if kind == "success":
        return outcome_advantages(ro.success, group, len(ro.rewards))
    raise ValueError(f"advantage {kind!r}: one of {ADVANTAGES}")


class ClippedLoss:
    """The clipped surrogate of a minibatch (a ``forward_backward_custom`` loss): the
    Gaussian log-probability of each taken chunk under the outputs, its ratio to the
    behaviour's, ``-mean(min(r A, clip(r) A)) - c * entropy``; with ``std`` the
    Gaussian has that fixed std (the head's log-std gets no gradient). Each call's
    ratio statistics (approximate KL, clipped fraction) are kept in ``stats``."""

    def __init__(self, clip: float = 0.2, entropy_coef: float = 0.0, std: float | None = None) -> None:
        if std is not None and entropy_coef:
            raise ValueError("a fixed std has no entropy to weigh")
        self.clip = clip
        self.entropy_coef = entropy_coef
        self.std = std
        self.stats: list[dict[str, float]] = []

    def __call__(self, outputs: dict[str, Any], batch: dict[str, Any]) -> Any:
        import torch

        log_std = outputs["log_std"]  # [B, A]
        if self.std is not None:  # the client's own exploration std: only the mean learns
            log_std = torch.full_like(log_std, math.log(self.std))
        logp = torch.distributions.Normal(outputs["mean"], log_std.exp().unsqueeze(1)).log_prob(
            batch[ACTIONS_FIELD]).sum((1, 2))
        log_r = logp - batch[OLD_LOGP]
        r = log_r.exp()
        adv = batch[ADV]
        surrogate = torch.min(r * adv, r.clamp(1.0 - self.clip, 1.0 + self.clip) * adv).mean()
        entropy = log_std.sum(-1).mean()  # the Gaussian's entropy, less a constant
        with torch.no_grad():
            self.stats.append({"approx_kl": float(((r - 1.0) - log_r).mean()),
                               "clip_frac": float(((r - 1.0).abs() > self.clip).float().mean())})
        return -surrogate - self.entropy_coef * entropy


async def grpo(client: Client, workload: str, *, iterations: int = 10, envs: int = 4, group: int = 2,
               steps: int = 50, lr: float = 1e-4, gamma: float = 0.95, epochs: int = 4, minibatch: int = 100,
               clip: float = 0.2, target_kl: float = 0.0, entropy_coef: float = 0.0, advantage: str = "step",
               std: float | None = None, seed: int = 0, log: Any = None) -> dict[str, Any]:
    """Train ``workload`` in a PushCube the client runs (see the module); per
    iteration the rollout's success with intervals, its passes, and the ratio's
    approximate KL and clipped fraction over its last pass."""
    if group < 2 or envs % group:
        raise ValueError(f"envs={envs} must be a multiple of group={group} >= 2")
    tc = await client.training_client(workload)
    rng = np.random.default_rng(seed)
    loss = ClippedLoss(clip, entropy_coef, std)
    rates: list[dict[str, Any]] = []
    version = await client.latest_version(workload)
    with pc.pushcube(tc, envs, seed) as env:
        for it in range(iterations):
            t0 = time.perf_counter()
            ro = await pc.rollout(client, tc, env, workload, pc.group_seeds(seed, it, envs, group), steps, rng,
                                  std)
            adv = advantages(advantage, ro, group, gamma)
            batch = {**ro.rows, ADV: adv.reshape(-1).astype(np.float32), OLD_LOGP: ro.logp_old}
            # not past a success (never scored), nor rows without advantage (no gradient: an
            # optimizer step on nothing would still move by Adam's momentum)
            keep = ro.live.reshape(-1) & (batch[ADV] != 0)
            batch = {k: v[keep] for k, v in batch.items()}
            n = len(batch[STATE_FIELD])
            passes, kl, kl0, clipped, t1 = 0, 0.0, 0.0, 0.0, time.perf_counter()
            for _ in range(epochs if n else 0):
                loss.stats.clear()
                order = rng.permutation(n)
                calls = []
                for s in range(0, n, minibatch):
                    idx = order[s:s + minibatch]
                    calls.append(tc.forward_backward_custom({k: v[idx] for k, v in batch.items()}, loss))
                    calls.append(tc.optim_step(learning_rate=lr, grad_clip=1.0))
                version = (await asyncio.gather(*calls))[-1]["version"]
                kl0 = loss.stats[0]["approx_kl"] if passes == 0 else kl0  # before any step: ~0
                passes += 1
                kl = float(np.mean([s["approx_kl"] for s in loss.stats]))
                clipped = float(np.mean([s["clip_frac"] for s in loss.stats]))
                if target_kl > 0 and kl > target_kl:
                    break
            rates.append(pc.iteration_report(it, version, ro, log, rows=n, passes=passes, kl_first=round(kl0, 5),
                                             approx_kl=round(kl, 4), clip_frac=round(clipped, 3),
                                             rollout_s=round(t1 - t0, 1), update_s=round(time.perf_counter() - t1, 1)))
    return {"iterations": rates, "first": rates[0], "last": rates[-1]}


SETTINGS = ("iterations", "envs", "group", "steps", "lr", "gamma", "head_hidden", "epochs", "minibatch", "clip",
            "target_kl", "entropy_coef", "advantage", "std")


async def train(client: Client, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """``pushcube_rl.Trainer``: :func:`grpo` with the command line's settings."""
    out = await grpo(client, args.name, iterations=args.iterations, envs=args.envs, group=args.group,
                     steps=args.steps, lr=args.lr, gamma=args.gamma, epochs=args.epochs, minibatch=args.minibatch,
                     clip=args.clip, target_kl=args.target_kl, entropy_coef=args.entropy_coef,
                     advantage=args.advantage, std=args.std, seed=args.seed, log=log)
    out["settings"] = {k: getattr(args, k) for k in SETTINGS}
    return out


def parser() -> argparse.ArgumentParser:
    p = pc.parser((__doc__ or "").split("\n")[0], name="grpo", lr=1e-4)
    p.add_argument("--epochs", type=int, default=4, help="passes over each rollout")
    p.add_argument("--minibatch", type=int, default=100, help="rows per forward_backward_custom + optim_step")
    p.add_argument("--clip", type=float, default=0.2, help="the ratio's clip, eps")
    p.add_argument("--target-kl", type=float, default=0.0, help="end an iteration's passes past this KL (0: never)")
    p.add_argument("--entropy-coef", type=float, default=0.0, help="c * entropy added to the objective")
    p.add_argument("--advantage", choices=ADVANTAGES, default="step")
    p.add_argument("--std", type=float, default=None, help="explore with this std, the client's own "
                   "(the head's log-std then stays); default: the head's")
    return p


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    pc.check(args, ("epochs", "minibatch"))
    if not 0.0 < args.clip < 1.0:
        raise SystemExit("--clip must be in (0, 1)")
    if args.std is not None and not (0.0 < args.std <= 1.0 and not args.entropy_coef):
        raise SystemExit("--std must be in (0, 1], and without --entropy-coef")
    return await pc.main(args, train)


if __name__ == "__main__":
    asyncio.run(main())
