"""REINFORCE with a client-side baseline, a policy-gradient method the service does
not have, written against the training client.

The tenant runs ManiSkill's PushCube itself (``source="tenant"`` style): each
step asks the workload's policy for its mean action through the Inference
Queue (``client.act``), samples around it with the policy's own std (one
``forward`` call per iteration: a Gaussian head's std does not depend on the
observation), and keeps the rows. The envs run in groups of ``--group`` that
start from the same initial state (one reset seed per group); after each
rollout the returns-to-go minus a per-step baseline (their mean over the
group, computed here: GRPO's group baseline, per step) weigh the
log-probabilities of the taken actions in a loss written here
(``forward_backward_custom``: only d(loss)/d(outputs) goes to the service),
then ``optim_step`` publishes the next version, which the next rollout acts
with. Rollout success per iteration is reported with Wilson 95% intervals.
``grpo_pushcube.py`` is the same with a clipped importance ratio (a trust region).

With ``--eval-episodes N`` the start version and the last one are each
evaluated by the service (``Client.evaluate`` pinned to the version: the
policy's mean action, the same N seeds for both); the JSON gives both rates
with Wilson 95% intervals and their difference with a Newcombe 95% interval.
The rollouts, evaluation and ``--local`` are ``pushcube_rl.py``'s.

    # against a deployment, from an SFT workload of yours
    python examples/reinforce_pushcube.py --nats nats://127.0.0.1:4222 --creds acme.json \\
        [--init-from my-sft --iterations 20 --envs 8 --eval-episodes 100]
    # self-contained: a deployment in this process, scripted demos, a short (weak) SFT,
    # then REINFORCE from it and the evaluation (README: the figure)
    python examples/reinforce_pushcube.py --local
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import numpy as np
import pushcube_rl as pc

from joynexus.schemas.samples import ACTIONS_FIELD, STATE_FIELD
from joynexus.sdk import Client

ADV = "reinforce_adv"  # a client-side column: never sent (only the loss's gradients are)


def reinforce_loss(outputs: dict[str, Any], batch: dict[str, Any]) -> Any:
    """-E[(G - b) log pi(a | s)]: the Gaussian log-probability of the taken chunk."""
    import torch

    std = outputs["log_std"].exp().unsqueeze(1)  # [B, 1, A]
    logp = torch.distributions.Normal(outputs["mean"], std).log_prob(batch[ACTIONS_FIELD]).sum((1, 2))
    return -(batch[ADV] * logp).mean()


async def reinforce(client: Client, workload: str, *, iterations: int = 10, envs: int = 4,
                    group: int = 2, steps: int = 50, lr: float = 3e-4, gamma: float = 0.95, seed: int = 0,
                    rows_per_call: int = 256, log: Any = None) -> dict[str, Any]:
    """Train ``workload`` by REINFORCE in a PushCube the client runs; per-iteration
    success rates (an episode succeeds if any of its steps does) with intervals.
    ``envs`` is a multiple of ``group`` (at least 2): each group shares its start."""
    if group < 2 or envs % group:
        raise ValueError(f"envs={envs} must be a multiple of group={group} >= 2")

    tc = await client.training_client(workload)
    rng = np.random.default_rng(seed)
    rates: list[dict[str, Any]] = []
    with pc.pushcube(tc, envs, seed) as env:
        for it in range(iterations):
            ro = await pc.rollout(client, tc, env, workload, pc.group_seeds(seed, it, envs, group), steps, rng)
            # the client's baseline: per step, the mean of the envs that started alike
            adv = pc.step_advantages(ro.rewards, group, gamma)
            batch = {**ro.rows, ADV: adv.reshape(-1).astype(np.float32)}
            n = len(batch[STATE_FIELD])
            for s in range(0, n, rows_per_call):
                tc.forward_backward_custom({k: v[s:s + rows_per_call] for k, v in batch.items()}, reinforce_loss)
            version = (await tc.optim_step(learning_rate=lr, grad_clip=1.0))["version"]
            rates.append(pc.iteration_report(it, version, ro, log))
    return {"iterations": rates, "first": rates[0], "last": rates[-1]}


async def train(client: Client, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """``pushcube_rl.Trainer``: :func:`reinforce` with the command line's settings."""
    out = await reinforce(client, args.name, iterations=args.iterations, envs=args.envs, group=args.group,
                          steps=args.steps, lr=args.lr, gamma=args.gamma, seed=args.seed, log=log)
    out["settings"] = {k: getattr(args, k) for k in ("iterations", "envs", "group", "steps", "lr", "gamma",
                                                     "head_hidden")}
    return out


def parser() -> argparse.ArgumentParser:
    return pc.parser((__doc__ or "").split("\n")[0], name="reinforce", lr=2e-4)


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    pc.check(args)
    return await pc.main(args, train)


if __name__ == "__main__":
    asyncio.run(main())
