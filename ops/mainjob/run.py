"""The main job: the paper's mixed workload, then its isolated baseline.

The paper's claim is that sharing the services costs less device time than
giving each tenant its own; this measures it on one deployment (3 RL tenants,
one of them on LIBERO, plus 1 SFT tenant, one process per role) against the
same work one tenant at a time (windows added), with the same environment
workers and per-step settings, both measured only once every role is warm.
Everything comes from the event stream, not guesses: busy intervals per
training step and inference batch, job events, and the polled RSS; device
time is 2 x wall time, ``device_time_ratio`` = isolated / shared (the paper:
1.39x), ``train_util_ratio`` and ``infer_util_ratio`` shared / isolated
(1.99x, 1.33x). On a CPU machine the services share the cores, so busy
intervals stretch; ``*_compute_util_ratio`` uses the CPU seconds they report.

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from joynexus.ops.mainjob.accounting import summarize
from joynexus.ops.mainjob.config import (
    SFT_DATASET,
    SFT_TENANT,
    PaperConfig,
    PhaseResult,
    datasets_root,
    plans,
    round_tenant,
    warmup_plans,
    warmup_round,
)
from joynexus.ops.mainjob.heads import prepare_heads
from joynexus.ops.mainjob.phases import run_phase
from joynexus.ops.mainjob.summary import limits_sentence, planner_prediction, print_summary

NOTES = [
    "Device time: a run holds a training device and an inference device from its first "
    "workload to its last update, so device time = 2 x wall time of the measured windows "
    "(the isolated baseline: the windows of its tenants, one after another, added up). On "
    "this CPU machine the devices are the CPU cores: every service and every environment "
    "worker shares them, and no accelerator sits idle or busy; 'device time' is the wall "
    "time the two services would hold their devices for the same work.",
    "What the ratio shows: how much sooner the same work (the same updates per tenant, the "
    "same environment workers per tenant, the same per-step settings) finishes when the "
    "tenants share one deployment than one after another, so how much less time the "
    "services' devices are held. It does not show an accelerator's utilization: on a "
    "2-core machine the gain comes mostly from overlapping the tenants' simulators with "
    "each other and with training and inference on both cores, which one tenant alone "
    "leaves partly idle while its simulator, its inference request or its training step "
    "waits for the others; a machine with accelerators overlaps different resources.",
    "Start-up is in neither run: both start measuring once every role is up and warm "
    "(backbones built, the environment workers' renderers started) and a warm-up round "
    "(every tenant's workload with a few updates, all at once) has run in its "
    "deployment, so the first measured window pays no first env build, first train "
    "step or first batch that the later ones do not; --repeat N measures N pairs and "
    "reports the median.",
]


async def run_paper(
    url: str, out: Path, cfg: PaperConfig, *, progress: bool = True
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    dataset = datasets_root(out) / SFT_TENANT / SFT_DATASET
    if not (dataset / "meta" / "info.json").exists():
        from joynexus.agents.envs.lerobot_data import generate_dataset

        if progress:
            print(
                f"  generating {cfg.sft_episodes} expert demonstrations (LeRobot format) ...",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.to_thread(
            generate_dataset,
            "PickCube-v1",
            dataset,
            episodes=cfg.sft_episodes,
            obs="rgb",
            image_size=64,
            seed=0,
        )
    rounds = [plans(cfg, SFT_DATASET, r) for r in range(cfg.repeat)]
    warmup = warmup_plans(cfg, SFT_DATASET)
    # The RL tenants' starting heads (made once, then cached), outside both windows.
    heads = await prepare_heads(
        url, out, cfg,
        {p.tenant: p.spec.env for ps in [*rounds, warmup] for p in ps
         if p.spec.init_from_export},
        progress=progress,
    )
    # Each later round's SFT tenant, and the warm-up's, has the dataset in its space.
    for r in [*range(1, cfg.repeat), *([warmup_round(cfg)] if warmup else [])]:
        copy = datasets_root(out) / round_tenant(SFT_TENANT, r) / SFT_DATASET
        if not (copy / "meta" / "info.json").exists():
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(dataset, copy)
    shared = await run_phase(
        url, out, "shared", rounds, isolated=False, cfg=cfg, progress=progress, warmup=warmup
    )
    isolated = await run_phase(
        url, out, "isolated", rounds, isolated=True, cfg=cfg, progress=progress, warmup=warmup
    )
    pairs = [summarize(sh, iso) for sh, iso in zip(shared, isolated, strict=True)]
    ratios = [p["device_time_ratio"] for p in pairs]
    # The details of the median pair (the lower middle one for an even N).
    order = sorted(range(len(pairs)), key=lambda i: ratios[i] or 0.0)
    mid = order[(len(order) - 1) // 2]
    results = pairs[mid]
    results["device_time_ratios"] = ratios
    results["device_time_ratio"] = round(statistics.median(r or 0.0 for r in ratios), 3)
    results["mean_tenants_per_batch_per_repeat"] = [p["mean_tenants_per_batch"] for p in pairs]
    results["median_repeat"] = mid + 1
    # Outcomes and evaluations come from the first pair (only it is evaluated).
    results["tenants"] = pairs[0]["tenants"]
    results["config"] = asdict(cfg)
    results["starting_heads"] = heads
    results["warmup"] = {"updates_per_tenant": cfg.warmup_updates,
                         "tenants": [p.tenant for p in warmup]}
    results["notes"] = NOTES
    results["peak_rss_mb_total"] = max(results["shared"]["peak_rss_mb_total"],
                                       results["isolated"]["peak_rss_mb_total"])
    results["roles"] = results["shared"]["roles"]
    results["evaluations"] = {  # the learning curves, after the windows
        "peak_rss_mb_total": shared[0].eval_peak_rss_mb_total,
        "peak_rss_mb_evaluator": shared[0].eval_peak_rss_mb_evaluator,
        "wall_s": shared[0].eval_wall_s,
    }
    results["planner"] = planner_prediction(out)
    results["limits"] = limits_sentence(results)
    if progress:
        print(
            "  measuring the shared-forward speedup grid (Figure 10) ...",
            file=sys.stderr,
            flush=True,
        )
    from joynexus.ops.mainjob.group import bench_group

    grid = await asyncio.to_thread(bench_group, quick=True, rss=False)
    results["group_speedup"] = grid["group_speedup"]
    results["loss_curves"] = {
        t: {
            "grouped (shared run)": shared[0].losses.get(t, []),
            "serial (isolated run)": isolated[0].losses.get(t, []),
        }
        for t in shared[0].tenants
    }
    def lanes(r: PhaseResult) -> dict[str, list[tuple[float, float]]]:
        # The services first, then one lane per environment worker.
        return dict(sorted(r.intervals.items(), key=lambda kv: (kv[0].startswith("env "), kv[0])))

    results["timelines"] = {"shared": lanes(shared[mid]), "isolated": lanes(isolated[mid])}
    (out / "report.json").write_text(json.dumps(results, indent=2))
    return results


async def main_job(
    url: str, out: Path, *, minutes: float = 4.0, as_json: bool = False, repeat: int = 1
) -> int:
    cfg = PaperConfig.for_minutes(minutes, repeat=repeat)
    results = await run_paper(url, out, cfg, progress=not as_json)
    with contextlib.suppress(ImportError):
        from joynexus.ops.mainjob.report import write_paper_report

        write_paper_report(out, results)
    if as_json:
        print(
            json.dumps(
                {k: v for k, v in results.items() if k not in ("timelines", "loss_curves")},
                indent=2,
            )
        )
    else:
        print_summary(results, out)
    return 0
