"""The actor_forward stage on a real nats-server with the real tiny base: it writes
the behaviour log-probabilities and critic values of an RL job's rows, is
re-leased after a worker dies holding it, and the job goes on through
advantages (GAE with those values) to a PPO step in the actor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from joynexus.agents.actor.agent import Actor
from joynexus.agents.actor.forward import (
    OLD_LOGP_FIELD,
    VALUES_FIELD,
    ActorForwardAgent,
    forward_rows,
)
from joynexus.agents.advantage import AdvantageAgent, gae, to_trajectories
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.features import FeatureSchema
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import PolicyStore
from joynexus.agents.producers import feature_dim
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.jobs import GlobalLimits, JobMetadata, JobState, TrainingJob, WorkloadPolicy
from joynexus.schemas.samples import ACTIONS_FIELD, STATE_FIELD, image_field

S = JobState
ENVS, STEPS, SDIM, ADIM, H = 2, 8, 5, 3, 2
BASE = "qwen2.5-vl-tiny"
SCHEMA = FeatureSchema(
    camera_slots=("base_camera",), image_hw=(64, 64), state_dim=SDIM, action_dim=ADIM,
    action_horizon=H, base_model=BASE,
)


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.build(BackboneConfig(size="tiny"))


@pytest.fixture
async def sched(broker: Broker) -> AsyncIterator[SchedulerAgent]:
    agent = SchedulerAgent(broker, instance="sched", lease_ttl_s=1.0, expire_every_s=0.1)
    await agent.start()
    yield agent
    await agent.stop()


def rollout_rows(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    m = ENVS * STEPS
    dones = np.zeros(m, dtype=bool)
    dones[4] = True  # env 0's first episode ends at step 4
    return {
        image_field("base_camera"): rng.integers(0, 255, (m, 3, 64, 64), dtype=np.uint8),
        STATE_FIELD: rng.normal(size=(m, SDIM)).astype(np.float32),
        ACTIONS_FIELD: rng.uniform(-1, 1, (m, H, ADIM)).astype(np.float32),
        "env_id": np.repeat(np.arange(ENVS), STEPS).astype(np.int64),
        "step": np.tile(np.arange(STEPS), ENVS).astype(np.int64),
        "rewards": rng.uniform(0, 1, m).astype(np.float32),
        "dones": dones,
    }


async def rl_job(broker: Broker, data: dict[str, np.ndarray]) -> tuple[TrainingJob, TenantModule]:
    """A published v1 policy and an RL job waiting for actor_forward with ``data``."""
    c = SchedulerClient(broker, by="test")
    await c.set_limits(GlobalLimits(max_active_rollouts=8))
    await c.set_policy(WorkloadPolicy(tenant_id="acme", task_type="rl", workload="pick",
                                      max_in_flight=4, max_active_rollouts=4))
    cfg = HeadConfig(feature_dim=feature_dim(BASE), state_dim=SDIM, action_dim=ADIM,
                     action_horizon=H, hidden=32)
    module = TenantModule("acme", "oft_mlp", cfg, lr=1e-3)
    await PolicyStore(broker).publish("acme", "pick", module, SCHEMA, BASE, version=1)
    job = await c.reserve(
        "acme", "rl", workload="pick", sample_count=len(data["rewards"]), behavior_policy_version=1,
        metadata=JobMetadata(schema_signature=SCHEMA.signature(),
                             extra={"actor_forward": "1", "instruction": "pick the cube"}),
    )
    assert job is not None
    await TrainingQueue(broker).async_put(data, tenant_id="acme", partition_id=job.partition_id)
    await c.mark(job.job_id, S.NEEDS_ACTOR_FORWARD, sample_count=len(data["rewards"]))
    return job, module


async def wait_state(broker: Broker, job_id: str, state: JobState, within: float = 30.0) -> TrainingJob:
    c = SchedulerClient(broker, by="test")
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        job = await c.get_job(job_id)
        if job.state is state:
            return job
        assert job.state not in (S.FAILED, S.DROPPED), job.reason
        assert loop.time() < end, f"job {job_id} is {job.state.value}, not {state.value}"
        await asyncio.sleep(0.1)


async def read(broker: Broker, job: TrainingJob, fields: list[str], task: str) -> dict[str, np.ndarray]:
    tq = TrainingQueue(broker)
    meta = await tq.async_get_meta(fields, 1 << 20, tenant_id="acme", partition_id=job.partition_id,
                                   task_name=task)
    data = await tq.async_get_data(meta)
    order = np.argsort(meta.rows)  # rows in put order
    return {k: v[order] for k, v in data.items()}


async def test_rl_job_through_actor_forward_advantages_and_a_ppo_step(
    broker: Broker, sched: SchedulerAgent, backbone: Backbone, tmp_path: Path
) -> None:
    data = rollout_rows()
    job, module = await rl_job(broker, data)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []
    try:
        tasks.append(asyncio.create_task(ActorForwardAgent(broker, backbone, instance="fwd").run(stop)))
        await wait_state(broker, job.job_id, S.NEEDS_ADVANTAGES)
        got = await read(broker, job, [OLD_LOGP_FIELD, VALUES_FIELD], "check-fwd")
        # What the stage wrote is the v1 module's own log-prob and value of the taken chunks.
        logp, values = forward_rows(backbone, module, SCHEMA, data, "pick the cube")
        assert np.allclose(got[OLD_LOGP_FIELD], logp, atol=1e-4)
        assert np.allclose(got[VALUES_FIELD], values, atol=1e-5)
        assert np.isfinite(logp).all() and np.ptp(values) > 0

        tasks.append(asyncio.create_task(AdvantageAgent(broker, instance="adv").worker.run(stop)))
        await wait_state(broker, job.job_id, S.READY)
        adv = await read(broker, job, ["advantages", "returns"], "check-adv")
        e_idx, r, d, v = to_trajectories(data["env_id"], data["step"], data["rewards"],
                                         data["dones"], values)
        want_adv, want_ret = gae(r, v, d, bootstrap_B=v[:, -1])
        assert np.allclose(adv["advantages"], want_adv[e_idx, data["step"]], atol=1e-4)
        assert np.allclose(adv["returns"], want_ret[e_idx, data["step"]], atol=1e-4)

        actor = Actor(broker, backbone, instance="actor", out_dir=tmp_path / "actor",
                      lease_wait_s=0.2, ppo_epochs=1)
        tasks.append(asyncio.create_task(actor.run(stop)))
        done = await wait_state(broker, job.job_id, S.COMPLETED)
        assert done.result_version == 2
        st = actor.tenants[("acme", "pick")]
        stats = st.module.last_stats
        assert {"policy_loss", "value_loss", "clip_frac", "approx_kl"} <= set(stats)
        # Trained at its behaviour version: the actor's log-probs are the stage's (ratio 1).
        assert stats["clip_frac"] == 0.0 and abs(stats["approx_kl"]) < 1e-5
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_actor_forward_is_released_and_retried_after_its_worker_dies(
    broker: Broker, sched: SchedulerAgent, backbone: Backbone
) -> None:
    data = rollout_rows(1)
    job, module = await rl_job(broker, data)
    started = asyncio.Event()

    class Dies(ActorForwardAgent):
        async def work(self, job: TrainingJob) -> int | None:
            started.set()
            await asyncio.Event().wait()  # hangs holding the lease until killed
            raise AssertionError  # pragma: no cover

    stop = asyncio.Event()
    first = Dies(broker, backbone, instance="fwd-a", ack_wait_s=1.0)
    dead = asyncio.create_task(first.run(stop))
    await asyncio.wait_for(started.wait(), 30)
    held = await SchedulerClient(broker, by="test").get_job(job.job_id)
    assert held.state is S.COMPUTING_ACTOR_FORWARD and held.holder
    dead.cancel()  # the worker dies: no ack, no mark; its lease runs out
    await asyncio.gather(dead, return_exceptions=True)
    second = ActorForwardAgent(broker, backbone, instance="fwd-b", ack_wait_s=1.0)
    run = asyncio.create_task(second.run(stop))
    try:
        after = await wait_state(broker, job.job_id, S.NEEDS_ADVANTAGES)
        assert after.attempt > held.attempt  # a new stage lease
        got = await read(broker, job, [OLD_LOGP_FIELD, VALUES_FIELD], "check")
        logp, values = forward_rows(backbone, module, SCHEMA, data, "pick the cube")
        assert np.allclose(got[OLD_LOGP_FIELD], logp, atol=1e-4)
        assert np.allclose(got[VALUES_FIELD], values, atol=1e-5)
        assert second.worker.processed == 1
    finally:
        stop.set()
        await asyncio.gather(run, return_exceptions=True)
