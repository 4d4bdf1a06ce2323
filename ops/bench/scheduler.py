"""Training Scheduler throughput: full job lifecycles per second and the
latency of each transition, with the scheduler agent in its own process.

Each lifecycle is six compare-and-append events (reserve -> needs_advantages
-> computing_advantages -> ready -> leased -> completed), driven by synthetic
producers, stage workers and actors in this process. No tensors move (the
Training Queue has its own benchmark), so this measures the scheduler.

See docs/ARCHITECTURE.md, "Measured".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from typing import Any

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.agents.synthetic import SyntheticPipeline
from joynexus.broker.connection import Broker
from joynexus.broker.layout import delete_layout, ensure_layout
from joynexus.ops.measure import stats
from joynexus.ops.measure.stats import percentile
from joynexus.schemas.jobs import GlobalLimits, JobState, TaskType, WorkloadPolicy

TIMED_VERBS = ("reserve", "mark", "lease_stage", "complete")


@contextlib.contextmanager
def scheduler_process(url: str, namespace: str) -> Any:
    """``joynexus agent scheduler`` as a child process."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "joynexus.ops.cli",
            "agent",
            "scheduler",
            "--nats",
            url,
            "--namespace",
            namespace,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _unloaded_latency(b: Broker, tenant: str, *, n: int) -> list[float]:
    """Latency of each transition with one caller and nothing else running."""
    c = SchedulerClient(b, by="bench-seq")
    out: list[float] = []

    async def timed(coro: Any) -> Any:
        t0 = time.perf_counter()
        result = await coro
        out.append(time.perf_counter() - t0)
        return result

    for _ in range(n):
        job = await timed(c.reserve(tenant, "rl"))
        await timed(c.mark(job.job_id, JobState.NEEDS_ADVANTAGES))
        staged = await timed(c.lease_stage(job.job_id, "advantages"))
        await timed(c.mark(job.job_id, JobState.READY, attempt=staged.attempt))
        leased = await timed(c.lease_next())
        await timed(c.complete(leased))
    return out


async def bench_scheduler(
    url: str,
    seconds: float = 10.0,
    *,
    tenants: int = 4,
    producers_per_tenant: int = 4,
    workers: int = 4,
    actors: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    ns = f"bsched{uuid.uuid4().hex[:6]}"
    b = await Broker.connect(url, name="bench-scheduler", namespace=ns)
    await ensure_layout(b)
    try:
        with scheduler_process(url, ns) as proc:
            setup = SchedulerClient(b, by="bench", deadline_s=30)
            await setup.set_limits(
                GlobalLimits(max_active_rollouts=tenants * producers_per_tenant * 2)
            )
            names = [f"t{i}" for i in range(tenants)]
            for i, t in enumerate(names):
                task: TaskType = "rl" if i % 2 == 0 else "sft"
                await setup.set_policy(
                    WorkloadPolicy(
                        tenant_id=t, task_type=task, max_in_flight=64, max_active_rollouts=64
                    )
                )
            unloaded = await _unloaded_latency(b, names[0], n=100)
            pipe = SyntheticPipeline(b, with_data=False, instance="bench")
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(pipe.producer(t, "rl" if i % 2 == 0 else "sft", stop=stop))
                for i, t in enumerate(names)
                for _ in range(producers_per_tenant)
            ]
            tasks += [
                asyncio.create_task(pipe.stage_worker(str(w)).run(stop)) for w in range(workers)
            ]
            tasks += [
                asyncio.create_task(pipe.actor(stop=stop, name=str(a))) for a in range(actors)
            ]
            warmup = min(2.0, seconds / 4)
            await asyncio.sleep(warmup)
            for v in pipe.stats.latency.values():
                v.clear()
            t0 = time.perf_counter()
            done0 = len(pipe.stats.completed_at)
            load_before = stats.load()
            while (elapsed := time.perf_counter() - t0) < seconds:
                await asyncio.sleep(min(1.0, seconds - elapsed))
                if progress:
                    n = len(pipe.stats.completed_at) - done0
                    print(
                        f"\r  {elapsed:4.0f}s  {n} lifecycles ({n / max(elapsed, 1e-9):.0f}/s)",
                        end="",
                        file=sys.stderr,
                        flush=True,
                    )
            elapsed = time.perf_counter() - t0
            done = sum(1 for at in pipe.stats.completed_at if at >= t0)
            if progress:
                print(file=sys.stderr)
            stop.set()
            await asyncio.wait(tasks, timeout=5)
            for task_ in tasks:
                task_.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if proc.poll() is not None:
                raise RuntimeError(f"scheduler process died: {proc.stderr.read().decode()[-2000:]}")
        lat = pipe.stats.latency
        # Lifecycles/s per one-second window: the median over windows with its interval
        # says how steady the rate was (one slow second does not move it).
        windows = [
            sum(1 for at in pipe.stats.completed_at if t0 + i <= at < t0 + i + 1)
            for i in range(int(elapsed))
        ]
        rate, rate_lo, rate_hi = stats.median_ci([float(w) for w in windows])
        all_transitions = [x for v in TIMED_VERBS for x in lat.get(v, [])]
        return {
            "lifecycles_per_s": round(done / elapsed, 1),
            "transitions_per_s": round(done * 6 / elapsed, 1),
            "lifecycles_per_s_by_window": {
                "median": rate,
                "ci95": [rate_lo, rate_hi],
                "windows": len(windows),
            },
            "load": {"before": load_before, "after": stats.load()},
            "transition_p50_ms": percentile(all_transitions, 50, scale=1000.0, digits=3),
            "transition_p99_ms": percentile(all_transitions, 99, scale=1000.0, digits=3),
            "by_verb_ms": {
                v: {"p50": percentile(lat[v], 50, scale=1000.0, digits=3), "p99": percentile(lat[v], 99, scale=1000.0, digits=3), "n": len(lat[v])}
                for v in (*TIMED_VERBS, "lease_next")
                if lat.get(v)
            },
            "unloaded_transition_p50_ms": percentile(unloaded, 50, scale=1000.0, digits=3),
            "unloaded_transition_p99_ms": percentile(unloaded, 99, scale=1000.0, digits=3),
            "seconds": round(elapsed, 2),
            "lifecycles": done,
            "config": {
                "tenants": tenants,
                "producers": tenants * producers_per_tenant,
                "advantage_workers": workers,
                "actors": actors,
                "scheduler": "separate process",
                "events_per_lifecycle": 6,
            },
        }
    finally:
        await delete_layout(b)
        await b.close()
