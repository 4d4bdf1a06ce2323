"""The main job's starting heads: each ManiSkill RL tenant starts from an SFT head
trained on the task's scripted demonstrations, made once and cached across runs.

Before either measured window opens, :func:`prepare_heads` looks for each head in
the cache (``$JOYNEXUS_CACHE``, else ``~/.cache/joynexus``, under ``main-job-heads/``,
one directory per recipe and the versions of the code that shaped it). What is
missing it makes through the service like any tenant would: the scripted expert
writes the demonstrations (LeRobot format), one deployment trains an SFT workload
per task (both at once, on the same actor), and ``Client.export`` writes the head.
Each round's RL tenant then finds a copy in its own dataset space
(``heads/<task>``) and names it as ``WorkloadSpec.init_from_export``, so both the
shared and the isolated run start from the same weights and no window pays for
the SFT. A reader of the report sees the policies' success held or rising over
the RL updates instead of three flat zero curves.

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from joynexus.ops.mainjob.config import HEADS_DIR, RECIPES, TenantPlan, datasets_root
from joynexus.ops.mainjob.deployment import RoleProcesses, wait_ready
from joynexus.ops.mainjob.phases import run_tenants

CACHE_ENV = "JOYNEXUS_CACHE"
#: Bumped when what a cached head means changes (the recipe's fields cover the rest).
CACHE_FORMAT = 1


@dataclass(frozen=True)
class HeadRecipe:
    """How one task's starting head is made: demonstrations, then SFT updates."""

    task: str
    demos: int
    updates: int
    action_horizon: int
    state: tuple[str, ...] = ("privileged",)
    image_size: int = 64
    batch_size: int = 32
    learning_rate: float = 1e-3
    head_hidden: int = 256
    action_module: str = "oft_mlp"
    base_model: str = "qwen2.5-vl-tiny"
    seed: int = 0

    def key(self) -> str:
        """The recipe and the versions of the code that shape its weights (the
        base is built from a seeded config, so the same versions build the same base)."""
        versions = {}
        for dist in ("joynexus", "torch", "transformers", "mani_skill"):
            try:
                versions[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                versions[dist] = ""
        blob = json.dumps({"format": CACHE_FORMAT, **asdict(self), **versions}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def recipes(action_horizon: int, scale: float = 1.0) -> list[HeadRecipe]:
    """The recipes, demonstrations and updates scaled by ``scale`` (the shortest
    runs make tiny heads: they show the path, not a policy)."""
    return [
        HeadRecipe(task, max(2, round(d * scale)), max(2, round(u * scale)), action_horizon)
        for task, (d, u) in RECIPES.items()
    ]


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "joynexus")
    return Path(root) / "main-job-heads"


def cached(recipe: HeadRecipe) -> Path:
    """The cache entry's directory (complete once its ``recipe.json`` exists)."""
    return cache_root() / f"{recipe.task}-{recipe.key()}"


def is_cached(recipe: HeadRecipe) -> bool:
    d = cached(recipe)
    return all((d / f).is_file() for f in ("head.safetensors", "manifest.json", "recipe.json"))


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"  {text}", file=sys.stderr, flush=True)


def _generate(recipe: HeadRecipe, root: Path, progress: bool) -> float:
    """The recipe's demonstrations as a LeRobot dataset at ``root`` (seconds taken)."""
    if (root / "meta" / "info.json").is_file():
        return 0.0
    # One progress line of ours, not one bar per episode written.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from joynexus.agents.envs.lerobot_data import generate_dataset

    shutil.rmtree(root, ignore_errors=True)
    t0 = time.time()
    last = [0.0]

    def tick(kept: int, attempts: int) -> None:
        if progress and (time.time() - last[0] > 5 or kept == recipe.demos):
            last[0] = time.time()
            print(f"\r  {recipe.task}: {kept}/{recipe.demos} demonstrations ({attempts} tried, "
                  f"{time.time() - t0:.0f} s)   ", end="" if kept < recipe.demos else "\n",
                  file=sys.stderr, flush=True)

    generate_dataset(
        recipe.task, root, episodes=recipe.demos, obs="rgb", image_size=recipe.image_size,
        seed=recipe.seed, state_keys=list(recipe.state), progress=tick,
    )
    return round(time.time() - t0, 1)


