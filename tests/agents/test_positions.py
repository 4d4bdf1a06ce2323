"""Per-tenant positions (issue 24 item 5): what a tenant reads of the job log never
moves with another tenant's activity. ``read_events {"after_seq": -1}`` ("from now
on") answered the stream's global last sequence; two calls 2 s apart showed the
other tenants' event rate. Now it is the sequence of the tenant's own last event."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from joynexus.agents.control import ControlPlane
from joynexus.agents.producers import PolicyInitializer
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.schemas.base import encode
from joynexus.schemas.jobs import JobState, Reserved, TrainingJob
from joynexus.schemas.workloads import ReadEvents
from joynexus.sdk import Client


async def _event(b: Broker, tenant: str, job_id: str) -> int:
    job = TrainingJob(job_id=job_id, tenant_id=tenant, task_type="rl", workload="w",
                      state=JobState.RESERVED)
    ack = await b.js.publish(b.names.job_subject(tenant, job_id, JobState.RESERVED),
                             encode(Reserved(job=job, at=1.0)))
    return int(ack.seq)


@contextlib.asynccontextmanager
async def control_and_client(
    broker: Broker, datasets: Path, tenant: str = "acme"
) -> AsyncIterator[tuple[ControlPlane, Client]]:
    """A scheduler and a control plane in this process, and ``tenant``'s client."""
    sched = SchedulerAgent(broker)
    await sched.start()
    control = ControlPlane(broker, init_policy=PolicyInitializer(broker), datasets_root=datasets)
    await control.start()
    url = broker.nc.connected_url
    client = await Client.connect(f"nats://{url.netloc}", tenant=tenant,
                                  namespace=broker.names.namespace)
    try:
        yield control, client
    finally:
        await client.close()
        await control.stop()
        await sched.stop()


async def test_a_tenants_position_says_nothing_of_the_others(broker: Broker, tmp_path) -> None:
    async with control_and_client(broker, tmp_path) as (_, acme):
        async def position() -> int:
            return (await acme._api("read_events", ReadEvents(after_seq=-1))).last_seq

        assert await position() == 0  # no event of its own yet
        mine = await _event(broker, "acme", "a1")
        assert await position() == mine
        for i in range(20):  # another tenant's burst
            last = await _event(broker, "bolt", f"b{i}")
        assert last > mine and await position() == mine  # unmoved
        # The live iterator still starts after the tenant's own last event.
        mine2 = await _event(broker, "acme", "a2")
        assert await position() == mine2
