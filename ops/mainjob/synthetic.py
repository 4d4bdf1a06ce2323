"""``joynexus demo --synthetic``: the scheduler-only demo, with synthetic workers.

Two RL tenants and one SFT tenant share the scheduler and the Training Queue
under the paper's admission (2 jobs in flight per RL tenant, 1 active rollout
per tenant and 3 globally, SFT prefetch 16, ready RL before SFT, staleness
bound 1) in seconds and without models. It then prints jobs per tenant and
state, one job's event trail, and the Training Queue's bytes (zero once every
job is terminal). The main job itself is ``ops/mainjob/run.py``.

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.agents.synthetic import SyntheticPipeline
from joynexus.broker.connection import Broker
from joynexus.broker.eventlog import JobEventLog
from joynexus.ops.admin.status import collect, render
from joynexus.ops.admin.tables import table
from joynexus.schemas.jobs import GlobalLimits, JobState, WorkloadPolicy

TENANTS = [("acme", "rl"), ("bolt", "rl"), ("cora", "sft")]


async def run_demo(
    url: str, namespace: str, *, seconds: float = 20.0, as_json: bool = False
) -> int:
    b = await Broker.connect(url, name="demo", namespace=namespace)
    sched = SchedulerAgent(b, instance="scheduler-0", lease_ttl_s=10.0)
    await sched.start()
    try:
        c = SchedulerClient(b, by="demo")
        await c.set_limits(GlobalLimits(max_active_rollouts=3))
        for tenant, task in TENANTS:
            if task == "rl":
                pol = WorkloadPolicy(
                    tenant_id=tenant,
                    task_type="rl",
                    max_in_flight=2,
                    max_active_rollouts=1,
                    max_policy_staleness=1,
                )
            else:
                pol = WorkloadPolicy(tenant_id=tenant, task_type="sft", max_in_flight=16)
            await c.set_policy(pol)
        pipe = SyntheticPipeline(b, instance="demo")
        stop, produce_stop = asyncio.Event(), asyncio.Event()
        producers = [
            asyncio.create_task(pipe.producer(t, task, stop=produce_stop))  # type: ignore[arg-type]
            for t, task in TENANTS
        ]
        workers = [
            asyncio.create_task(pipe.stage_worker().run(stop)),
            asyncio.create_task(pipe.actor(stop=stop)),
        ]
        t0 = time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < seconds:
            await asyncio.sleep(0.5)
            if not as_json:
                done = " ".join(f"{t}:{pipe.stats.completed[t]}" for t, _ in TENANTS)
                print(
                    f"\r  {elapsed:5.1f}s/{seconds:.0f}s  completed {done}  "
                    f"versions {dict(pipe.versions)}   ",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        produce_stop.set()
        await asyncio.gather(*producers)
        # Drain: let every admitted job reach a terminal state.
        deadline = time.perf_counter() + 30
        while time.perf_counter() < deadline:
            live = {
                k: v
                for k, v in sched.core.by_state.items()
                if v and k not in ("completed", "dropped", "failed")
            }
            if not live:
                break
            await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*workers)
        if not as_json:
            print(file=sys.stderr)
        await asyncio.sleep(0.2)  # partition purges of the last terminal jobs
        await sched.sweep_partitions()
        state = await collect(b)
        some = next(
            (
                j
                for j in sched.core.jobs.values()
                if j.task_type == "rl" and j.state is JobState.COMPLETED
            ),
            None,
        )
        trail = await JobEventLog(b).history(some.tenant_id, some.job_id) if some else []
        summary: dict[str, Any] = {
            "seconds": round(time.perf_counter() - t0, 1),
            "tenants": {
                t: {
                    "task": task,
                    **{k: v for k, v in sched.core.by_tenant_state[t].items() if v},
                    "version": sched.core.current_version(t, "default"),
                }
                for t, task in TENANTS
            },
            "tq_bytes_left": state["streams"].get(b.names.tq_stream, {}).get("bytes", 0),
            "job_events": state["streams"].get(b.names.jobs_stream, {}).get("messages", 0),
            "example_trail": [
                f"{h.event.job.state.value} (seq {h.seq}, by {h.event.by})" for h in trail
            ],
        }
        if as_json:
            print(json.dumps(summary, indent=2))
        else:
            print(render(state))
            print()
            if some:
                print(
                    f"Event trail of RL job {some.job_id} ({some.tenant_id}), from {b.names.jobs_stream}:"
                )
                print(
                    table(
                        [
                            [
                                h.seq,
                                h.event.job.state.value,
                                h.event.by,
                                h.event.job.attempt,
                                h.event.job.reason or "",
                            ]
                            for h in trail
                        ],
                        ["seq", "state", "by", "lease", "reason"],
                    )
                )
            print(f"\nTraining Queue bytes left after all jobs ended: {summary['tq_bytes_left']}")
            print(
                f"Inspect it yourself: nats stream view {b.names.jobs_stream} "
                f"(while `joynexus up` runs on the same store)"
            )
        return 0
    finally:
        await sched.stop()
        await b.close()
