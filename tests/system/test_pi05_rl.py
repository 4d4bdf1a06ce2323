"""RL through the SDK with a prefix-cache expert (``action_module="pi05_expert"``) on a
deployment whose resident base is the tiny π0.5, built offline: the roles in process on a
real nats-server, ManiSkill's PushCube-v1 rolled out through the Inference Queue (one shared
prefix forward, the tenant's expert denoising), the advantage stage, the actor's AWR steps on
the flow-matching head, and one new version per completed job. A few versions, not learning."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from joynexus.agents.actor.agent import Actor
from joynexus.agents.advantage import AdvantageAgent
from joynexus.agents.control import ControlPlane
from joynexus.agents.inference import EnginePool
from joynexus.agents.models.families import build_base
from joynexus.agents.models.policyio import PolicyStore, module_from_weights
from joynexus.agents.producers import PolicyInitializer, ProducerAgent
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.workloads import Scheduling, WorkloadSpec
from joynexus.sdk import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
async def deployment(broker: Broker, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    base = build_base("pi05", "tiny")
    stop, tasks = asyncio.Event(), []
    sched = SchedulerAgent(broker, instance="sched", lease_ttl_s=10, expire_every_s=0.2)
    await sched.start()
    control = ControlPlane(broker, init_policy=PolicyInitializer(broker), instance="control",
                           datasets_root=tmp_path / "datasets")
    await control.start()
    pool = EnginePool(broker, base, max_batch=8, max_wait_ms=5)
    await pool.scale_to(1)
    advantage = AdvantageAgent(broker, instance="adv", ack_wait_s=10)
    tasks.append(asyncio.create_task(advantage.worker.run(stop)))
    actor = Actor(broker, base, instance="actor", out_dir=tmp_path / "actor", lease_wait_s=0.5)
    tasks.append(asyncio.create_task(actor.run(stop)))
    tasks.append(asyncio.create_task(ProducerAgent(broker, "rl", instance="prod-rl").run(stop)))
    yield {"base": base, "sched": sched, "actor": actor}
    stop.set()
    await asyncio.wait(tasks, timeout=30)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()
    await control.stop()
    await sched.stop()


async def test_rl_with_the_pi05_expert_through_the_sdk(
    deployment: dict[str, Any], nats_server: EmbeddedNats, broker: Broker
) -> None:
    """Each completed RL job (rollouts through the engine, advantages, an AWR step on the
    expert) publishes one version whose expert weights differ from the one before."""
    target = 2
    acme = await Client.connect(nats_server.url, tenant="acme", namespace=broker.names.namespace)
    wl = await acme.create_workload(WorkloadSpec(
        name="push", task_type="rl", env="PushCube-v1", base_model="pi05-tiny", action_module="pi05_expert",
        head_hidden=32, num_envs=2, horizon=6, action_horizon=2,
        scheduling=Scheduling(max_in_flight=2, completion_target=target)))
    async for _ in wl.events():  # returns once the workload has ended
        pass
    wl = await wl.refresh()
    assert wl.record.state == "done", wl.record
    store = PolicyStore(broker)
    latest = await store.latest("acme", "push")
    assert latest.version == 1 + target and latest.head_type == "pi05_expert"
    first = await store.get("acme", "push", 1)
    heads = [module_from_weights(r, await store.load_weights(r)).head for r in (first, latest)]
    moved = [k for k, v in heads[0].state_dict().items()
             if k.startswith("expert.") and not torch.equal(v, heads[1].state_dict()[k])]
    assert moved, "no expert weight changed over the RL versions"
    done = [j for j in deployment["sched"].core.jobs.values() if j.tenant_id == "acme" and j.state.value == "completed"]
    assert len(done) >= target and all(j.task_type == "rl" and j.sample_count > 0 for j in done)
    assert {j.result_version for j in done} >= {2, 1 + target}  # each completed job published one version
    await acme.close()
