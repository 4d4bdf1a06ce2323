"""Does the service teach? SFT (and optionally RL) through the SDK on a fresh deployment (JSON).

Per task: the scripted expert writes ``demos`` episodes as a LeRobot dataset
into the tenant's space, an SFT workload trains on it through the SDK until
its planned updates or the budget, and ``Client.evaluate`` runs ``episodes``
episodes pinned to the final version; a plan with ``rl_budget_s`` > 0 then
runs PPO from that version (``init_from_workload``) and evaluates again on
the same seeds. The deployment is the real one in one process, secured, each
role restarted if it crashes (``restarts``), the tenant under its own
credentials. ``train_s`` is wall time from creation to the last update (the
whole service path), ``sft_ci95`` a Wilson 95% interval; a
``base="pretrained"`` plan first makes its base with ``ops/admin/pretrain_base.py``.

The deployment it runs on is :class:`joynexus.ops.bench.learnservice.Service`. See
docs/ARCHITECTURE.md, "Policies that learn" (the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from joynexus.ops.bench.learnservice import TENANT, Service
from joynexus.ops.bench.rlcurve import RLCurve
from joynexus.ops.measure.stats import wilson


@dataclass(frozen=True)
class Plan:
    task: str
    demos: int
    #: Updates asked for (completion_target); training stops earlier at budget_s.
    updates: int
    budget_s: float
    episodes: int = 50
    state: tuple[str, ...] = ("privileged",)
    batch_size: int = 64
    action_horizon: int = 4
    learning_rate: float = 1e-3
    head_hidden: int = 256
    image_size: int = 64
    #: The tenant's head (``WorkloadSpec.action_module``) for SFT and RL, and where a
    #: ``pi05_expert`` reads the state (``WorkloadSpec.expert_state``).
    action_module: str = "oft_mlp"
    expert_state: Literal["prompt", "token"] = "prompt"
    #: The target the issue sets (reported next to the result; None = report only).
    target: float | None = None
    #: RL from the SFT policy: training budget (0 = no RL phase), updates asked for,
    #: rollout shape, learning rate, PPO passes per job, staleness bound, exploration floor.
    rl_budget_s: float = 0.0
    rl_updates: int = 1000
    rl_num_envs: int = 4
    rl_horizon: int = 50
    rl_learning_rate: float = 1e-4
    rl_epochs: int = 1
    rl_staleness: int = 2
    rl_exploration_std: float | None = None
    #: RL: critic-only updates first (None: the spec's default), the adaptive step's
    #: target KL, the discount.
    rl_critic_warmup: int | None = None
    rl_target_kl: float = 0.01
    rl_gamma: float = 0.95
    #: The frozen base: "random" (built from config), "pretrained" (``joynexus base
    #: pretrain`` on this task's renders, made first; ``extra`` may set ``renders`` and
    #: ``pretrain_steps``) or "pi05" (the tiny π0.5 base from config, its specs on
    #: ``pi05-tiny``). Plans of each base run on a fresh deployment of their own.
    base: str = "random"
    #: The plan's name in the report (default: the task).
    key: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


FULL: tuple[Plan, ...] = (
    Plan("PushCube-v1", demos=100, updates=600, budget_s=300.0, target=0.8),
    Plan("PickCube-v1", demos=200, updates=1500, budget_s=900.0, target=0.5, rl_budget_s=1200.0,
         rl_epochs=4),
    # RL with headroom: the same 200 demos, RL from the SFT policy after 300 updates (the
    # full SFT policy succeeds 0.92 of the time: +10 points would be out of reach).
    Plan("PickCube-v1", demos=200, updates=300, budget_s=900.0, rl_budget_s=1200.0, rl_epochs=4,
         key="PickCube-v1/rl-from-300"),
    Plan("StackCube-v1", demos=200, updates=1500, budget_s=900.0),  # report only
    # Images plus joint positions only, on a base pre-trained on PushCube renders.
    Plan("PushCube-v1", demos=100, updates=600, budget_s=300.0, state=("proprio",), image_size=56,
         base="pretrained", key="PushCube-v1/images", target=0.5,
         extra={"renders": 3000, "pretrain_steps": 1500}),
    # The token-reading heads on the PushCube plan (issue 12 item 2): as oft_mlp learns it?
    Plan("PushCube-v1", demos=100, updates=600, budget_s=300.0, action_module="oft_attn",
         key="PushCube-v1/oft_attn"),
    Plan("PushCube-v1", demos=100, updates=600, budget_s=300.0, action_module="gr00t_flow",
         key="PushCube-v1/gr00t_flow"),
    # π0.5's action expert over the tiny π0.5 base's prefix cache, the state also as a suffix
    # token (π0's layout: the frozen random base's prompt digits alone teach it nothing); width
    # 128 so the budget holds its 600 updates. Then the prompt-only head, π0.5 as LeRobot has it.
    Plan("PushCube-v1", demos=100, updates=600, budget_s=300.0, action_module="pi05_expert", base="pi05",
         key="PushCube-v1/pi05_expert", target=0.8, head_hidden=128, expert_state="token"),
    Plan("PushCube-v1", demos=100, updates=600, budget_s=300.0, action_module="pi05_expert", base="pi05",
         key="PushCube-v1/pi05_expert-prompt"),  # report only
)
QUICK: tuple[Plan, ...] = (
    Plan("PushCube-v1", demos=20, updates=150, budget_s=120.0, episodes=10,
         rl_budget_s=60.0, rl_updates=2, rl_num_envs=2, rl_horizon=16),
)


def make_dataset(plan: Plan, root: Path, *, seed: int = 0, progress: Any = None) -> Any:
    from joynexus.agents.envs.lerobot_data import generate_dataset

    return generate_dataset(
        plan.task,
        root,
        episodes=plan.demos,
        obs="rgb",
        image_size=plan.image_size,
        seed=seed,
        state_keys=list(plan.state),
        progress=progress,
    )


async def train_sft(client: Any, plan: Plan, name: str, dataset: str, log: Any) -> dict[str, Any]:
    from joynexus.schemas.workloads import Scheduling, WorkloadSpec

    spec = WorkloadSpec(
        name=name,
        task_type="sft",
        dataset=dataset,
        env=plan.task,
        batch_size=plan.batch_size,
        action_horizon=plan.action_horizon,
        learning_rate=plan.learning_rate,
        head_hidden=plan.head_hidden,
        action_module=plan.action_module,
        expert_state=plan.expert_state,
        base_model="pi05-tiny" if plan.base == "pi05" else "qwen2.5-vl-tiny",
        scheduling=Scheduling(max_in_flight=4, completion_target=plan.updates),
    )
    t0 = time.perf_counter()
    wl = await client.create_workload(spec)
    last_version, t_last = 1, t0
    deadline = t0 + plan.budget_s

    async def follow() -> None:
        nonlocal last_version, t_last
        async for event in wl.events():
            job = event.job
            if job.state == "completed" and job.result_version > last_version:
                last_version, t_last = job.result_version, time.perf_counter()
                if (last_version - 1) % 100 == 0:
                    log(f"{plan.task}: {last_version - 1} updates, {t_last - t0:.0f} s")
                if last_version - 1 >= plan.updates:
                    return
            if job.state == "failed":
                log(f"{plan.task}: job failed: {job.reason}")

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(follow(), max(1.0, deadline - time.perf_counter()))
    with contextlib.suppress(Exception):
        await client.cancel_workload(name)
    return {"updates": last_version - 1, "train_s": round(t_last - t0, 1), "version": last_version}


async def _train_rl(
    client: Any, plan: Plan, name: str, source: str, version: int, log: Any, admin: Any = None,
) -> dict[str, Any]:
    """RL from ``source`` v``version`` through the service until rl_updates or the budget."""
    import orjson

    from joynexus.schemas.workloads import Scheduling, WorkloadSpec

    spec = WorkloadSpec(
        name=name,
        task_type="rl",
        env=plan.task,
        init_from_workload=source,
        init_from=version,
        state=list(plan.state),
        image_size=plan.image_size,
        action_horizon=plan.action_horizon,
        head_hidden=plan.head_hidden,
        action_module=plan.action_module,
        expert_state=plan.expert_state,
        base_model="pi05-tiny" if plan.base == "pi05" else "qwen2.5-vl-tiny",
        num_envs=plan.rl_num_envs,
        horizon=plan.rl_horizon,
        learning_rate=plan.rl_learning_rate,
        exploration_std=plan.rl_exploration_std,
        critic_warmup=plan.rl_critic_warmup,
        target_kl=plan.rl_target_kl,
        gamma=plan.rl_gamma,
        scheduling=Scheduling(
            max_in_flight=2,
            max_active_rollouts=1,
            completion_target=plan.rl_updates,
            max_policy_staleness=plan.rl_staleness,
        ),
    )
    curve = RLCurve(name)
    sub = None
    if admin is not None:  # the operator's view of the run's learning metrics
        async def on_metric(msg: Any) -> None:
            with contextlib.suppress(Exception):
                row = curve.take(orjson.loads(msg.data))
                if row:
                    log(f"{plan.task} RL v{row['version']}: rollouts {row['rollout_success']} "
                        f"value_loss {row['value_loss']} kl {row['kl_after']} lr {row['lr']} "
                        f"clip {row['clip_frac']}")

        sub = await admin.nc.subscribe(admin.names.metrics("learning", TENANT), cb=on_metric)
    t0 = time.perf_counter()
    wl = await client.create_workload(spec)
    last_version, t_last, dropped, failed, forwarded = 1, t0, 0, 0, 0
    deadline = t0 + plan.rl_budget_s

    async def follow() -> None:
        nonlocal last_version, t_last, dropped, failed, forwarded
        async for event in wl.events():
            job = event.job
            if job.state == "needs_actor_forward":
                forwarded += 1
            if job.state == "completed" and (job.result_version or 0) > last_version:
                last_version, t_last = int(job.result_version or 0), time.perf_counter()
                if (last_version - 1) % 10 == 0:
                    log(f"{plan.task} RL: {last_version - 1} updates, {t_last - t0:.0f} s")
                if last_version - 1 >= plan.rl_updates:
                    return
            elif job.state == "dropped":
                dropped += 1
            elif job.state == "failed":
                failed += 1
                log(f"{plan.task} RL: job failed: {job.reason}")

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(follow(), max(1.0, deadline - time.perf_counter()))
    with contextlib.suppress(Exception):
        await client.cancel_workload(name)
    if sub is not None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return {"updates": last_version - 1, "train_s": round(t_last - t0, 1), "version": last_version,
            "dropped": dropped, "failed": failed, "forwarded": forwarded, "curve": curve.rows}


async def run_learning(
    plans: tuple[Plan, ...] | list[Plan],
    *,
    data_dir: str | Path | None = None,
    log: Any = None,
    eval_envs: int = 5,
    eval_seed: int = 12345,
    base_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run every plan on one fresh deployment per base (``Plan.base``); the JSON-able report.

    ``base_dir``: serve this saved base to the "pretrained" plans instead of making one."""
    log = log or (lambda msg: None)
    kinds = list(dict.fromkeys(p.base for p in plans))
    if len(kinds) > 1:
        merged: dict[str, Any] = {"tasks": {}, "plans": []}
        for kind in kinds:
            part = await run_learning(
                [p for p in plans if p.base == kind], log=log, eval_envs=eval_envs, eval_seed=eval_seed,
                data_dir=Path(data_dir) / kind if data_dir else None, base_dir=base_dir,
            )
            merged["tasks"].update(part.pop("tasks"))
            merged["plans"] += part.pop("plans", [])
            merged.setdefault("deployments", {})[kind] = part
            for k, v in part.items():
                merged.setdefault(k, v)
        return merged
    with contextlib.ExitStack() as tmp:
        data = Path(data_dir) if data_dir else Path(tmp.enter_context(
            tempfile.TemporaryDirectory(prefix="jnx-learn-")))
        backbone_path = await _base_for(plans, data, base_dir, log)
        out: dict[str, Any] = {"tasks": {}}
        rl = any(p.rl_budget_s > 0 for p in plans)
        epochs = max((p.rl_epochs for p in plans if p.rl_budget_s > 0), default=1)
        family = "pi05" if plans[0].base == "pi05" else "qwen2_5_vl"
        async with Service(data, rl=rl, ppo_epochs=epochs, backbone_path=backbone_path, family=family) as svc:
            client = await svc.tenant()
            for i, plan in enumerate(plans):
                name = f"ds{i}-{plan.task.split('-')[0].lower()}"
                root = svc.datasets / TENANT / name
                t0 = time.perf_counter()
                info: Any = _reusable(plan, root) if data_dir else None
                if info is None:
                    shutil.rmtree(root, ignore_errors=True)
                    info = await asyncio.to_thread(make_dataset, plan, root)
                else:
                    log(f"{plan.task}: reusing the dataset in {root}")
                gen_s = time.perf_counter() - t0
                log(f"{plan.task}: {info.episodes} demos ({info.frames} frames) in {gen_s:.0f} s")
                res = await train_sft(client, plan, f"sft{i}", name, log)
                t1 = time.perf_counter()
                ev = await client.evaluate(
                    f"sft{i}", version=res["version"], episodes=plan.episodes,
                    env=plan.task, num_envs=eval_envs, seed=eval_seed,
                )
                eval_s = time.perf_counter() - t1
                k = round(ev["success_rate"] * plan.episodes)
                row = {
                    "demos": info.episodes,
                    "updates": res["updates"],
                    "train_s": res["train_s"],
                    "sft_success": round(ev["success_rate"], 4),
                    "sft_ci95": list(wilson(k, int(ev.get("episodes", plan.episodes)))),
                    "episodes": int(ev.get("episodes", plan.episodes)),
                    "frames": info.frames,
                    "state": list(info.spec.state_keys),
                    "batch_size": plan.batch_size,
                    "action_horizon": plan.action_horizon,
                    "head_hidden": plan.head_hidden,
                    "expert_state": plan.expert_state,
                    "budget_s": plan.budget_s,
                    "target": plan.target,
                    "dataset_s": round(gen_s, 1),
                    "eval_s": round(eval_s, 1),
                    "mean_length": round(float(ev.get("mean_length", 0.0)), 2),
                }
                log(f"{plan.task}: {row['sft_success']:.2f} success {row['sft_ci95']} "
                    f"after {row['updates']} updates in {row['train_s']} s")
                if plan.rl_budget_s > 0:
                    row.update(await _rl_phase(client, plan, i, res["version"], ev, log,
                                               eval_envs=eval_envs, eval_seed=eval_seed,
                                               admin=svc.admin))
                out["tasks"][plan.key or plan.task] = {**row, **_base_row(plan, backbone_path)}
            out["restarts"] = dict(svc.restarts)
        out["plans"] = [asdict(p) for p in plans]
        return out


