"""Regression (issue 12, PickCube SFT stall): a workload's producer that crashes
on a transient error (the scheduler or NATS not answering in time under load) is
started again while its workload is active, instead of staying dead while its
process keeps beating (training then stopped for good)."""

from __future__ import annotations

import asyncio

from joynexus.agents.producers import ProducerAgent
from joynexus.broker.connection import Broker
from joynexus.schemas.errors import Unavailable


async def test_a_crashed_producer_is_started_again_until_it_finishes() -> None:
    agent = ProducerAgent(None, "sft", instance="p")  # type: ignore[arg-type]
    runs: list[int] = []

    async def make() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise Unavailable("scheduler did not answer reserve within 60s")
        if len(runs) == 2:
            raise TimeoutError  # a NATS request timing out (cursor put, publish)
        # the third incarnation runs to its completion target

    stop = asyncio.Event()
    await asyncio.wait_for(agent._guard(make, "acme.sft", stop), 10)
    assert runs == [0, 1, 2]


async def test_a_stopped_workload_is_not_restarted() -> None:
    agent = ProducerAgent(None, "sft", instance="p")  # type: ignore[arg-type]
    stop = asyncio.Event()
    runs = 0

    async def make() -> None:
        nonlocal runs
        runs += 1
        stop.set()  # the workload is cancelled while this incarnation crashes
        raise Unavailable("gone")

    await asyncio.wait_for(agent._guard(make, "acme.sft", stop), 5)
    assert runs == 1


async def test_a_producer_that_crashes_as_its_workload_ends_leaves_no_job_open(
    broker: Broker,
) -> None:
    """The workload is cancelled while its producer crashes holding a reserved job:
    it is not started again (above), and the job it left is failed, not left open."""
    from joynexus.agents.scheduler import SchedulerAgent
    from joynexus.agents.scheduler_client import SchedulerClient
    from joynexus.schemas.jobs import JobState, TrainingJob, WorkloadPolicy
    from joynexus.schemas.workloads import WorkloadRecord, WorkloadSpec

    sched = SchedulerAgent(broker, instance="sched", lease_ttl_s=5.0, expire_every_s=0.2)
    await sched.start()
    try:
        c = SchedulerClient(broker, by="test")
        await c.set_policy(
            WorkloadPolicy(tenant_id="acme", task_type="sft", workload="s", max_in_flight=2)
        )
        rec = WorkloadRecord(
            tenant_id="acme", spec=WorkloadSpec(name="s", task_type="sft", dataset="d"),
            created_at=1.0,
        )
        agent = ProducerAgent(broker, "sft", instance="p")
        stop = asyncio.Event()
        held: list[TrainingJob] = []

        async def make() -> None:
            job = await c.reserve("acme", "sft", workload="s", sample_count=4)
            assert job is not None
            held.append(job)
            stop.set()  # cancelled meanwhile
            raise TimeoutError  # before its batch was written (a NATS put timing out)

        await asyncio.wait_for(agent._guard(make, "acme.s", stop, record=rec), 30)
        assert len(held) == 1
        left = await c.get_job(held[0].job_id)
        assert left.state is JobState.FAILED, left
        assert not await c.list_jobs("acme", states=[JobState.RESERVED, JobState.PRODUCING])
    finally:
        await sched.stop()
