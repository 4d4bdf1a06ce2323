"""``joynexus bench primitives``: a training client's ``forward_backward`` +
``optim_step`` round trip against the same step done by a built-in ``sft``
workload at the same batch size (issue 28's target: at most 2x).

One in-process deployment (scheduler, control plane, actor on the tiny
backbone) on the given server; tenant ``prim`` drives a ``custom`` workload,
tenant ``base`` feeds a ``source="tenant"`` SFT workload (its dataset space holds
only a layout: ``meta/info.json`` of the same cameras, state and actions). Arms
interleaved round by round (order flipped each round): the primitives arm
awaits ``forward_backward`` then ``optim_step``; the SFT arm submits a batch and
waits for its job's completion (after the version its step publishes). Reports p50s per call, the round
trip's p50 and its ratio to the SFT step's with a paired bootstrap interval.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.agents.actor.agent import Actor
from joynexus.agents.control import ControlPlane
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.producers import PolicyInitializer
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.broker.layout import ensure_layout
from joynexus.ops.measure.stats import interleaved_async, load, percentile, ratio_ci
from joynexus.schemas.jobs import JobState
from joynexus.schemas.samples import (
    ACTION,
    ACTIONS_FIELD,
    OBS_IMAGES,
    OBS_STATE,
    STATE_FIELD,
    image_field,
)
from joynexus.schemas.workloads import Scheduling, WorkloadSpec
from joynexus.sdk import Client

__all__ = ["bench_primitives", "write_layout"]

CAMERA, STATE_DIM, ACTION_DIM, HORIZON, SIDE = "base_camera", 9, 4, 2, 64


def write_layout(root: Path) -> None:
    """A dataset space holding only the layout an SFT workload reads (PushCube's)."""
    (root / "meta").mkdir(parents=True, exist_ok=True)
    feats = {f"{OBS_IMAGES}.{CAMERA}": {"shape": [SIDE, SIDE, 3]}, OBS_STATE: {"shape": [STATE_DIM]},
             ACTION: {"shape": [ACTION_DIM]}}
    (root / "meta" / "info.json").write_text(json.dumps({"features": feats}))


def _batch(rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        image_field(CAMERA): rng.integers(0, 256, (rows, 3, SIDE, SIDE), dtype=np.uint8),
        STATE_FIELD: rng.normal(size=(rows, STATE_DIM)).astype(np.float32),
        ACTIONS_FIELD: rng.uniform(-1, 1, (rows, HORIZON, ACTION_DIM)).astype(np.float32),
    }


async def bench_primitives(url: str, *, repeats: int = 20, rows: int = 8,
                           progress: bool = True) -> dict[str, Any]:
    ns = f"bprim{uuid.uuid4().hex[:6]}"
    tmp = Path(tempfile.mkdtemp(prefix="jnx-prim-"))
    b = await Broker.connect(url, name="bench-primitives", namespace=ns)
    await ensure_layout(b)
    backbone = await asyncio.to_thread(Backbone.build, BackboneConfig(size="tiny"))
    sched = SchedulerAgent(b, instance="bench-sched", lease_ttl_s=30)
    await sched.start()
    control = ControlPlane(b, init_policy=PolicyInitializer(b), instance="bench-ctl",
                           datasets_root=tmp / "datasets")
    await control.start()
    stop = asyncio.Event()
    actor = Actor(b, backbone, instance="bench-actor", out_dir=tmp / "actor", lease_wait_s=0.05)
    actor_task = asyncio.create_task(actor.run(stop))
    prim = await Client.connect(url, tenant="prim", namespace=ns)
    base = await Client.connect(url, tenant="base", namespace=ns)
    try:
        write_layout(tmp / "datasets" / "base" / "layout")
        await prim.create_workload(WorkloadSpec(name="prim", task_type="custom", env="PushCube-v1",
                                                action_horizon=HORIZON, head_hidden=32, batch_size=rows))
        await base.create_workload(WorkloadSpec(name="sft", task_type="sft", dataset="layout", source="tenant",
                                                action_horizon=HORIZON, head_hidden=32, batch_size=rows,
                                                scheduling=Scheduling(max_in_flight=4)))
        tc = await prim.training_client("prim")
        rng = np.random.default_rng(0)
        fwdbwd: list[float] = []
        optim: list[float] = []

        async def primitives() -> None:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await tc.forward_backward(_batch(rows, rng), loss="bc_mse")
            t1 = loop.time()
            await tc.optim_step(learning_rate=1e-4)
            fwdbwd.append((t1 - t0) * 1e3)
            optim.append((loop.time() - t1) * 1e3)

        completed = asyncio.Event()  # the SFT job's completion: its version is published

        async def on_completed(_msg: Any) -> None:
            completed.set()

        await b.nc.subscribe(b.names.job_subject("base", "*", JobState.COMPLETED), cb=on_completed)

        async def sft() -> None:
            completed.clear()
            await base.submit_sft_batch("sft", _batch(rows, rng))
            await completed.wait()

        samples = await interleaved_async({"primitives": primitives, "sft": sft}, repeats=repeats, warmup=2)
        rt, st = samples["primitives"], samples["sft"]
        point, lo, hi = ratio_ci(rt, st)
        kept = len(rt)
        out = {
            "rows": rows,
            "rounds": kept,
            "fwdbwd_p50_ms": percentile(fwdbwd[-kept:], 50, digits=2),
            "optim_step_p50_ms": percentile(optim[-kept:], 50, digits=2),
            "roundtrip_p50_ms": percentile(rt, 50, digits=2),
            "sft_step_p50_ms": percentile(st, 50, digits=2),
            "ratio": round(point, 3),
            "ratio_ci95": [round(lo, 3), round(hi, 3)],
            "target_ratio": 2.0,
            "load": load(),
        }
        if progress:
            print(f"primitives round trip p50 {out['roundtrip_p50_ms']} ms vs sft step "
                  f"{out['sft_step_p50_ms']} ms: ratio {out['ratio']}")
        return out
    finally:
        await prim.close()
        await base.close()
        stop.set()
        await asyncio.wait([actor_task], timeout=30)
        await control.stop()
        await sched.stop()
        await b.close()
        shutil.rmtree(tmp, ignore_errors=True)