async def _rl_phase(
    client: Any, plan: Plan, i: int, sft_version: int, before: dict[str, Any], log: Any, *,
    eval_envs: int, eval_seed: int, admin: Any = None,
) -> dict[str, Any]:
    """RL from the SFT version; success before (the SFT evaluation: same version, same
    seeds) and after (the final RL version, the same seeds)."""
    res = await _train_rl(client, plan, f"rl{i}", f"sft{i}", sft_version, log, admin=admin)
    t1 = time.perf_counter()
    ev = await client.evaluate(
        f"rl{i}", version=res["version"], episodes=plan.episodes,
        env=plan.task, num_envs=eval_envs, seed=eval_seed,
    )
    n = int(ev.get("episodes", plan.episodes))
    row = {
        "rl_success_before": round(before["success_rate"], 4),
        "rl_success_after": round(ev["success_rate"], 4),
        "rl_ci95_after": list(wilson(round(ev["success_rate"] * n), n)),
        "rl_train_s": res["train_s"],
        "rl_updates": res["updates"],
        "rl_dropped_stale": res["dropped"],
        "rl_failed": res["failed"],
        # RL jobs that went through the actor_forward stage (PPO); the rest trained with AWR.
        "rl_jobs_actor_forward": res["forwarded"],
        "rl_eval_s": round(time.perf_counter() - t1, 1),
        "rl_mean_length_after": round(float(ev.get("mean_length", 0.0)), 2),
        # every 10 updates: rollout success (with exploration) and the PPO statistics
        "rl_curve": res["curve"],
    }
    log(f"{plan.task} RL: {row['rl_success_before']:.2f} -> {row['rl_success_after']:.2f} "
        f"after {row['rl_updates']} updates in {row['rl_train_s']} s")
    return row


