"""A tenant's own jobs (open_job through the control plane) wait in the scheduler's
admission queue: real nats-server, real scheduler, real control plane, the SDK.

The waiting call is a long poll that gives the tenant's working slots back, is
admitted in fair order between tenants when a rollout slot frees, and ends in a
clear error: Timeout past the SDK's bound, QuotaExceeded past the queue's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from joynexus.agents.control import ControlPlane
from joynexus.agents.producers import PolicyInitializer
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.schemas.errors import QuotaExceeded, Timeout
from joynexus.schemas.jobs import GlobalLimits, JobState
from joynexus.schemas.workloads import CloseJob, OpenJob, Scheduling, WorkloadSpec
from joynexus.sdk import Client

S = JobState


@contextlib.asynccontextmanager
async def deployment(
    broker: Broker, datasets: Path
) -> AsyncIterator[tuple[SchedulerAgent, ControlPlane, dict[str, Client]]]:
    """A scheduler, a control plane and the SDK clients of acme and bolt, each with an
    RL workload it feeds itself; one rollout slot for everyone."""
    sched = SchedulerAgent(broker, instance="sched")
    await sched.start()
    control = ControlPlane(broker, init_policy=PolicyInitializer(broker), datasets_root=datasets)
    await control.start()
    url = broker.nc.connected_url
    clients: dict[str, Client] = {}
    try:
        for t in ("acme", "bolt"):
            clients[t] = await Client.connect(f"nats://{url.netloc}", tenant=t,
                                              namespace=broker.names.namespace)
            await clients[t].create_workload(WorkloadSpec(
                name="own", task_type="rl", env="PickCube-v1", source="tenant",
                action_horizon=2, scheduling=Scheduling(max_in_flight=8, max_active_rollouts=4)))
        await SchedulerClient(broker, by="op").set_limits(GlobalLimits(max_active_rollouts=1))
        yield sched, control, clients
    finally:
        for c in clients.values():
            await c.close()
        await control.stop()
        await sched.stop()


def waiting_of(sched: SchedulerAgent, tenant: str) -> int:
    return sum(1 for w in sched.core.queue.waiters.values() if w.tenant == tenant)


async def until(cond, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_open_job_waits_in_the_fair_queue_and_frees_the_tenants_slots(
    broker: Broker, tmp_path: Path
) -> None:
    async with deployment(broker, tmp_path) as (sched, _control, c):
        acme, bolt = c["acme"], c["bolt"]
        holder = await acme._open("own", 4, 1, 5.0)  # the one rollout slot
        assert holder.state is S.RESERVED and holder.producer_role == "tenant"
        # More of acme's open_jobs wait than it has working slots (2): all reach the
        # scheduler's queue, none holds a slot while it waits.
        acme_waits = [asyncio.create_task(acme._open("own", 4, 1, 60.0)) for _ in range(3)]
        await until(lambda: waiting_of(sched, "acme") == 3)
        bolt_wait = asyncio.create_task(bolt._open("own", 4, 1, 60.0))
        await until(lambda: waiting_of(sched, "bolt") == 1)
        # acme's other calls are answered at once meanwhile.
        t0 = asyncio.get_running_loop().time()
        listed = await asyncio.wait_for(acme.list_workloads(), 2.0)
        assert [w.name for w in listed] == ["own"]
        assert asyncio.get_running_loop().time() - t0 < 3.0  # not behind a 60 s wait
        # The raw verb says why it waits and its place: bolt (no job under way) is first.
        raw = await acme._api("open_job", OpenJob(workload="own", sample_count=4, wait_s=1.0))
        assert raw.job is None and raw.refusal == "global_rollouts"
        assert raw.position >= 2 and raw.waited_s >= 0.9 and "rollouts active" in raw.refused
        [bolt_waiter] = [w for w in sched.core.queue.waiters.values() if w.tenant == "bolt"]
        assert sched.core.position(bolt_waiter.job_id, now=0.0) == 1
        # The slot frees: bolt is admitted though acme asked first, and only bolt.
        await acme._api("close_job", CloseJob(job_id=holder.job_id))
        got_b = await asyncio.wait_for(bolt_wait, 10)
        assert got_b.tenant_id == "bolt" and got_b.state is S.RESERVED
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in acme_waits) and waiting_of(sched, "acme") == 3
        # bolt's job ends its rollout: one of acme's waiters gets the slot, exactly one.
        await bolt._api("close_job", CloseJob(job_id=got_b.job_id))
        done, _ = await asyncio.wait(acme_waits, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        await asyncio.sleep(0.3)
        assert sum(t.done() for t in acme_waits) == 1
        reserved = await SchedulerClient(broker, by="t").list_jobs("acme", states=[S.RESERVED])
        assert len(reserved) == 1  # nothing doubled: one admitted job per freed slot
        for t in acme_waits:
            t.cancel()
        await asyncio.gather(*acme_waits, return_exceptions=True)


async def test_open_job_ends_in_a_clear_error_past_its_bounds(
    broker: Broker, tmp_path: Path
) -> None:
    async with deployment(broker, tmp_path) as (sched, _control, c):
        acme, bolt = c["acme"], c["bolt"]
        await acme._open("own", 4, 1, 5.0)  # holds the one rollout slot
        # Past the SDK's bound: Timeout, saying why and where it stood.
        with pytest.raises(Timeout, match=r"rollouts active.*place 1 in the admission queue"):
            await bolt._open("own", 4, 1, 1.5)
        assert not sched.core.queue.waiters  # its long poll left the queue
        # The control plane lets half of bolt's requests in flight (32) wait at once.
        ask = OpenJob(workload="own", sample_count=4, wait_s=3.0)
        raws = [asyncio.create_task(bolt._api("open_job", ask)) for _ in range(16)]
        await until(lambda: waiting_of(sched, "bolt") == 16)
        with pytest.raises(QuotaExceeded, match="16 open_job calls waiting"):
            await bolt._api("open_job", ask)
        assert await bolt.list_workloads()  # its other calls still go through
        assert all(r.job is None and r.position for r in await asyncio.gather(*raws))
        # Past the tenant's queue bound: the clear refusal at once, not queued.
        sched.core.queue.per_tenant = 1
        first = asyncio.create_task(bolt._open("own", 4, 1, 30.0))
        await until(lambda: waiting_of(sched, "bolt") == 1)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(QuotaExceeded, match="already has 1 reserves waiting"):
            await bolt._open("own", 4, 1, 30.0)
        assert asyncio.get_running_loop().time() - t0 < 2.0
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
