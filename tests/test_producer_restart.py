"""Regression (issue 12, PickCube SFT stall): a workload's producer that crashes
on a transient error (the scheduler or NATS not answering in time under load) is
started again while its workload is active, instead of staying dead while its
process keeps beating (training then stopped for good)."""

from __future__ import annotations

import asyncio

from joynexus.agents.workloads import ProducerAgent
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
