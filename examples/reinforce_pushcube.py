"""REINFORCE with a client-side baseline, a policy-gradient method the service does
not have, written against the training client.

The tenant runs ManiSkill's PushCube itself (``source="tenant"`` style): each
step asks the workload's policy for its mean action through the Inference
Queue (``client.act``), samples around it with the policy's own std (from a
``forward`` call), and keeps the rows. After each rollout the returns-to-go
minus a per-step baseline (their mean over the envs, computed here) weigh the
log-probabilities of the taken actions in a loss written here
(``forward_backward_custom``: only d(loss)/d(outputs) goes to the service),
then ``optim_step`` publishes the next version, which the next rollout acts
with. Success per iteration is reported with Wilson 95% intervals.

    python examples/reinforce_pushcube.py --nats nats://127.0.0.1:4222 --creds acme.json \\
        [--init-from my-sft --iterations 20 --envs 8 --steps 50]
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

import numpy as np

from joynexus.schemas.samples import ACTIONS_FIELD, OBS_IMAGES, OBS_STATE, STATE_FIELD, image_field
from joynexus.sdk import Client, WorkloadSpec

ENV = "PushCube-v1"
ADV = "reinforce_adv"  # a client-side column: never sent (only the loss's gradients are)


def spec(name: str, *, init_from: str = "", seed: int = 0) -> WorkloadSpec:
    return WorkloadSpec(name=name, task_type="custom", env=ENV, action_horizon=1, head_hidden=32,
                        seed=seed, init_from_workload=init_from)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def reinforce_loss(outputs: dict[str, Any], batch: dict[str, Any]) -> Any:
    """-E[(G - b) log pi(a | s)]: the Gaussian log-probability of the taken chunk."""
    import torch

    std = outputs["log_std"].exp().unsqueeze(1)  # [B, 1, A]
    logp = torch.distributions.Normal(outputs["mean"], std).log_prob(batch[ACTIONS_FIELD]).sum((1, 2))
    return -(batch[ADV] * logp).mean()


def returns_to_go(rewards_T_N: np.ndarray, gamma: float) -> np.ndarray:
    out = np.zeros_like(rewards_T_N)
    acc = np.zeros(rewards_T_N.shape[1], dtype=np.float32)
    for t in range(len(rewards_T_N) - 1, -1, -1):
        acc = rewards_T_N[t] + gamma * acc
        out[t] = acc
    return out


async def reinforce(client: Client, workload: str, *, iterations: int = 10, envs: int = 4,
                    steps: int = 50, lr: float = 3e-4, gamma: float = 0.95, seed: int = 0,
                    rows_per_call: int = 64) -> dict[str, Any]:
    """Train ``workload`` by REINFORCE in a PushCube the client runs; per-iteration
    success rates (an episode succeeds if any of its steps does) with intervals."""
    from joynexus.agents.envs.registry import make_env

    tc = await client.training_client(workload)
    cam = tc.schema.camera_slots[0]
    rng = np.random.default_rng(seed)
    rates: list[dict[str, Any]] = []
    with make_env(ENV, obs="rgb", num_envs=envs, image_size=tc.schema.image_hw[0], seed=seed) as env:
        for it in range(iterations):
            obs = env.reset(seed=seed + it * envs)
            rows: dict[str, list[np.ndarray]] = {image_field(cam): [], STATE_FIELD: [], ACTIONS_FIELD: []}
            rewards, success = [], np.zeros(envs, dtype=bool)
            for _ in range(steps):
                images, state = obs[f"{OBS_IMAGES}.{cam}"], obs[OBS_STATE]
                mean = await client.act(workload, images={cam: images}, state=state)  # [N, 1, A]
                log_std = (await tc.forward({image_field(cam): images[:1], STATE_FIELD: state[:1]}))["log_std"][0]
                chunk = (mean + np.exp(log_std) * rng.standard_normal(mean.shape)).astype(np.float32)
                res = env.step(np.clip(chunk[:, 0], -1.0, 1.0))
                for k, v in ((image_field(cam), images), (STATE_FIELD, state), (ACTIONS_FIELD, chunk)):
                    rows[k].append(v)
                rewards.append(np.asarray(res.reward_N, dtype=np.float32))
                success |= np.asarray(res.success_N, dtype=bool)
                obs = res.obs
            g = returns_to_go(np.stack(rewards), gamma)  # [T, N]
            adv = g - g.mean(axis=1, keepdims=True)  # the client's baseline: the envs' mean per step
            adv = adv / (adv.std() + 1e-6)
            batch = {k: np.concatenate(v) for k, v in rows.items()}
            batch[ADV] = adv.reshape(-1).astype(np.float32)
            n = len(batch[STATE_FIELD])
            for s in range(0, n, rows_per_call):
                tc.forward_backward_custom({k: v[s:s + rows_per_call] for k, v in batch.items()}, reinforce_loss)
            version = (await tc.optim_step(learning_rate=lr, grad_clip=1.0))["version"]
            k = int(success.sum())
            lo, hi = wilson(k, envs)
            rates.append({"iteration": it, "version": version, "success": k / envs, "ci95": [lo, hi],
                          "mean_return": float(np.stack(rewards).sum(0).mean())})
    return {"iterations": rates, "first": rates[0], "last": rates[-1]}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nats", default=None)
    p.add_argument("--creds", required=True)
    p.add_argument("--name", default="reinforce")
    p.add_argument("--init-from", default="", help="an SFT workload of yours to start from")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    client = await Client.connect(args.nats, credentials=args.creds)
    await client.create_workload(spec(args.name, init_from=args.init_from))
    out = await reinforce(client, args.name, iterations=args.iterations, envs=args.envs, steps=args.steps)
    for r in out["iterations"]:
        print(r)


if __name__ == "__main__":
    asyncio.run(main())
