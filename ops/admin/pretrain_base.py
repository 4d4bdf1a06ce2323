"""``joynexus base pretrain``: make a frozen base whose features see, on a machine with no hub.

A randomly initialised backbone's pooled features hardly say where the cube
is, and no pre-trained image encoder comes without a download, so this
pre-trains the tiny Qwen2.5-VL once on CPU ManiSkill renders (the scripted
expert plus action noise, ground-truth positions as ``LABELS``): the whole
backbone plus a linear read-out per task learn the positions through the
very features the heads read, then the read-outs are dropped and the base is
saved with ``save_pretrained`` (with its BPE tokenizer). A ridge probe on
held-out episodes, random base vs pre-trained, decides; it is written to
``DIR/pretrain_report.json``.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Per task, the ground-truth positions the base learns to read off a render:
#: (state key, first index, count) into ManiSkill's privileged entries.
LABELS: dict[str, tuple[tuple[str, str, int, int], ...]] = {
    "PushCube-v1": (
        ("cube", "extra/obj_pose", 0, 3),
        ("goal", "extra/goal_pos", 0, 3),
        ("tcp", "extra/tcp_pose", 0, 3),
    ),
    # The goal marker is hidden from the sensor cameras: not a target here.
    "PickCube-v1": (
        ("cube", "extra/obj_pose", 0, 3),
        ("tcp", "extra/tcp_pose", 0, 3),
    ),
    "StackCube-v1": (
        ("cube", "extra/cubeA_pose", 0, 3),
        ("cubeB", "extra/cubeB_pose", 0, 3),
        ("tcp", "extra/tcp_pose", 0, 3),
    ),
}
CAMERA = "base_camera"
REPORT_FILE = "pretrain_report.json"


@dataclass
class Renders:
    """Frames of one task: images, ground-truth positions, and which episode each came from."""

    task: str
    instruction: str
    images_N_C_H_W: np.ndarray  # uint8
    labels_N_K: np.ndarray  # float32, metres
    label_names: tuple[str, ...]  # one per 3 columns
    episode_N: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.images_N_C_H_W.shape[0])

    def split(self, test_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
        """Row indices (train, test), split by episode so test scenes are unseen."""
        eps = np.unique(self.episode_N)
        n_test = max(1, round(len(eps) * test_fraction))
        test_eps = set(eps[-n_test:].tolist())
        test = np.array([e in test_eps for e in self.episode_N.tolist()])
        return np.flatnonzero(~test), np.flatnonzero(test)


def collect_renders(
    task: str,
    renders: int,
    *,
    image_size: int,
    seed: int = 0,
    noise: float = 0.15,
    max_steps: int = 30,
    progress: Callable[[int, int], None] | None = None,
) -> Renders:
    """``renders`` frames of ``task``: the scripted expert plus Gaussian action noise
    (``noise`` in normalised action units; a quarter of the episodes twice as noisy),
    episodes cut at ``max_steps`` (more, shorter episodes: more distinct scenes)."""
    from joynexus.agents.envs.experts import ScriptedExpert
    from joynexus.agents.envs.maniskill import (
        OBS_STATE,
        TASKS,
        episode_seed,
        make_env,
        state_key_dims,
    )
    from joynexus.schemas.errors import InvalidSpec

    if task not in LABELS:
        raise InvalidSpec(f"base pretrain: no labels for {task!r}; choose from {sorted(LABELS)}")
    if renders < 2:
        raise InvalidSpec(f"renders={renders}: need at least 2 frames")
    keys = tuple(dict.fromkeys(k for _, k, _, _ in LABELS[task]))
    env = make_env(task, obs="rgb", image_size=image_size, cameras=[CAMERA], state_keys=keys)
    dims = state_key_dims(task)
    offsets, at = {}, 0
    for k in env.spec.state_keys:
        offsets[k] = at
        at += dims[k]
    cols = [offsets[k] + i + j for _, k, i, n in LABELS[task] for j in range(n)]
    rng = np.random.default_rng(seed)
    images: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    episodes: list[int] = []
    try:
        expert = ScriptedExpert(env)
        ep = 0
        while len(images) < renders:
            obs = env.reset([episode_seed(seed, 0, ep)])
            sigma = noise * (2.0 if ep % 4 == 3 else 1.0)
            for _ in range(min(max_steps, env.spec.max_episode_steps)):
                images.append(np.asarray(obs[f"observation.images.{CAMERA}"][0]).copy())
                labels.append(np.asarray(obs[OBS_STATE][0], dtype=np.float32)[cols])
                episodes.append(ep)
                if progress is not None:
                    progress(len(images), renders)
                if len(images) >= renders:
                    break
                a = expert.actions()
                a = np.clip(a + rng.normal(0.0, sigma, a.shape), -1.0, 1.0).astype(np.float32)
                res = env.step(a)
                obs = res.obs
                if bool(res.terminated_N[0] or res.truncated_N[0]):
                    break
            ep += 1
    finally:
        env.close()
    return Renders(
        task=task,
        instruction=TASKS[task].instruction,
        images_N_C_H_W=np.stack(images),
        labels_N_K=np.stack(labels).astype(np.float32),
        label_names=tuple(name for name, *_ in LABELS[task]),
        episode_N=np.asarray(episodes, dtype=np.int64),
    )


def _inputs(backbone: Any, images_N_C_H_W: np.ndarray, instruction: str) -> Any:
    from joynexus.agents.models.backbone_inputs import BackboneInputs

    n = int(images_N_C_H_W.shape[0])
    ids, lengths = backbone.tokenize([instruction] * n, 1)
    pv, thw = backbone.process_images({CAMERA: images_N_C_H_W}, (CAMERA,))
    return BackboneInputs(ids, lengths, pv, thw, 1)


def features(backbone: Any, data: Renders, rows: np.ndarray | None = None, batch: int = 128) -> np.ndarray:
    """Frozen ``feats_B_D`` (what the heads read) of the frames ``rows`` (default all)."""
    idx = np.arange(len(data)) if rows is None else rows
    out = [
        backbone.forward(_inputs(backbone, data.images_N_C_H_W[idx[i : i + batch]], data.instruction)).numpy()
        for i in range(0, len(idx), batch)
    ]
    return np.concatenate(out).astype(np.float64)


def ridge_probe(
    x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, alpha: float = 1e-2
) -> np.ndarray:
    """Held-out error of a ridge regression (standardised inputs): per-column RMSE."""
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-8
    a, b = (x_train - mu) / sd, (x_test - mu) / sd
    ym = y_train.mean(0)
    a1 = np.concatenate([a, np.ones((a.shape[0], 1))], 1)
    b1 = np.concatenate([b, np.ones((b.shape[0], 1))], 1)
    reg = alpha * a.shape[0] * np.eye(a1.shape[1])
    reg[-1, -1] = 0.0
    w = np.linalg.solve(a1.T @ a1 + reg, a1.T @ (y_train - ym))
    err = b1 @ w + ym - y_test
    return np.sqrt((err**2).mean(0))


def probe_report(backbone: Any, data: Renders) -> dict[str, Any]:
    """Probe errors (cm, xy plane) per labelled position, and the mean-guess baseline."""
    tr, te = data.split()
    f = features(backbone, data)
    y = data.labels_N_K.astype(np.float64)
    rmse = ridge_probe(f[tr], y[tr], f[te], y[te])
    guess = np.sqrt(((y[te] - y[tr].mean(0)) ** 2).mean(0))
    out: dict[str, Any] = {}
    for i, name in enumerate(data.label_names):
        xy = slice(3 * i, 3 * i + 2)
        out[f"{name}_xy_cm"] = round(100.0 * float(np.sqrt((rmse[xy] ** 2).mean())), 2)
        out[f"{name}_xy_guess_cm"] = round(100.0 * float(np.sqrt((guess[xy] ** 2).mean())), 2)
    out["train_frames"], out["test_frames"] = len(tr), len(te)
    return out


def pretrain(
    backbone: Any,
    datasets: Sequence[Renders],
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Train the whole backbone in place to predict each task's positions from its
    pooled features (one linear read-out per task, dropped afterwards); training
    rows only (``Renders.split``). Leaves the backbone frozen and in eval mode."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    d = backbone.feature_dim
    rows, ys, heads = [], [], []
    for data in datasets:
        tr, _ = data.split()
        y = data.labels_N_K[tr]
        mu, sd = y.mean(0), y.std(0) + 1e-6
        rows.append(tr)
        ys.append(torch.from_numpy((data.labels_N_K - mu) / sd).float())
        lin = torch.nn.Linear(d, y.shape[1])
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.02, generator=gen)
            lin.bias.zero_()
        heads.append(lin)
    model = backbone.model
    model.requires_grad_(True)
    model.train()
    params = [p for p in model.parameters()] + [p for h in heads for p in h.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
    )
    losses: list[float] = []
    try:
        for step in range(steps):
            k = step % len(datasets)
            data = datasets[k]
            pick = rng.choice(rows[k], size=min(batch_size, len(rows[k])), replace=False)
            inputs = _inputs(backbone, data.images_N_C_H_W[pick], data.instruction)
            feats_B_D = backbone.pool(*backbone.hidden_states(inputs))
            loss = torch.nn.functional.mse_loss(heads[k](feats_B_D), ys[k][pick])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(step + 1, steps, float(np.mean(losses[-20:])))
    finally:
        model.eval()
        model.requires_grad_(False)
    return losses


def make_base(
    out: str | Path,
    *,
    tasks: Sequence[str] = ("PushCube-v1",),
    renders: int = 3000,
    steps: int = 1500,
    batch_size: int = 32,
    lr: float = 1e-3,
    image_size: int = 56,
    size: str = "tiny",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Render, pre-train, measure, save. Returns the report (also ``DIR/pretrain_report.json``)."""
    from joynexus.agents.models.backbone import Backbone
    from joynexus.agents.models.backbone_config import BackboneConfig
    from joynexus.ops.admin.progress import Progress
    from joynexus.schemas.errors import InvalidSpec

    say = log or (lambda m: None)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InvalidSpec(f"base pretrain: {out} exists and is not empty; give a new directory")
    if steps < 1 or renders < 10:
        raise InvalidSpec(f"base pretrain: steps={steps} must be >= 1 and renders={renders} >= 10")
    unknown = [t for t in tasks if t not in LABELS]
    if unknown or not tasks:
        raise InvalidSpec(f"base pretrain: tasks {unknown or '(none)'}: choose from {sorted(LABELS)}")
    t0 = time.perf_counter()
    datasets: list[Renders] = []
    for task in tasks:
        bar = Progress(renders, f"render {task}") if progress else None
        cb = (lambda kept, total, bar=bar: bar(kept, kept)) if bar else None  # type: ignore[misc]
        datasets.append(collect_renders(task, renders, image_size=image_size, seed=seed, progress=cb))
        if bar:
            bar.done()
    render_s = time.perf_counter() - t0
    say(f"rendered {sum(len(d) for d in datasets)} frames in {render_s:.0f} s "
        f"({sum(len(d) for d in datasets) / max(render_s, 1e-9):.1f}/s)")
    cfg = BackboneConfig(size=size, image_size=image_size, seed=seed)  # type: ignore[arg-type]
    backbone = Backbone.build(cfg)
    before = {d.task: probe_report(backbone, d) for d in datasets}
    say(f"random base probe: {json.dumps(before)}")
    t1 = time.perf_counter()
    bar2 = Progress(steps, "pretrain") if progress else None

    def tick(step: int, total: int, loss: float) -> None:
        if bar2 is not None:
            bar2.label = f"pretrain loss {loss:.3f}"
            bar2(step, step)

    losses = pretrain(backbone, datasets, steps=steps, batch_size=batch_size, lr=lr, seed=seed, progress=tick)
    if bar2 is not None:
        bar2.done()
    train_s = time.perf_counter() - t1
    backbone.save(out)
    # Measured on the base as the service will load it (from_pretrained from DIR, frozen).
    served = Backbone.build(BackboneConfig(size=size, path=str(out)))  # type: ignore[arg-type]
    after = {d.task: probe_report(served, d) for d in datasets}
    say(f"pretrained base probe: {json.dumps(after)}")
    report = {
        "out": str(out),
        "tasks": list(tasks),
        "renders": {d.task: len(d) for d in datasets},
        "render_s": round(render_s, 1),
        "renders_per_s": round(sum(len(d) for d in datasets) / max(render_s, 1e-9), 1),
        "steps": steps,
        "batch_size": batch_size,
        "train_s": round(train_s, 1),
        "loss_first": round(float(np.mean(losses[:20])), 4),
        "loss_last": round(float(np.mean(losses[-20:])), 4),
        "probe_random": before,
        "probe_pretrained": after,
        "image_size": image_size,
        "size": size,
        "tokenizer_vocab": len(backbone.tokenizer),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def run_in_thread(**kw: Any) -> Any:
    """``make_base`` from async code (benchmarks)."""
    return asyncio.to_thread(make_base, **kw)


__all__ = ["LABELS", "Renders", "collect_renders", "features",
           "make_base", "pretrain", "probe_report", "ridge_probe"]