async def _base_for(plans: Sequence[Plan], data: Path, base_dir: str | Path | None, log: Any) -> str | None:
    """The saved base the plans' deployment serves (None: the random one from config)."""
    if all(p.base in ("random", "pi05") for p in plans):
        return None
    if base_dir is not None:
        return str(base_dir)
    from joynexus.ops.admin.pretrain_base import make_base

    out = data / "base"
    if not (out / "config.json").is_file():  # a kept --data-dir reuses its base
        shutil.rmtree(out, ignore_errors=True)
        p0 = plans[0]
        t0 = time.perf_counter()
        await asyncio.to_thread(
            make_base, out, tasks=tuple(dict.fromkeys(p.task for p in plans)),
            renders=int(p0.extra.get("renders", 3000)), steps=int(p0.extra.get("pretrain_steps", 1500)),
            image_size=p0.image_size, log=log,
        )
        log(f"pretrained base in {time.perf_counter() - t0:.0f} s at {out}")
    return str(out)


def _base_row(plan: Plan, backbone_path: str | None) -> dict[str, Any]:
    """What the report says of a plan's base (the probe figures of a pre-trained one)."""
    if backbone_path is None:
        return {"base": "pi05-tiny (random)" if plan.base == "pi05" else "random"}
    import json

    from joynexus.ops.admin.pretrain_base import REPORT_FILE

    row: dict[str, Any] = {"base": "pretrained", "base_dir": backbone_path}
    f = Path(backbone_path) / REPORT_FILE
    if f.is_file():
        rep = json.loads(f.read_text())
        row.update(base_render_s=rep.get("render_s"), base_train_s=rep.get("train_s"),
                   base_renders=rep.get("renders"), base_steps=rep.get("steps"),
                   base_probe_random=rep.get("probe_random", {}).get(plan.task),
                   base_probe_pretrained=rep.get("probe_pretrained", {}).get(plan.task))
    return row


