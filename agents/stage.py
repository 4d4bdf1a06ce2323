"""Stage workers: the agents that run a pre-training stage (advantages,
actor_forward) for any tenant's jobs.

Work arrives through a durable JetStream consumer filtered on the stage's
``needs_*`` events (``nats consumer info JNX_JOBS stage-advantages`` shows
the backlog). For each message the worker takes the stage lease from the
scheduler (so two replicas never run one stage of one job), runs the work
while keeping both the message (in_progress) and the lease (touch) alive,
marks the job's next state, then acks. What a failure does is decided in
``joynexus.broker.disposition``; a message JetStream gives up on raises a
max-deliveries advisory and the scheduler fails that job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from joynexus.agents.leases import leases_kept
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import disposition, tracing
from joynexus.broker.connection import Broker
from joynexus.schemas.base import decode
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.jobs import STAGES, JobEvent, JobState, TrainingJob

log = logging.getLogger(__name__)

#: Where a job goes when a stage is done.
NEXT_STATE = {"actor_forward": JobState.NEEDS_ADVANTAGES, "advantages": JobState.READY}

Work = Callable[[TrainingJob], Awaitable[int | None]]
"""Does the stage's work for a job; may return the new sample count."""


class StageWorker:
    def __init__(
        self,
        broker: Broker,
        scheduler: SchedulerClient,
        stage: str,
        work: Work,
        *,
        ack_wait_s: float = 30.0,
        max_deliver: int = 5,
        batch: int = 8,
    ) -> None:
        if stage not in STAGES:
            raise InvalidSpec(f"unknown stage {stage!r}; stages are {sorted(STAGES)}")
        self.b = broker
        self.sched = scheduler
        self.stage = stage
        self.work = work
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self.batch = batch
        self.processed = 0
        self.failed = 0

    @property
    def consumer_name(self) -> str:
        return self.b.names.stage_consumer(self.stage)

    async def subscribe(self):  # -> JetStreamContext.PullSubscription
        needs, _ = STAGES[self.stage]
        return await self.b.js.pull_subscribe(
            self.b.names.jobs_in_state(needs),
            durable=self.consumer_name,
            stream=self.b.names.jobs_stream,
            config=ConsumerConfig(
                description=f"stage workers for {self.stage}: {needs.value} jobs",
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.ack_wait_s,
                max_deliver=self.max_deliver,
                max_ack_pending=1000,
            ),
        )

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        sub = await self.subscribe()
        while not stop.is_set():
            try:
                msgs = await sub.fetch(self.batch, timeout=1.0)
            except TimeoutError:
                continue
            for msg in msgs:
                await self.handle(msg)

    async def handle(self, msg: Msg) -> None:
        error: BaseException | None = None
        job: TrainingJob | None = None
        try:
            event: JobEvent = decode(msg.data, JobEvent, what=f"job event on {msg.subject}")  # type: ignore[arg-type]
            with tracing.tracer.start_as_current_span(
                f"stage.{self.stage}", context=tracing.extract(msg.headers)
            ):
                job = await self.sched.lease_stage(event.job.job_id, self.stage)
                sample_count = await self._work_with_heartbeat(msg, job)
                await self.sched.mark(
                    job.job_id,
                    NEXT_STATE[self.stage],
                    attempt=job.attempt,
                    sample_count=sample_count,
                )
                self.processed += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = e
        meta = msg.metadata
        d = disposition.decide(
            error, num_delivered=meta.num_delivered, max_deliver=self.max_deliver
        )
        if error is not None:
            log.warning(
                "%s: job event seq %s: %s -> %s",
                self.stage,
                meta.sequence.stream,
                error,
                d.action.value,
            )
        if d.fail_reason and job is not None:
            self.failed += 1
            with contextlib.suppress(Exception):
                await self.sched.fail(
                    job.job_id, f"{self.stage}: {d.fail_reason}", attempt=job.attempt
                )
        match d.action:
            case disposition.MessageAction.ACK:
                await msg.ack()
            case disposition.MessageAction.TERM:
                await msg.term()
            case disposition.MessageAction.NAK:
                await msg.nak(delay=d.delay_s)

    async def _work_with_heartbeat(self, msg: Msg, job: TrainingJob) -> int | None:
        # The message (in_progress, within its ack wait) and the stage lease (touch).
        async with leases_kept(self.sched, [job], also=msg.in_progress, every_s=self.ack_wait_s / 3):
            return await self.work(job)
