"""One scheduler across hosts: the lease (KV, server-side TTL, CAS) and its fence.

A standby takes the lease only when the holder stops renewing; the deposed
holder's renewal fails; and a deposed scheduler that has not noticed yet (a
paused process) cannot admit a job: the server refuses the append by the
epoch fence, and the job log holds only the new holder's admissions.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from joynexus.agents.leases import Deposed, RoleLease
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.eventlog import JobEventLog
from joynexus.broker.layout import ensure_layout
from joynexus.schemas.errors import Unavailable
from joynexus.schemas.jobs import JobState, WorkloadPolicy
from joynexus.schemas.scheduler import ReserveRequest

TTL = 2


async def test_one_holder_a_standby_takes_over_when_renewals_stop(broker: Broker) -> None:
    await ensure_layout(broker)
    a = RoleLease(broker, "scheduler", "host-a/scheduler-0", ttl_s=TTL)
    b = RoleLease(broker, "scheduler", "host-b/scheduler-0", ttl_s=TTL)
    assert await a.try_acquire() and a.epoch_seq > 0
    assert not await b.try_acquire()
    for _ in range(3):  # renewals keep it past several TTLs
        await asyncio.sleep(TTL / 2)
        await a.renew()
        assert not await b.try_acquire()
    # A restart in place (same holder) takes its own lease back at once, with a new epoch.
    a2 = RoleLease(broker, "scheduler", "host-a/scheduler-0", ttl_s=TTL)
    assert await a2.try_acquire() and a2.epoch_seq > a.epoch_seq
    # host a goes silent: the server's TTL ends the lease, the standby wins it.
    t0 = time.monotonic()
    stop = asyncio.Event()
    assert await asyncio.wait_for(b.acquire(stop), 4 * TTL + 5)
    took = time.monotonic() - t0
    assert took <= TTL + 3.0, took
    rec, _ = await b.current()
    assert rec is not None and rec.holder == "host-b/scheduler-0" and rec.epoch_seq == b.epoch_seq
    with pytest.raises(Deposed, match="held by host-b/scheduler-0"):
        await a2.renew()
    # A clean release lets the next one in without waiting for the TTL.
    await b.release()
    assert await a.try_acquire()


async def test_a_deposed_scheduler_cannot_admit(broker: Broker) -> None:
    await ensure_layout(broker)
    lease_a = RoleLease(broker, "scheduler", "host-a/sched", ttl_s=TTL)
    lease_b = RoleLease(broker, "scheduler", "host-b/sched", ttl_s=TTL)
    a = SchedulerAgent(broker, instance="sched-a", lease=lease_a, expire_every_s=0.2)
    b = SchedulerAgent(broker, instance="sched-b", lease=lease_b, expire_every_s=0.2)
    stop = asyncio.Event()
    try:
        assert await a.stand_by(stop)
        await a.start()
        c = SchedulerClient(broker, by="producer", deadline_s=20)
        await c.set_policy(WorkloadPolicy(tenant_id="acme", task_type="sft", max_in_flight=64))
        first = await c.reserve("acme", "sft")
        assert first is not None and first.state is JobState.RESERVED
        # b stands by while a renews
        standby = asyncio.create_task(b.stand_by(stop))
        await asyncio.sleep(TTL * 1.5)
        assert not standby.done()
        # a freezes (its renewals stop; its service does not know yet); b takes over
        for t in a._loops:
            if t.get_name() == "sched-lease":
                t.cancel()
        assert await asyncio.wait_for(standby, 4 * TTL + 5)
        await b.start()
        # a still answers what reaches it, but its admission is refused by the server's fence
        req = ReserveRequest(job_id="j-from-deposed", tenant_id="acme", task_type="sft", by="p")
        with pytest.raises(Unavailable, match="no longer holds the lease"):
            await a.verbs.on_reserve(req)
        assert a.deposed.is_set()
        assert "j-from-deposed" not in a.core.jobs
        # b admits, and knows a's earlier job (it rebuilt from the log after taking over)
        second = await SchedulerClient(broker, by="producer", deadline_s=20).reserve("acme", "sft")
        assert second is not None
        assert first.job_id in b.core.jobs
        ids = {s.event.job.job_id for s in (await JobEventLog(broker).latest_per_job())[0]}
        assert ids == {first.job_id, second.job_id}
    finally:
        stop.set()
        await a.stop()
        await b.stop()
