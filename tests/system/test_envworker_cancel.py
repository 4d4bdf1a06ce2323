"""A cancelled RL workload ends the job its environment worker holds, in a bound,
even while the worker's rollout waits on an inference engine that is down.

Regression of the intermittent chaos drill failure (``jobs lost``: one job per
tenant left ``producing`` after ``cancel_workload``): the worker's policy call
retried for up to 90 s without looking at its stop, its supervisor stopped it
(SIGTERM, SIGKILL after 3 s) and then looked for its jobs in the workloads still
active, not in the cancelled one it had served. Real nats-server, scheduler,
control plane and SDK; a real environment worker process (ManiSkill PickCube)
under the real supervisor; no inference engine at all.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from joynexus.agents.control import ControlPlane
from joynexus.agents.envworkers import EnvSupervisor
from joynexus.agents.producers import PolicyInitializer
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.layout import LayoutOptions, delete_layout, ensure_layout
from joynexus.ops.bench.faultrig import wait_until
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.jobs import TERMINAL_STATES, JobState, TrainingJob
from joynexus.schemas.workloads import Scheduling, WorkloadSpec
from joynexus.sdk import Client

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

#: How soon after the cancel the job must be terminal (the drill drains for 120 s).
BOUND_S = 20.0


async def test_a_cancel_ends_the_job_of_a_worker_waiting_on_a_down_engine(
    nats_server: EmbeddedNats, namespace: str, tmp_path: Path
) -> None:
    b = await Broker.connect(nats_server.url, name="test", namespace=namespace)
    await ensure_layout(b, LayoutOptions(tq_ttl_s=600))
    sched = SchedulerAgent(b, instance="sched", lease_ttl_s=5.0, expire_every_s=0.2)
    await sched.start()
    control = ControlPlane(
        b, init_policy=PolicyInitializer(b), instance="control", datasets_root=tmp_path / "ds"
    )
    await control.start()
    # No spare: the cancelled workload's worker is stopped at once (the drill's setting).
    sup = EnvSupervisor(
        b, instance="prl", url=nats_server.url, heartbeat_s=1.0, spares=0,
        log_dir=tmp_path / "logs",
    )
    stop = asyncio.Event()
    running = asyncio.create_task(sup.run(stop))
    client = await Client.connect(nats_server.url, tenant="acme", namespace=namespace)
    jobs = SchedulerClient(b, by="test")
    try:
        await client.create_workload(
            WorkloadSpec(
                name="pick", task_type="rl", env="PickCube-v1", num_envs=1, horizon=4,
                scheduling=Scheduling(max_in_flight=1, max_active_rollouts=1),
            )
        )

        async def producing() -> TrainingJob | None:
            if running.done():
                await running  # the supervisor died: say why
            got = await jobs.list_jobs("acme", states=[JobState.PRODUCING])
            return got[0] if got else None

        # The worker warms up (its renderer), reserves, marks producing and asks the
        # Inference Queue for its first chunk: no engine answers, it retries.
        job = await wait_until(producing, 200, "the worker's job producing", every=0.2)
        assert job.metadata.extra["producer"] == "prl-w0"
        await asyncio.sleep(1.0)  # well inside its policy call's retries
        assert (await jobs.get_job(job.job_id)).state is JobState.PRODUCING

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await client.cancel_workload("pick")

        async def ended() -> TrainingJob | None:
            j = await jobs.get_job(job.job_id)
            return j if j.state in TERMINAL_STATES else None

        try:
            done = await wait_until(ended, BOUND_S, "the job terminal after the cancel", every=0.2)
        except TimeoutError:
            left = await jobs.get_job(job.job_id)
            raise AssertionError(
                f"{job.job_id} still {left.state.value} {BOUND_S:g}s after the cancel"
            ) from None
        took = loop.time() - t0
        assert done.state is JobState.FAILED, done
        assert took < BOUND_S
        # Nothing of the workload is left open, and its worker was taken back.
        assert not await jobs.list_jobs("acme", states=[JobState.RESERVED, JobState.PRODUCING])
        await wait_until(lambda: _no_workers(sup), 30, "the worker stopped (no spare kept)")
    finally:
        stop.set()
        await asyncio.wait({running}, timeout=30)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await client.close()
        await control.stop()
        await sched.stop()
        await delete_layout(b)
        await b.close()


async def _no_workers(sup: EnvSupervisor) -> bool:
    return not sup.pool and not sup.manager.slots
