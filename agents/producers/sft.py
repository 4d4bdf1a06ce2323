"""The SFT producer: reserve a job, put the next batch of demonstrations (action
chunks of the head's horizon) into its partition, mark it ready; the admission
policy's max_in_flight is its prefetch depth, a cursor in the workloads bucket
its place in the shuffled dataset across restarts.

See docs/ARCHITECTURE.md ("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
from nats.js.errors import KeyNotFoundError
from opentelemetry import trace

from joynexus.agents.producers.schema import unusable_dataset, workload_schema
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import tracing
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import Names
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.jobs import JobMetadata, JobState
from joynexus.schemas.samples import (
    ACTION,
    ACTIONS_FIELD,
    OBS_IMAGES,
    OBS_STATE,
    STATE_FIELD,
    image_field,
)
from joynexus.schemas.workloads import WorkloadRecord

log = logging.getLogger(__name__)


class SFTProducer:
    def __init__(self, broker: Broker, record: WorkloadRecord, *, instance: str) -> None:
        self.b = broker
        self.rec = record
        self.spec = record.spec
        self.tenant = record.tenant_id
        self.sched = SchedulerClient(broker, by=instance)
        self.tq = TrainingQueue(broker)

    async def _cursor_kv(self) -> Any:
        return await self.b.js.key_value(self.b.names.workloads_bucket)

    def _cursor_key(self) -> str:
        return Names.cursor_key(self.tenant, self.spec.name)

    async def run(self, stop: asyncio.Event) -> None:
        from joynexus.agents.envs.lerobot_data import load_dataset

        schema, instruction = await asyncio.to_thread(workload_schema, self.spec)
        try:
            ds = await asyncio.to_thread(
                load_dataset, Path(self.spec.dataset), action_horizon=self.spec.action_horizon
            )
        except Exception as e:  # lerobot's own errors name files and keys: logged, not replied
            log.warning(
                "sft %s/%s: dataset unusable: %s: %s", self.tenant, self.spec.name, type(e).__name__, e
            )
            raise unusable_dataset(self.spec) from None
        for orphan in await self.sched.list_jobs(
            self.tenant, policy_key=self.spec.name, states=[JobState.RESERVED]
        ):
            await self.sched.fail(orphan.job_id, "producer restarted before the batch was written")
        kv = await self._cursor_kv()
        try:
            cursor = int((await kv.get(self._cursor_key())).value)
        except KeyNotFoundError:
            cursor = 0
        n = len(ds)
        order = np.random.default_rng(self.spec.seed).permutation(n)
        backoff = 0.05
        while not stop.is_set():
            span, traceparent = tracing.start_job_trace(
                "sft.job", tenant=self.tenant, workload=self.spec.name
            )
            with trace.use_span(span, end_on_exit=False):
                job = await self.sched.reserve(
                    self.tenant,
                    "sft",
                    policy_key=self.spec.name,
                    domain=Path(self.spec.dataset).name,  # the name, not the service's path
                    sample_count=self.spec.batch_size,
                    metadata=JobMetadata(
                        schema_signature=schema.signature(),
                        extra={
                            "instruction": instruction,
                            "cursor": str(cursor),
                            "traceparent": traceparent,
                            # the actor trains a module it has not stepped yet at this rate
                            "learning_rate": repr(float(self.spec.learning_rate)),
                        },
                    ),
                )
            if job is None:
                if "completion target" in self.sched.last_refusal:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            span.set_attribute("job_id", job.job_id)
            backoff = 0.05
            idx = [int(order[(cursor + i) % n]) for i in range(self.spec.batch_size)]
            cursor += self.spec.batch_size
            await kv.put(self._cursor_key(), str(cursor).encode())
            with trace.use_span(span, end_on_exit=True):
                try:
                    items = await asyncio.to_thread(_take, ds, idx)
                    data = {
                        **{
                            image_field(c): np.stack(
                                [it[f"{OBS_IMAGES}.{c}"].numpy() for it in items]
                            )
                            for c in schema.camera_slots
                        },
                        STATE_FIELD: np.stack([it[OBS_STATE].numpy() for it in items]).astype(
                            np.float32
                        ),
                        ACTIONS_FIELD: np.stack(
                            [it[ACTION].numpy().reshape(schema.action_horizon, -1) for it in items]
                        ).astype(np.float32),
                    }
                    await self.tq.async_put(
                        data, tenant_id=self.tenant, partition_id=job.partition_id
                    )
                    await self.sched.mark(job.job_id, JobState.READY)
                except JoyNexusError as e:
                    await self.sched.fail(job.job_id, f"sft producer: {type(e).__name__}: {e}")


def _take(ds: Any, idx: list[int]) -> list[dict[str, Any]]:
    return [ds[i] for i in idx]