async def _train(url: str, out: Path, todo: list[HeadRecipe], cfg: Any, progress: bool) -> None:
    """One deployment, one SFT tenant per recipe (all at once); each head exported
    into the cache when its updates are done."""
    from joynexus.broker.connection import Broker
    from joynexus.broker.layout import delete_layout, ensure_layout
    from joynexus.schemas.workloads import Scheduling, WorkloadSpec

    root = datasets_root(out)
    gen_s = {}
    for r in todo:
        gen_s[r.task] = await asyncio.to_thread(
            _generate, r, root / _tenant(r) / f"demos-{r.task}", progress)
    ns = f"head{uuid.uuid4().hex[:6]}"
    dep = RoleProcesses(url, ns, out, env_workers=0)
    b = await Broker.connect(url, name=f"paper-{ns}", namespace=ns)
    try:
        await ensure_layout(b)
        ready = asyncio.ensure_future(wait_ready(b, dep))
        await asyncio.sleep(0.2)
        dep.start()
        await ready
        plans = [
            TenantPlan(
                _tenant(r),
                WorkloadSpec(
                    name="sft", task_type="sft", dataset=f"demos-{r.task}",
                    batch_size=r.batch_size, learning_rate=r.learning_rate,
                    action_horizon=r.action_horizon, image_size=r.image_size,
                    head_hidden=r.head_hidden, action_module=r.action_module,
                    base_model=r.base_model, seed=r.seed,
                    scheduling=Scheduling(max_in_flight=4, completion_target=r.updates),
                ),
                r.updates,
            )
            for r in todo
        ]
        t0, t1 = await run_tenants(
            b, dep, plans, "sft heads", cfg.phase_timeout_s, progress)
        for r, p in zip(todo, plans, strict=True):
            dest = cached(r)
            tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            async with await dep.tenant(b, p.tenant) as c:
                await c.export("sft", tmp)
            info = {**asdict(r), "key": r.key(), "demos_s": gen_s[r.task],
                    "train_s": round(t1 - t0, 1), "made_at": time.time()}
            (tmp / "recipe.json").write_text(json.dumps(info, indent=2))
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
            _say(progress, f"{r.task}: SFT head cached at {dest}")
    finally:
        dep.stop()
        try:
            await delete_layout(b)
        finally:
            await b.close()


def _tenant(r: HeadRecipe) -> str:
    return "sft" + "".join(c for c in r.task.lower() if c.isalnum())[:20]


async def prepare_heads(
    url: str, out: Path, cfg: Any, tenants: dict[str, str], *, progress: bool = True
) -> dict[str, dict[str, Any]]:
    """Each task's starting head, made if not cached, then copied into each RL
    tenant's dataset space (``tenants``: tenant -> task; tasks without a recipe are
    left out). Returns per task what the report says about it."""

    todo = {r.task: r for r in recipes(cfg.action_horizon, cfg.head_scale)}
    missing = [r for r in todo.values() if not is_cached(r)]
    if missing:
        _say(progress, "making the RL tenants' starting heads (SFT on scripted demonstrations; "
                       f"cached in {cache_root()} for the next runs) ...")
        await _train(url, out, missing, cfg, progress)
    root = datasets_root(out)
    for tenant, task in tenants.items():
        if task not in todo:
            continue
        dest = root / tenant / HEADS_DIR / task
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(cached(todo[task]), dest)
    report = {}
    for task, r in todo.items():
        info = json.loads((cached(r) / "recipe.json").read_text())
        report[task] = {"demos": r.demos, "updates": r.updates, "cached": r not in missing,
                        "demos_s": info.get("demos_s"), "train_s": info.get("train_s"),
                        "path": str(cached(r))}
    return report


__all__ = ["CACHE_ENV", "HeadRecipe", "cache_root", "prepare_heads", "recipes"]
