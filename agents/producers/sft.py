"""The SFT producer: reserve a job, put the next batch of demonstrations (action
chunks of the head's horizon) into its partition, mark it ready; the admission
policy's max_in_flight is its prefetch depth, a cursor in the workloads bucket
its place in the shuffled dataset across restarts.

``SFTProducer.run`` is named steps (open the dataset, end orphans, reserve in a
trace of its own, fill) around the pure decisions at the bottom (which rows a
batch takes, which refusal ends the run, the backoff, the columns), tabled in
tests/unit/test_sft_decisions.py.

See docs/ARCHITECTURE.md ("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from nats.js.errors import KeyNotFoundError
from opentelemetry import trace

from joynexus.agents.featureschema import FeatureSchema
from joynexus.agents.producers.schema import unusable_dataset, workload_schema
from joynexus.agents.scheduler_client import Backoff, SchedulerClient, reserve_until_admitted
from joynexus.broker import tracing
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import Names
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.jobs import JobMetadata, JobState, TrainingJob
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

#: The module that reads LeRobot datasets (imports torch and lerobot).
_LEROBOT_DATA = "joynexus.agents.envs.lerobot_data"


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
        """Open the dataset, end the jobs a previous run left reserved, then reserve
        and fill jobs (each a batch of the shuffled order from the saved cursor)
        until stopped or the workload's completion target refuses more."""
        schema, instruction, ds = await self._open()
        await self._fail_orphans()
        kv = await self._cursor_kv()
        cursor = await self._load_cursor(kv)
        order = np.random.default_rng(self.spec.seed).permutation(len(ds))

        async def attempt() -> tuple[TrainingJob, Any] | None:
            job, span = await self._reserve(schema, instruction, cursor)
            if job is None:
                span.end()
                return None
            return job, span

        while True:
            admitted = await reserve_until_admitted(
                self.sched, attempt, stop, backoff=BACKOFF,
                who=f"sft {self.tenant}/{self.spec.name}",
            )
            if admitted is None:  # stopped, or the workload's generation ended
                return
            job, span = admitted
            span.set_attribute("job_id", job.job_id)
            idx = batch_indices(order, cursor, self.spec.batch_size)
            cursor += self.spec.batch_size
            await kv.put(self._cursor_key(), str(cursor).encode())
            with trace.use_span(span, end_on_exit=True):
                await self._fill(job, ds, idx, schema)

    async def _open(self) -> tuple[FeatureSchema, str, Any]:
        """The workload's feature schema and instruction, and its LeRobot dataset."""
        schema, instruction = await asyncio.to_thread(workload_schema, self.spec)
        # lerobot's reader imports torch and lerobot (seconds, ~800 MiB): the process's
        # first SFT workload pays it, off the event loop (the supervisor stays light
        # until then; docs/ARCHITECTURE.md, "Light roles").
        lerobot_data = await asyncio.to_thread(importlib.import_module, _LEROBOT_DATA)
        try:
            ds = await asyncio.to_thread(
                lerobot_data.load_dataset,
                Path(self.spec.dataset),
                action_horizon=self.spec.action_horizon,
            )
        except Exception as e:  # lerobot's own errors name files and keys: logged, not replied
            log.warning(
                "sft %s/%s: dataset unusable: %s: %s", self.tenant, self.spec.name, type(e).__name__, e
            )
            raise unusable_dataset(self.spec) from None
        return schema, instruction, ds

    async def _fail_orphans(self) -> None:
        """Jobs reserved by a run that stopped before writing their batch."""
        await self.sched.fail_open(
            self.tenant,
            self.spec.name,
            "producer restarted before the batch was written",
            states=(JobState.RESERVED,),
            generation=self.rec.generation,
        )

    async def _load_cursor(self, kv: Any) -> int:
        try:
            return int((await kv.get(self._cursor_key())).value)
        except KeyNotFoundError:
            return 0

    async def _reserve(
        self, schema: FeatureSchema, instruction: str, cursor: int
    ) -> tuple[TrainingJob | None, Any]:
        """Reserve the next job, in a trace of its own (the span is ended by the caller)."""
        span, traceparent = tracing.start_job_trace(
            "sft.job", tenant=self.tenant, workload=self.spec.name
        )
        with trace.use_span(span, end_on_exit=False):
            job = await self.sched.reserve(
                self.tenant,
                "sft",
                workload=self.spec.name,
                generation=self.rec.generation,
                domain=Path(self.spec.dataset).name,  # the name, not the service's path
                sample_count=self.spec.batch_size,
                metadata=JobMetadata(
                    schema_signature=schema.signature(),
                    extra=job_extra(instruction, cursor, traceparent, self.spec.learning_rate),
                ),
            )
        return job, span

    async def _fill(self, job: TrainingJob, ds: Any, idx: list[int], schema: FeatureSchema) -> None:
        """The batch into the job's partition, then the job ready; a typed error fails the job."""
        try:
            items = await asyncio.to_thread(_take, ds, idx)
            data = sft_columns(items, schema.camera_slots, schema.action_horizon)
            await self.tq.async_put(data, tenant_id=self.tenant, partition_id=job.partition_id)
            await self.sched.mark(job.job_id, JobState.READY)
        except JoyNexusError as e:
            await self.sched.fail(job.job_id, f"sft producer: {type(e).__name__}: {e}")


# ---------------------------------------------------------------- pure decisions
#: Waits between refused reservations (an SFT batch is cheap to make: a short cap).
BACKOFF = Backoff(first_s=0.05, max_s=0.5)


def batch_indices(order: np.ndarray, cursor: int, batch_size: int) -> list[int]:
    """The dataset rows of the batch at ``cursor`` in the shuffled ``order`` (wrapping)."""
    n = len(order)
    return [int(order[(cursor + i) % n]) for i in range(batch_size)]


def job_extra(instruction: str, cursor: int, traceparent: str, learning_rate: float) -> dict[str, str]:
    return {
        "instruction": instruction,
        "cursor": str(cursor),
        "traceparent": traceparent,
        # the actor trains a module it has not stepped yet at this rate
        "learning_rate": repr(float(learning_rate)),
    }


def sft_columns(
    items: list[dict[str, Any]], camera_slots: Sequence[str], horizon: int
) -> dict[str, np.ndarray]:
    """Dataset items (LeRobot keys, tensors or arrays) as Training Queue columns:
    images per camera, float32 state, float32 action chunks [M, horizon, A]."""
    return {
        **{
            image_field(c): np.stack([np.asarray(it[f"{OBS_IMAGES}.{c}"]) for it in items])
            for c in camera_slots
        },
        STATE_FIELD: np.stack([np.asarray(it[OBS_STATE]) for it in items]).astype(np.float32),
        ACTIONS_FIELD: np.stack(
            [np.asarray(it[ACTION]).reshape(horizon, -1) for it in items]
        ).astype(np.float32),
    }


def _take(ds: Any, idx: list[int]) -> list[dict[str, Any]]:
    return [ds[i] for i in idx]
