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

With ``--eval-episodes N`` the start version and the last one are each
evaluated by the service (``Client.evaluate`` pinned to the version: the
policy's mean action, the same N seeds for both); the JSON gives both rates
with Wilson 95% intervals and their difference with a Newcombe 95% interval.

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
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.ops.measure.stats import load, newcombe, wilson
from joynexus.schemas.samples import ACTIONS_FIELD, OBS_IMAGES, OBS_STATE, STATE_FIELD, image_field
from joynexus.sdk import Client, WorkloadSpec

ENV = "PushCube-v1"
ADV = "reinforce_adv"  # a client-side column: never sent (only the loss's gradients are)
#: --local: the demos' and the policy's observation (64 px camera, the simulator's
#: object and goal state), as the learning benchmark's PushCube plan has it.
LOCAL_STATE = ("privileged",)
LOCAL_IMAGE = 64


def spec(name: str, *, init_from: str = "", init_version: int | None = None, seed: int = 0,
         head_hidden: int = 32, state: tuple[str, ...] = (), image_size: int = 64) -> WorkloadSpec:
    """The custom workload; starting from an SFT workload it must have that one's head
    width and sample layout (action horizon 1: each step's one action is sampled)."""
    return WorkloadSpec(name=name, task_type="custom", env=ENV, action_horizon=1, head_hidden=head_hidden,
                        seed=seed, init_from_workload=init_from, init_from=init_version,
                        state=list(state), image_size=image_size)


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
                    group: int = 2, steps: int = 50, lr: float = 3e-4, gamma: float = 0.95, seed: int = 0,
                    rows_per_call: int = 256, log: Any = None) -> dict[str, Any]:
    """Train ``workload`` by REINFORCE in a PushCube the client runs; per-iteration
    success rates (an episode succeeds if any of its steps does) with intervals.
    ``envs`` is a multiple of ``group`` (at least 2): each group shares its start."""
    from joynexus.agents.envs.registry import make_env

    if group < 2 or envs % group:
        raise ValueError(f"envs={envs} must be a multiple of group={group} >= 2")

    tc = await client.training_client(workload)
    sch = tc.schema
    cam = sch.camera_slots[0]
    rng = np.random.default_rng(seed)
    rates: list[dict[str, Any]] = []
    with make_env(ENV, obs="rgb", num_envs=envs, image_size=sch.image_hw[0], seed=seed,
                  cameras=list(sch.camera_slots), state_keys=list(sch.state_keys) or None) as env:
        for it in range(iterations):
            obs = env.reset(seed=[seed + it * envs + i // group for i in range(envs)])
            rows: dict[str, list[np.ndarray]] = {image_field(cam): [], STATE_FIELD: [], ACTIONS_FIELD: []}
            rewards, success = [], np.zeros(envs, dtype=bool)
            images, state = obs[f"{OBS_IMAGES}.{cam}"], obs[OBS_STATE]
            std = np.exp((await tc.forward({image_field(cam): images[:1], STATE_FIELD: state[:1]}))["log_std"][0])
            for _ in range(steps):
                images, state = obs[f"{OBS_IMAGES}.{cam}"], obs[OBS_STATE]
                mean = await client.act(workload, images={cam: images}, state=state)  # [N, 1, A]
                chunk = (mean + std * rng.standard_normal(mean.shape)).astype(np.float32)
                res = env.step(np.clip(chunk[:, 0], -1.0, 1.0))
                for k, v in ((image_field(cam), images), (STATE_FIELD, state), (ACTIONS_FIELD, chunk)):
                    rows[k].append(v)
                rewards.append(np.asarray(res.reward_N, dtype=np.float32))
                success |= np.asarray(res.success_N, dtype=bool)
                obs = res.obs
            g = returns_to_go(np.stack(rewards), gamma)  # [T, N]
            g_T_G_g = g.reshape(len(g), envs // group, group)
            # the client's baseline: per step, the mean of the envs that started alike
            adv = (g_T_G_g - g_T_G_g.mean(axis=2, keepdims=True)).reshape(g.shape)
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
                          "mean_return": round(float(np.stack(rewards).sum(0).mean()), 3),
                          "std": round(float(std.mean()), 4)})
            if log is not None:
                log(f"iteration {it}: v{version} rollout success {k}/{envs}, "
                    f"return {rates[-1]['mean_return']}, std {rates[-1]['std']}")
    return {"iterations": rates, "first": rates[0], "last": rates[-1]}


async def evaluate_pair(client: Client, workload: str, start: int, end: int, *, episodes: int,
                        seed: int = 12345, num_envs: int = 10) -> dict[str, Any]:
    """Both versions evaluated by the service on the same ``episodes`` seeds (the mean
    action): their success with Wilson 95% intervals, end minus start with Newcombe's."""
    out: dict[str, Any] = {"episodes": episodes, "eval_seed": seed, "policy": "mean action"}
    ks = []
    for key, v in (("start", start), ("end", end)):
        ev = await client.evaluate(workload, version=v, episodes=episodes, num_envs=num_envs, seed=seed)
        n = int(ev.get("episodes", episodes))
        k = round(float(ev["success_rate"]) * n)
        ks.append((k, n))
        out[key] = {"version": v, "success": round(k / n, 4), "ci95": list(wilson(k, n)), "episodes": n}
    (k0, n0), (k1, n1) = ks
    d, lo, hi = newcombe(k1, n1, k0, n0)
    out["difference"] = {"end_minus_start": d, "ci95": [lo, hi], "method": "Newcombe hybrid score"}
    return out


async def run(client: Client, args: argparse.Namespace, *, init_from: str = "", init_version: int | None = None,
              state: tuple[str, ...] = (), image_size: int = 64, log: Any = None) -> dict[str, Any]:
    """Create the custom workload, REINFORCE it, and (``--eval-episodes``) evaluate."""
    await client.create_workload(spec(args.name, init_from=init_from, init_version=init_version,
                                      head_hidden=args.head_hidden, state=state, image_size=image_size))
    t0 = time.perf_counter()
    out = await reinforce(client, args.name, iterations=args.iterations, envs=args.envs, group=args.group,
                          steps=args.steps,
                          lr=args.lr, gamma=args.gamma, seed=args.seed, log=log)
    out["reinforce_s"] = round(time.perf_counter() - t0, 1)
    out["settings"] = {k: getattr(args, k) for k in ("iterations", "envs", "group", "steps", "lr", "gamma", "head_hidden")}
    if args.eval_episodes > 0:
        t1 = time.perf_counter()
        out["evaluation"] = await evaluate_pair(client, args.name, 1, out["last"]["version"],
                                                episodes=args.eval_episodes, seed=args.eval_seed)
        out["eval_s"] = round(time.perf_counter() - t1, 1)
    return out


async def run_local(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """A deployment in this process (``ops/bench/learnservice.Service``), ``--demos``
    scripted PushCube demos, an SFT workload of ``--sft-updates`` updates (few: a weak
    start that leaves room), then :func:`run` from its last version."""
    import tempfile

    from joynexus.ops.bench.learning import Plan, make_dataset, train_sft
    from joynexus.ops.bench.learnservice import TENANT, Service

    plan = Plan(ENV, demos=args.demos, updates=args.sft_updates, budget_s=900.0, action_horizon=1,
                head_hidden=args.head_hidden, state=LOCAL_STATE, image_size=LOCAL_IMAGE)
    with tempfile.TemporaryDirectory(prefix="jnx-reinforce-") as tmp:
        async with Service(Path(tmp)) as svc:
            client = await svc.tenant()
            t0 = time.perf_counter()
            info = await asyncio.to_thread(make_dataset, plan, svc.datasets / TENANT / "demos", seed=args.seed)
            log(f"{info.episodes} demos ({info.frames} frames) in {time.perf_counter() - t0:.0f} s")
            sft = await train_sft(client, plan, "sft", "demos", log)
            log(f"SFT: {sft['updates']} updates in {sft['train_s']} s -> v{sft['version']}")
            out = await run(client, args, init_from="sft", init_version=sft["version"],
                            state=LOCAL_STATE, image_size=LOCAL_IMAGE, log=log)
            out["sft"] = {"demos": info.episodes, **sft}
            out["restarts"] = dict(svc.restarts)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--local", action="store_true", help="run a deployment in this process (see the module)")
    p.add_argument("--nats", default=None)
    p.add_argument("--creds", default=None, help="your credentials file (not with --local)")
    p.add_argument("--name", default="reinforce")
    p.add_argument("--init-from", default="", help="an SFT workload of yours to start from")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="envs per shared start (the baseline's group)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--gamma", type=float, default=0.95)
    p.add_argument("--head-hidden", type=int, default=256, help="the head's width (an SFT start's own)")
    p.add_argument("--state", default="", help="the policy's state keys or preset, comma-separated "
                   "(an SFT start's own, e.g. privileged; default: the task's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-episodes", type=int, default=100, help="0: no evaluation")
    p.add_argument("--eval-seed", type=int, default=12345)
    p.add_argument("--demos", type=int, default=10, help="--local: scripted demos for the SFT start")
    p.add_argument("--sft-updates", type=int, default=15, help="--local: the SFT start's updates")
    return p


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    for k in ("iterations", "envs", "steps", "head_hidden", "demos", "sft_updates"):
        if getattr(args, k) < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be at least 1")
    if args.group < 2 or args.envs % args.group:
        raise SystemExit(f"--envs {args.envs} must be a multiple of --group {args.group} (at least 2)")
    if args.local == bool(args.creds):
        raise SystemExit("give either --local or --creds")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    t0, load0 = time.perf_counter(), load()
    if args.local:
        out = await run_local(args, log)
    else:
        client = await Client.connect(args.nats, credentials=args.creds)
        try:
            state = tuple(k for k in args.state.split(",") if k)
            out = await run(client, args, init_from=args.init_from, state=state, log=log)
        finally:
            await client.close()
    out.update(wall_s=round(time.perf_counter() - t0, 1), load_before=load0, load_after=load())
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    asyncio.run(main())
