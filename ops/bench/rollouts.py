"""``joynexus bench rollouts``: aggregate environment steps/s with 1, 2 and 3 RL
tenants at once, each with an environment worker process of its own.

There is no trainer: a sink drops every job once its rollout is in the
Training Queue, so admission never holds a worker back and the figure is the
simulators' and the inference engine's. Steps come from the workers' rollout
busy intervals inside a window that opens once every tenant of the round
finished its first rollout (env build and first policy load excluded). What
limits it here is the cores: simulators, renderers and the engine share two.

See docs/ARCHITECTURE.md, "Environment workers" (the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.layout import ensure_layout
from joynexus.schemas.jobs import GlobalLimits, JobState
from joynexus.schemas.workloads import Scheduling, WorkloadSpec

TASKS = ("PickCube-v1", "PushCube-v1", "StackCube-v1")
ROLES = ("scheduler", "control", "inference", "producer-rl")


async def _sink(sched: SchedulerClient, tenants: list[str], stop: asyncio.Event) -> None:
    """Drop every job whose rollout is done (frees its admission slot)."""
    while not stop.is_set():
        for t in tenants:
            with contextlib.suppress(Exception):
                for j in await sched.list_jobs(t, states=[JobState.NEEDS_ADVANTAGES]):
                    await sched.drop(j.job_id, "bench rollouts: sink")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def bench_rollouts(
    url: str,
    *,
    seconds: float = 20.0,
    num_envs: int = 2,
    horizon: int = 8,
    max_tenants: int = 3,
    progress: bool = True,
) -> dict[str, Any]:
    from joynexus.ops.mainjob.deployment import RoleProcesses, wait_ready

    with tempfile.TemporaryDirectory(prefix="jnx-rollouts-") as tmp:
        ns = f"roll{uuid.uuid4().hex[:6]}"
        dep = RoleProcesses(url, ns, Path(tmp), env_workers=max_tenants)
        dep.roles = ROLES
        b = await Broker.connect(url, name=f"bench-{ns}", namespace=ns)
        events: list[dict[str, Any]] = []

        async def on_metric(msg: Any) -> None:
            with contextlib.suppress(Exception):
                m = orjson.loads(msg.data)
                if m.get("service") == "env" and "busy_start" in m:
                    events.append(m)

        try:
            await ensure_layout(b)
            ready = asyncio.ensure_future(wait_ready(b, dep, timeout_s=300))
            await asyncio.sleep(0.2)
            dep.start()
            if progress:
                print("  starting the deployment and 3 warm environment workers ...",
                      file=sys.stderr, flush=True)
            await ready
            sched = SchedulerClient(b, by="bench-rollouts")
            await sched.set_limits(GlobalLimits(max_active_rollouts=max_tenants))
            sub = await b.nc.subscribe(b.names.metrics("system"), cb=on_metric)
            steps_per_s: dict[str, float] = {}
            rollouts_per_s: dict[str, float] = {}
            for n in range(1, max_tenants + 1):
                tenants = [f"r{n}t{i}" for i in range(n)]
                clients = [await dep.tenant(b, t) for t in tenants]
                stop = asyncio.Event()
                sink = asyncio.create_task(_sink(sched, tenants, stop))
                try:
                    for i, c in enumerate(clients):
                        await c.create_workload(WorkloadSpec(
                            name="roll", task_type="rl", env=TASKS[i % len(TASKS)],
                            num_envs=num_envs, horizon=horizon, action_horizon=2, seed=i,
                            scheduling=Scheduling(max_in_flight=4, max_active_rollouts=1),
                        ))
                    # The window opens once every tenant finished a rollout.
                    deadline = time.time() + 300
                    while {e.get("tenant") for e in events} < set(tenants):
                        dep.check_alive()
                        if time.time() > deadline:
                            raise TimeoutError(f"{n} tenants: no rollouts after 300 s")
                        await asyncio.sleep(0.2)
                    w0 = time.time()
                    await asyncio.sleep(seconds)
                    w1 = time.time()
                finally:
                    for c in clients:
                        with contextlib.suppress(Exception):
                            await c.cancel_workload("roll")
                        await c.close()
                    stop.set()
                    await sink
                steps = rollouts = 0.0
                for e in events:
                    if e.get("tenant") not in tenants:
                        continue
                    s0, s1 = float(e["busy_start"]), float(e["busy_end"])
                    share = max(0.0, min(s1, w1) - max(s0, w0)) / max(s1 - s0, 1e-9)
                    steps += share * float(e.get("steps", 0))
                    rollouts += share
                steps_per_s[str(n)] = round(steps / (w1 - w0), 2)
                rollouts_per_s[str(n)] = round(rollouts / (w1 - w0), 3)
                if progress:
                    print(f"  {n} tenant(s): {steps_per_s[str(n)]} env steps/s, "
                          f"{rollouts_per_s[str(n)]} rollouts/s", file=sys.stderr, flush=True)
                await asyncio.sleep(2.0)  # the workers go back to standby
            await sub.unsubscribe()
        finally:
            dep.stop()
            await b.close()
    one = steps_per_s.get("1") or 0.0
    return {
        "steps_per_s": steps_per_s,
        "rollouts_per_s": rollouts_per_s,
        "ratios_vs_1": {k: round(v / one, 3) if one else None for k, v in steps_per_s.items()},
        "ratio_3_vs_1": round(steps_per_s.get("3", 0.0) / one, 3) if one else None,
        "window_s": seconds,
        "num_envs": num_envs,
        "horizon": horizon,
        "workers_per_tenant": 1,
        "limits": "CPU cores: every worker's simulator and renderer and the inference engine "
        "share them",
    }
