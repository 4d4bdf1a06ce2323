"""``joynexus bench fairness``: weighted fair shares of one scarce trainer, for real.

Twelve RL tenants share one actor: production rates 1x, 3x and 10x (a rollout
takes ``ROLLOUT_S / rate`` seconds, one at a time per tenant) crossed with two
share weights (1 and 2, the operator's ``share_weight``), two tenants of each
pair. The scheduler agent runs in its own process (the real service code:
admission queue, fair lease order); producers reserve through
``reserve_until_admitted`` (the producers' one admission loop, a long poll in
the admission queue), synthetic stage workers compute the advantages stage, and
one actor trains one job at a time, ``STEP_S`` each, so the trainer is scarce:
every tenant, even the slowest, produces faster than its fair share.

Reported: ``updates_per_tenant`` (in the measured window), ``jain_equal_weight``
(Jain's index of the update rates within each weight class: 1.0 is equal),
``class_share_ratio`` (the weight-2 tenants' mean rate over the weight-1
tenants': 2.0 is their weights' ratio), the trainer's utilization and the
scheduler's own view of the shares at the end (``status`` shows the same).

See docs/ARCHITECTURE.md, "Fair shares of the trainer".
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from collections import Counter
from typing import Any

from joynexus.agents.fairshare import jain
from joynexus.agents.scheduler_client import Backoff, SchedulerClient, reserve_until_admitted
from joynexus.agents.synthetic import SyntheticPipeline
from joynexus.broker.connection import Broker
from joynexus.broker.layout import delete_layout, ensure_layout
from joynexus.ops.bench.scheduler import scheduler_process
from joynexus.ops.measure import stats
from joynexus.schemas.jobs import GlobalLimits, JobState, TrainingJob, WorkloadPolicy

#: A 1x tenant's rollout (seconds); a 10x tenant's takes a tenth of it.
ROLLOUT_S = 0.3
#: The actor's training step per job (seconds): ~20 updates/s in all.
STEP_S = 0.05
RATES = (1, 3, 10)
WEIGHTS = (1, 2)
REPLICAS = 2
#: Rows per job (equal: the fair share counts rows).
ROWS = 64


def tenant_names() -> dict[str, tuple[int, int]]:
    """Each tenant's (rate, weight)."""
    return {
        f"r{rate}w{w}n{k}": (rate, w)
        for rate in RATES for w in WEIGHTS for k in range(REPLICAS)
    }


async def _producer(b: Broker, tenant: str, rate: int, stop: asyncio.Event,
                    made: Counter[str]) -> None:
    c = SchedulerClient(b, by=f"bench-producer-{tenant}")

    async def attempt() -> TrainingJob | None:
        return await c.reserve(tenant, "rl", sample_count=ROWS)

    while not stop.is_set():
        job = await reserve_until_admitted(c, attempt, stop, backoff=Backoff(0.01, 0.2),
                                           who=f"fairness {tenant}")
        if job is None:
            return
        await asyncio.sleep(ROLLOUT_S / rate)  # the rollout
        await c.mark(job.job_id, JobState.NEEDS_ADVANTAGES, sample_count=ROWS)
        made[tenant] += 1


async def _actor(b: Broker, stop: asyncio.Event, done: list[tuple[float, str]],
                 busy: list[float]) -> None:
    c = SchedulerClient(b, by="bench-actor")
    version: Counter[str] = Counter()
    while not stop.is_set():
        job = await c.lease_next(wait_s=0.5)
        if job is None:
            continue
        t0 = time.perf_counter()
        await asyncio.sleep(STEP_S)  # the training step
        busy.append(time.perf_counter() - t0)
        version[job.tenant_id] += 1
        await c.complete(job, result_version=version[job.tenant_id])
        done.append((time.perf_counter(), job.tenant_id))


async def bench_fairness(url: str, seconds: float = 30.0, *, progress: bool = True) -> dict[str, Any]:
    ns = f"bfair{uuid.uuid4().hex[:6]}"
    b = await Broker.connect(url, name="bench-fairness", namespace=ns)
    await ensure_layout(b)
    tenants = tenant_names()
    try:
        with scheduler_process(url, ns) as proc:
            setup = SchedulerClient(b, by="bench", deadline_s=30)
            await setup.set_limits(GlobalLimits(max_active_rollouts=8))
            for t, (_rate, w) in tenants.items():
                await setup.set_policy(WorkloadPolicy(
                    tenant_id=t, task_type="rl", max_in_flight=4, max_active_rollouts=1, weight=w))
            pipe = SyntheticPipeline(b, with_data=False, instance="bench-fair")
            stop = asyncio.Event()
            made: Counter[str] = Counter()
            done: list[tuple[float, str]] = []
            busy: list[float] = []
            tasks = [asyncio.create_task(_producer(b, t, rate, stop, made))
                     for t, (rate, _w) in tenants.items()]
            tasks += [asyncio.create_task(pipe.stage_worker(str(i)).run(stop)) for i in range(2)]
            tasks.append(asyncio.create_task(_actor(b, stop, done, busy)))
            await asyncio.sleep(min(5.0, seconds / 4))  # warm-up: every tenant backlogged
            load_before = stats.load()
            t0 = time.perf_counter()
            busy.clear()
            while (elapsed := time.perf_counter() - t0) < seconds:
                await asyncio.sleep(min(1.0, seconds - elapsed))
                if progress:
                    n = sum(1 for at, _ in done if at >= t0)
                    print(f"\r  {elapsed:4.0f}s  {n} updates", end="", file=sys.stderr, flush=True)
            elapsed = time.perf_counter() - t0
            if progress:
                print(file=sys.stderr)
            shares = (await setup.snapshot()).shares
            stop.set()
            await asyncio.wait(tasks, timeout=5)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if proc.poll() is not None:
                raise RuntimeError(f"scheduler process died: {proc.stderr.read().decode()[-2000:]}")
        updates = Counter(t for at, t in done if t0 <= at < t0 + elapsed)
        rates = {t: updates[t] / elapsed for t in tenants}
        by_w = {w: [rates[t] for t, (_r, tw) in tenants.items() if tw == w] for w in WEIGHTS}
        jains = {str(w): round(jain(xs) or 0.0, 4) for w, xs in by_w.items()}
        ratio = statistics.fmean(by_w[2]) / statistics.fmean(by_w[1]) if any(by_w[1]) else None
        return {
            "jain_equal_weight": min(jains.values()),
            "jain_by_weight": jains,
            "class_share_ratio": round(ratio, 3) if ratio is not None else None,
            "updates_per_tenant": {t: updates[t] for t in tenants},
            "produced_per_tenant": {t: made[t] for t in tenants},
            "updates_per_s": round(sum(rates.values()), 2),
            "trainer_utilization": round(sum(busy) / elapsed, 3),
            "scheduler_shares": {s.tenant_id: {"share": s.share, "fair_share": s.fair_share,
                                               "queued": s.queued} for s in shares},
            "seconds": round(elapsed, 1),
            "load": {"before": load_before, "after": stats.load()},
            "config": {"tenants": {t: {"rate": r, "weight": w} for t, (r, w) in tenants.items()},
                       "rollout_s_at_1x": ROLLOUT_S, "step_s": STEP_S, "actors": 1,
                       "global_max_active_rollouts": 8, "max_in_flight": 4},
        }
    finally:
        await delete_layout(b)
        await b.close()
