"""What the PushCube policy-gradient examples share: the custom workload, rollouts
over ``client.act`` in a PushCube the tenant runs, group baselines, the service's
evaluation of a start and an end version, ``--local`` and the command line.

``reinforce_pushcube.py`` (REINFORCE) and ``grpo_pushcube.py`` (a clipped
importance ratio, several epochs a rollout) differ only in their update, a
:data:`Trainer` handed to :func:`main`. Not a package module: the examples import it
from their own folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.ops.measure.stats import load, newcombe, wilson
from joynexus.schemas.samples import ACTIONS_FIELD, OBS_IMAGES, OBS_STATE, STATE_FIELD, image_field
from joynexus.sdk import Client, WorkloadSpec

ENV = "PushCube-v1"
#: --local: the demos' and the policy's observation (64 px camera, the simulator's
#: object and goal state), as the learning benchmark's PushCube plan has it.
LOCAL_STATE = ("privileged",)
LOCAL_IMAGE = 64

#: An algorithm's training loop on workload ``args.name``: (client, args, log) -> its
#: report, with ``iterations`` (one :func:`iteration_report` each) and ``last``.
Trainer = Callable[[Client, argparse.Namespace, Any], Awaitable[dict[str, Any]]]


def spec(name: str, *, init_from: str = "", init_version: int | None = None, seed: int = 0,
         head_hidden: int = 32, state: tuple[str, ...] = (), image_size: int = 64) -> WorkloadSpec:
    """The custom workload; starting from an SFT workload it must have that one's head
    width and sample layout (action horizon 1: each step's one action is sampled)."""
    return WorkloadSpec(name=name, task_type="custom", env=ENV, action_horizon=1, head_hidden=head_hidden,
                        seed=seed, init_from_workload=init_from, init_from=init_version,
                        state=list(state), image_size=image_size)


def returns_to_go(rewards_T_N: np.ndarray, gamma: float) -> np.ndarray:
    """Discounted returns from each step to the rollout's end, [T, N]."""
    out = np.zeros_like(rewards_T_N)
    acc = np.zeros(rewards_T_N.shape[1], dtype=np.float32)
    for t in range(len(rewards_T_N) - 1, -1, -1):
        acc = rewards_T_N[t] + gamma * acc
        out[t] = acc
    return out


def group_centred(x_T_N: np.ndarray, group: int) -> np.ndarray:
    """``x`` minus, per step, the mean of its group (envs ``g*group .. g*group+group-1``
    start alike): the baseline only compares rollouts from the same start."""
    t, n = x_T_N.shape
    x = x_T_N.reshape(t, n // group, group)
    return (x - x.mean(axis=2, keepdims=True)).reshape(t, n)


def step_advantages(rewards_T_N: np.ndarray, group: int, gamma: float) -> np.ndarray:
    """Per step: the return-to-go minus its group's mean at that step, over the std of
    all of them (one scale for the batch: a group's own std would blow up the tiny
    differences of a group whose envs all did alike). [T, N]."""
    adv = group_centred(returns_to_go(rewards_T_N, gamma), group)
    return adv / (adv.std() + 1e-6)


def group_seeds(seed: int, iteration: int, envs: int, group: int) -> list[int]:
    """Each iteration's reset seeds: one fresh seed per group, shared by its envs."""
    return [seed + iteration * envs + i // group for i in range(envs)]


def gaussian_logp(mean: np.ndarray, std: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """log N(actions; mean, std) summed over the chunk's steps and dims, [B] (float64)."""
    z = (actions.astype(np.float64) - mean) / std
    per = -0.5 * z * z - np.log(std) - 0.5 * np.log(2 * np.pi)
    return per.reshape(len(per), -1).sum(1)


@dataclass
class Rollout:
    """One rollout of every env: the rows (step-major: row ``t * N + i`` is env ``i``
    at step ``t``), each taken chunk's log-probability under the behaviour policy
    (the ``act`` mean and the std it was sampled with), rewards and success."""

    rows: dict[str, np.ndarray]
    logp_old: np.ndarray  # [T * N]
    rewards: np.ndarray  # [T, N]
    success: np.ndarray  # [N] bool: any step succeeded
    std: np.ndarray  # [A]
    #: [T, N]: the steps up to and with each env's first success (all of a failure):
    #: the evaluation ends an episode there, so what follows it is never scored.
    live: np.ndarray


async def rollout(client: Client, tc: Any, env: Any, workload: str, seeds: list[int], steps: int,
                  rng: np.random.Generator, std: float | None = None) -> Rollout:
    """Reset ``env`` with ``seeds`` and run ``steps`` steps: each step's mean action
    from the Inference Queue (``client.act``, the latest version) plus Gaussian noise
    with the policy's std (one ``forward``: a Gaussian head's std does not depend on
    the observation), or with ``std`` (the client's own, every dimension)."""
    cam = tc.schema.camera_slots[0]
    obs = env.reset(seed=seeds)
    rows: dict[str, list[np.ndarray]] = {image_field(cam): [], STATE_FIELD: [], ACTIONS_FIELD: []}
    logp, rewards, live, success = [], [], [], np.zeros(len(seeds), dtype=bool)
    images, state = obs[f"{OBS_IMAGES}.{cam}"], obs[OBS_STATE]
    own = np.exp((await tc.forward({image_field(cam): images[:1], STATE_FIELD: state[:1]}))["log_std"][0])
    std_A = own if std is None else np.full_like(own, std)
    for _ in range(steps):
        images, state = obs[f"{OBS_IMAGES}.{cam}"], obs[OBS_STATE]
        # the task's instruction, as the service's training calls and evaluation give it (act
        # without one would use the workload's own, empty here: other features, another policy)
        mean = await client.act(workload, images={cam: images}, state=state,
                                instruction=env.spec.instruction)  # [N, 1, A]
        chunk = (mean + std_A * rng.standard_normal(mean.shape)).astype(np.float32)
        logp.append(gaussian_logp(mean, std_A, chunk))
        res = env.step(np.clip(chunk[:, 0], -1.0, 1.0))
        for k, v in ((image_field(cam), images), (STATE_FIELD, state), (ACTIONS_FIELD, chunk)):
            rows[k].append(v)
        rewards.append(np.asarray(res.reward_N, dtype=np.float32))
        live.append(~success)
        success |= np.asarray(res.success_N, dtype=bool)
        obs = res.obs
    return Rollout({k: np.concatenate(v) for k, v in rows.items()}, np.concatenate(logp).astype(np.float32),
                   np.stack(rewards), success, std_A, np.stack(live))


@contextmanager
def pushcube(tc: Any, envs: int, seed: int) -> Iterator[Any]:
    """The tenant's own PushCube envs, in the workload's sample layout."""
    from joynexus.agents.envs.registry import make_env

    sch = tc.schema
    with make_env(ENV, obs="rgb", num_envs=envs, image_size=sch.image_hw[0], seed=seed,
                  cameras=list(sch.camera_slots), state_keys=list(sch.state_keys) or None) as env:
        yield env


def iteration_report(it: int, version: int, ro: Rollout, log: Any = None, **extra: Any) -> dict[str, Any]:
    """One iteration's rollout success (Wilson 95%), mean return, std; logged."""
    n, k = len(ro.success), int(ro.success.sum())
    lo, hi = wilson(k, n)
    out = {"iteration": it, "version": version, "success": k / n, "ci95": [lo, hi], "episodes": n,
           "mean_return": round(float(ro.rewards.sum(0).mean()), 3), "std": round(float(ro.std.mean()), 4),
           **extra}
    if log is not None:
        more = "".join(f", {k} {v}" for k, v in extra.items())
        log(f"iteration {it}: v{version} rollout success {k}/{n}, return {out['mean_return']}, "
            f"std {out['std']}{more}")
    return out


def pooled_rollouts(rates: list[dict[str, Any]]) -> dict[str, Any]:
    """The sampled policy's success over the first and the last quarter of the
    iterations' rollouts, pooled, with Wilson 95% intervals (other starts than the
    evaluation's, and the exploration noise: the policy RL improves)."""
    q = max(1, len(rates) // 4)
    out = {}
    for key, part in (("first", rates[:q]), ("last", rates[-q:])):
        n = sum(r["episodes"] for r in part)
        k = round(sum(r["success"] * r["episodes"] for r in part))
        out[key] = {"iterations": [part[0]["iteration"], part[-1]["iteration"]], "success": round(k / n, 4),
                    "ci95": list(wilson(k, n)), "episodes": n}
    return out


async def evaluate(client: Client, workload: str, version: int, *, episodes: int, seed: int = 12345,
                   num_envs: int = 10) -> dict[str, Any]:
    """The service's evaluation of one version (the mean action) on ``episodes`` seeds."""
    ev = await client.evaluate(workload, version=version, episodes=episodes, num_envs=min(num_envs, episodes),
                               seed=seed)
    n = int(ev.get("episodes", episodes))
    k = round(float(ev["success_rate"]) * n)
    return {"version": version, "success": round(k / n, 4), "ci95": list(wilson(k, n)), "episodes": n}


def compare(start: dict[str, Any], end: dict[str, Any], *, seed: int) -> dict[str, Any]:
    """Both evaluations with end minus start and Newcombe's 95% interval."""
    k0, n0 = round(start["success"] * start["episodes"]), start["episodes"]
    k1, n1 = round(end["success"] * end["episodes"]), end["episodes"]
    d, lo, hi = newcombe(k1, n1, k0, n0)
    return {"episodes": n0, "eval_seed": seed, "policy": "mean action", "start": start, "end": end,
            "difference": {"end_minus_start": d, "ci95": [lo, hi], "method": "Newcombe hybrid score"}}


async def evaluate_pair(client: Client, workload: str, start: int, end: int, *, episodes: int,
                        seed: int = 12345, num_envs: int = 10) -> dict[str, Any]:
    """Both versions evaluated by the service on the same ``episodes`` seeds (the mean
    action): their success with Wilson 95% intervals, end minus start with Newcombe's."""
    a = await evaluate(client, workload, start, episodes=episodes, seed=seed, num_envs=num_envs)
    b = await evaluate(client, workload, end, episodes=episodes, seed=seed, num_envs=num_envs)
    return compare(a, b, seed=seed)


async def run(client: Client, args: argparse.Namespace, train: Trainer, *, init_from: str = "",
              init_version: int | None = None, state: tuple[str, ...] = (), image_size: int = 64,
              log: Any = None) -> dict[str, Any]:
    """Create the custom workload, evaluate its start (``--eval-episodes``; first: the
    policy store keeps only the latest versions, and an update publishes one), train
    it, then evaluate the last version on the same seeds."""
    await client.create_workload(spec(args.name, init_from=init_from, init_version=init_version,
                                      head_hidden=args.head_hidden, state=state, image_size=image_size))
    start, eval_s = None, 0.0
    if args.eval_episodes > 0:
        t0 = time.perf_counter()
        start = await evaluate(client, args.name, 1, episodes=args.eval_episodes, seed=args.eval_seed)
        eval_s = time.perf_counter() - t0
        if log is not None:
            log(f"start v1: {start['success']} {start['ci95']}")
    t0 = time.perf_counter()
    out = await train(client, args, log)
    out["train_s"] = round(time.perf_counter() - t0, 1)
    out["rollouts"] = pooled_rollouts(out["iterations"])
    if start is not None:
        t1 = time.perf_counter()
        end = await evaluate(client, args.name, out["last"]["version"], episodes=args.eval_episodes,
                             seed=args.eval_seed)
        out["evaluation"] = compare(start, end, seed=args.eval_seed)
        out["eval_s"] = round(eval_s + time.perf_counter() - t1, 1)
    return out


async def run_local(args: argparse.Namespace, train: Trainer, log: Any) -> dict[str, Any]:
    """A deployment in this process (``ops/bench/learnservice.Service``), ``--demos``
    scripted PushCube demos, an SFT workload of ``--sft-updates`` updates (few: a weak
    start that leaves room), then :func:`run` from its last version."""
    import tempfile

    from joynexus.ops.bench.learning import Plan, make_dataset, train_sft
    from joynexus.ops.bench.learnservice import TENANT, Service

    plan = Plan(ENV, demos=args.demos, updates=args.sft_updates, budget_s=900.0, action_horizon=1,
                head_hidden=args.head_hidden, state=LOCAL_STATE, image_size=LOCAL_IMAGE)
    with tempfile.TemporaryDirectory(prefix="jnx-pushcube-") as tmp:
        async with Service(Path(tmp)) as svc:
            client = await svc.tenant()
            t0 = time.perf_counter()
            info = await asyncio.to_thread(make_dataset, plan, svc.datasets / TENANT / "demos", seed=args.seed)
            log(f"{info.episodes} demos ({info.frames} frames) in {time.perf_counter() - t0:.0f} s")
            sft = await train_sft(client, plan, "sft", "demos", log)
            log(f"SFT: {sft['updates']} updates in {sft['train_s']} s -> v{sft['version']}")
            out = await run(client, args, train, init_from="sft", init_version=sft["version"],
                            state=LOCAL_STATE, image_size=LOCAL_IMAGE, log=log)
            out["sft"] = {"demos": info.episodes, **sft}
            out["restarts"] = dict(svc.restarts)
    return out


def parser(description: str, *, name: str, lr: float) -> argparse.ArgumentParser:
    """The options every example takes (an algorithm adds its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--local", action="store_true", help="run a deployment in this process (see the module)")
    p.add_argument("--nats", default=None)
    p.add_argument("--creds", default=None, help="your credentials file (not with --local)")
    p.add_argument("--name", default=name)
    p.add_argument("--init-from", default="", help="an SFT workload of yours to start from")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="envs per shared start (the baseline's group)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=lr)
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


def check(args: argparse.Namespace, positive: tuple[str, ...] = ()) -> None:
    """Refuse settings no run can use (``positive``: an algorithm's own counts)."""
    for k in ("iterations", "envs", "steps", "head_hidden", "demos", "sft_updates", *positive):
        if getattr(args, k) < 1:
            raise SystemExit(f"--{k.replace('_', '-')} must be at least 1")
    if args.group < 2 or args.envs % args.group:
        raise SystemExit(f"--envs {args.envs} must be a multiple of --group {args.group} (at least 2)")
    if args.local == bool(args.creds):
        raise SystemExit("give either --local or --creds")


async def main(args: argparse.Namespace, train: Trainer) -> dict[str, Any]:
    """Run ``train`` (``--local`` or against a deployment) and print the JSON report."""

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    t0, load0 = time.perf_counter(), load()
    if args.local:
        out = await run_local(args, train, log)
    else:
        client = await Client.connect(args.nats, credentials=args.creds)
        try:
            state = tuple(k for k in args.state.split(",") if k)
            out = await run(client, args, train, init_from=args.init_from, state=state, log=log)
        finally:
            await client.close()
    out.update(wall_s=round(time.perf_counter() - t0, 1), load_before=load0, load_after=load())
    print(json.dumps(out, indent=1))
    return out
