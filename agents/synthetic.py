"""Synthetic producers, stage work and actors: the whole job lifecycle with
fake numbers instead of a simulator and a model.

They take exactly the paths the real agents take (scheduler API, Training
Queue, durable stage consumer), so the demo, role ``synthetic`` and the
scheduler benchmark measure the service itself; ``with_data=False`` skips the
Training Queue to measure the scheduler alone.

See docs/ARCHITECTURE.md, "Measured".
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from joynexus.agents.advantage import gae
from joynexus.agents.scheduler_client import Backoff, SchedulerClient, reserve_until_admitted
from joynexus.agents.stage import StageWorker
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.jobs import JobState, TaskType, TrainingJob
from joynexus.schemas.samples import (
    SYN_ACTIONS_FIELD,
    SYN_ADVANTAGES_FIELD,
    SYN_OBS_FIELD,
    SYN_REWARDS_FIELD,
    SYN_VALUES_FIELD,
)

#: Stage names (the advantage stage's, the actor's read), not fields.
ADVANTAGES_TASK = "advantages"
ACTOR_TASK = "actor"
#: Waits between refused reservations: short, to keep the scheduler under load.
BACKOFF = Backoff(first_s=0.005, max_s=0.2)


@dataclass
class Stats:
    """What happened, for the demo's report and the benchmark."""

    reserved: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    completed: Counter[str] = field(default_factory=Counter)
    #: Client-side latency of each scheduler call, by verb (seconds).
    latency: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    completed_at: list[float] = field(default_factory=list)

    def timed(self, verb: str, t0: float) -> None:
        self.latency[verb].append(time.perf_counter() - t0)


class SyntheticPipeline:
    def __init__(
        self,
        broker: Broker,
        *,
        with_data: bool = True,
        samples_per_job: int = 16,
        horizon: int = 8,
        obs_dim: int = 32,
        instance: str = "synthetic",
    ) -> None:
        self.b = broker
        self.with_data = with_data
        self.samples = samples_per_job
        self.horizon = horizon
        self.obs_dim = obs_dim
        self.instance = instance
        self.tq = TrainingQueue(broker, ttl_s=600)
        self.stats = Stats()
        self.versions: Counter[str] = Counter()
        self.rng = np.random.default_rng(0)

    def client(self, name: str) -> SchedulerClient:
        return _TimedClient(self.b, by=f"{self.instance}-{name}", stats=self.stats)

    async def producer(
        self, tenant: str, task_type: TaskType, *, stop: asyncio.Event, max_jobs: int | None = None
    ) -> None:
        c = self.client(f"producer-{tenant}")
        made = 0

        async def attempt() -> TrainingJob | None:
            job = await c.reserve(tenant, task_type, sample_count=self.samples,
                                  behavior_policy_version=self.versions[tenant])
            if job is None:
                self.stats.refused[tenant] += 1  # limits reached: waited out
            return job

        while not stop.is_set() and (max_jobs is None or made < max_jobs):
            job = await reserve_until_admitted(c, attempt, stop, backoff=BACKOFF,
                                               who=f"synthetic {tenant}")
            if job is None:  # stopped, or its workload ended
                return
            self.stats.reserved[tenant] += 1
            made += 1
            if self.with_data:
                await self.tq.async_put(
                    self._rollout(task_type), tenant_id=tenant, partition_id=job.partition_id
                )
            nxt = JobState.NEEDS_ADVANTAGES if task_type == "rl" else JobState.READY
            await c.mark(job.job_id, nxt, sample_count=self.samples)

    def _rollout(self, task_type: TaskType) -> dict[str, np.ndarray]:
        b, t = self.samples, self.horizon
        data = {
            SYN_OBS_FIELD: self.rng.standard_normal((b, t, self.obs_dim), dtype=np.float32),
            SYN_ACTIONS_FIELD: self.rng.standard_normal((b, t, 4), dtype=np.float32),
        }
        if task_type == "rl":
            data[SYN_REWARDS_FIELD] = self.rng.random((b, t), dtype=np.float32)
            data[SYN_VALUES_FIELD] = self.rng.random((b, t), dtype=np.float32)
        return data

    async def advantage_work(self, job: TrainingJob) -> int | None:
        if not self.with_data:
            return None
        meta = await self.tq.async_get_meta(
            [SYN_REWARDS_FIELD, SYN_VALUES_FIELD],
            job.sample_count,
            tenant_id=job.tenant_id,
            partition_id=job.partition_id,
            task_name=f"{ADVANTAGES_TASK}-{job.attempt}",  # a retried lease re-reads all rows
        )
        if meta.rows:
            data = await self.tq.async_get_data(meta)
            adv_B_T, _ = gae(data[SYN_REWARDS_FIELD], data[SYN_VALUES_FIELD])
            await self.tq.async_put(
                {SYN_ADVANTAGES_FIELD: adv_B_T},
                tenant_id=job.tenant_id,
                metadata=meta,
            )
        return None

    def stage_worker(self, name: str = "0") -> StageWorker:
        return StageWorker(
            self.b, self.client(f"advantage-{name}"), ADVANTAGES_TASK, self.advantage_work, batch=32
        )

    async def actor(self, *, stop: asyncio.Event, name: str = "0") -> None:
        c = self.client(f"actor-{name}")
        while not stop.is_set():
            job = await c.lease_next(wait_s=0.5)
            if job is None:
                continue
            if self.with_data:
                fields = [SYN_OBS_FIELD, SYN_ACTIONS_FIELD] + (
                    [SYN_ADVANTAGES_FIELD] if job.task_type == "rl" else []
                )
                meta = await self.tq.async_get_meta(
                    fields,
                    job.sample_count,
                    tenant_id=job.tenant_id,
                    partition_id=job.partition_id,
                    task_name=f"{ACTOR_TASK}-{job.attempt}",
                )
                await self.tq.async_get_data(meta)
            version = None
            if job.task_type == "rl":
                self.versions[job.tenant_id] += 1
                version = self.versions[job.tenant_id]
            await c.complete(job, result_version=version)
            self.stats.completed[job.tenant_id] += 1
            self.stats.completed_at.append(time.perf_counter())


class _TimedClient(SchedulerClient):
    """A scheduler client that records each call's latency."""

    def __init__(self, broker: Broker, *, by: str, stats: Stats) -> None:
        super().__init__(broker, by=by)
        self._stats = stats

    async def _call(self, verb: str, req: object, *, extra_wait: float = 0.0):  # type: ignore[override]
        t0 = time.perf_counter()
        reply = await super()._call(verb, req, extra_wait=extra_wait)
        # A long poll's wait is not latency: an empty lease_next, a reserve's time in
        # the admission queue (the scheduler says how long it waited).
        if verb != "lease_next" or reply.job is not None:
            self._stats.timed(verb, t0 + reply.waited_s)
        return reply