def _reusable(plan: Plan, root: Path) -> Any:
    """The dataset a previous run with this ``--data-dir`` left at ``root``, if it is
    the plan's (task, demos, image size, state); None otherwise."""
    import json
    from types import SimpleNamespace

    from joynexus.agents.envs.lerobot_data import read_observation_meta
    from joynexus.agents.envs.maniskill import resolve_state_keys

    try:
        info = json.loads((root / "meta" / "info.json").read_text())
        obs = read_observation_meta(root) or {}
        keys = list(obs.get("state_keys") or [])
        if (obs.get("task") != plan.task or int(info["total_episodes"]) != plan.demos
                or obs.get("image_size") != plan.image_size
                or keys != list(resolve_state_keys(plan.task, list(plan.state)))):
            return None
        return SimpleNamespace(episodes=plan.demos, frames=int(info["total_frames"]),
                               spec=SimpleNamespace(state_keys=tuple(keys)))
    except Exception:
        return None


def plans_for(quick: bool, tasks: list[str] | None = None) -> tuple[Plan, ...]:
    plans = QUICK if quick else FULL
    if tasks:
        known = {p.key or p.task: p for p in (*FULL, *QUICK)}
        chosen = [p for p in plans if (p.key or p.task) in tasks]  # a keyed plan by its key only
        chosen += [known[t] for t in tasks if t not in {p.key or p.task for p in chosen} and t in known]
        plans = tuple(chosen)
    return plans


__all__ = ["FULL", "QUICK", "Plan", "make_dataset", "plans_for", "run_learning", "train_sft", "wilson"]
