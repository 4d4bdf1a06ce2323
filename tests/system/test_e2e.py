"""Whole workloads on a real nats-server: SDK -> control plane -> producers ->
advantage stage -> actor -> policy publication -> inference -> evaluation.

Every role runs as in a deployment (in this process, sharing one tiny
backbone to fit the machine); ManiSkill renders on the CPU.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from joynexus.agents.actor.agent import Actor
from joynexus.agents.advantage import AdvantageAgent
from joynexus.agents.control import ControlPlane
from joynexus.agents.evaluator import Evaluator
from joynexus.agents.inference import EnginePool
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import PolicyStore, module_from_weights
from joynexus.agents.producers import PolicyInitializer, ProducerAgent
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.broker.eventlog import JobEventLog
from joynexus.broker.tq import TrainingQueue
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.base import decode
from joynexus.schemas.errors import InvalidSpec, UnknownTenant
from joynexus.schemas.jobs import JobState
from joynexus.schemas.workloads import ApiReply, Scheduling, WorkloadSpec
from joynexus.sdk import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
S = JobState


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    torch.manual_seed(0)
    return Backbone.build(BackboneConfig(size="tiny"))


@pytest.fixture(scope="module")
def datasets_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tenants' dataset spaces: <root>/<tenant>/<dataset>."""
    return tmp_path_factory.mktemp("datasets")


@pytest.fixture(scope="module")
def sft_dataset(datasets_root: Path) -> str:
    """The name of a dataset that tenants cora and eve each have in their own space."""
    import shutil

    from joynexus.agents.envs.lerobot_data import generate_dataset

    root = datasets_root / "cora" / "pick"
    generate_dataset("PickCube-v1", root, episodes=2, obs="rgb", image_size=64, seed=0)
    shutil.copytree(root, datasets_root / "eve" / "pick")
    return "pick"


@dataclass
class Deployment:
    b: Broker
    backbone: Backbone
    out: Path
    datasets: Path
    lease_ttl_s: float = 5.0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    actor_stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        self.sched = SchedulerAgent(
            self.b, instance="sched", lease_ttl_s=self.lease_ttl_s, expire_every_s=0.2
        )
        await self.sched.start()
        self.control = ControlPlane(
            self.b,
            init_policy=PolicyInitializer(self.b),
            instance="control",
            datasets_root=self.datasets,
        )
        await self.control.start()
        self.pool = EnginePool(self.b, self.backbone, max_batch=16, max_wait_ms=5)
        await self.pool.scale_to(1)
        self.advantage = AdvantageAgent(self.b, instance="adv", ack_wait_s=10)
        self.tasks["advantage"] = asyncio.create_task(self.advantage.worker.run(self.stop))
        self.start_actor()
        for kind in ("rl", "sft"):
            self.tasks[f"producer-{kind}"] = asyncio.create_task(
                ProducerAgent(self.b, kind, instance=f"prod-{kind}").run(self.stop)
            )
        self.evaluator = Evaluator(self.b, instance="eval")
        self.tasks["evaluator"] = asyncio.create_task(self.evaluator.run(self.stop))

    def start_actor(self, actor: Actor | None = None) -> Actor:
        self.actor_stop = asyncio.Event()
        self.actor = actor or Actor(
            self.b, self.backbone, instance="actor", out_dir=self.out, lease_wait_s=0.5
        )
        self.tasks["actor"] = asyncio.create_task(self.actor.run(self.actor_stop))
        return self.actor

    async def close(self) -> None:
        self.stop.set()
        self.actor_stop.set()
        await asyncio.wait(list(self.tasks.values()), timeout=30)
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.pool.close()
        await self.control.stop()
        await self.sched.stop()


@pytest.fixture
async def deployment(
    broker: Broker, backbone: Backbone, tmp_path: Path, datasets_root: Path
) -> AsyncIterator[Deployment]:
    d = Deployment(broker, backbone, tmp_path / "actor", datasets_root)
    await d.start()
    yield d
    await d.close()


async def client(nats_server: EmbeddedNats, broker: Broker, tenant: str) -> Client:
    return await Client.connect(nats_server.url, tenant=tenant, namespace=broker.names.namespace)


async def wait_for(pred: Any, within: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.25)


def completed_by_tenant(d: Deployment) -> Counter[str]:
    return Counter({t: c.get("completed", 0) for t, c in d.sched.core.by_tenant_state.items()})


async def test_two_rl_and_one_sft_tenant_train_end_to_end(
    spans: Any,
    deployment: Deployment,
    nats_server: EmbeddedNats,
    broker: Broker,
    sft_dataset: str,
    tmp_path: Path,
) -> None:
    d = deployment
    target = 3
    acme = await client(nats_server, broker, "acme")
    bolt = await client(nats_server, broker, "bolt")
    cora = await client(nats_server, broker, "cora")
    rl = dict(
        task_type="rl",
        num_envs=2,
        horizon=8,
        action_horizon=2,
        scheduling=Scheduling(max_in_flight=2, completion_target=target),
    )
    await acme.create_workload(WorkloadSpec(name="pick", env="PickCube-v1", **rl))
    await bolt.create_workload(
        WorkloadSpec(name="push", env="PushCube-v1", action_module="flow_matching", **rl)
    )
    await cora.create_workload(
        WorkloadSpec(
            name="demo",
            task_type="sft",
            dataset=sft_dataset,
            batch_size=16,
            action_horizon=2,
            scheduling=Scheduling(max_in_flight=16, completion_target=target),
        )
    )

    async def all_done() -> bool:
        c = completed_by_tenant(d)
        return all(c[t] >= target for t in ("acme", "bolt", "cora"))

    await wait_for(all_done, 400, f"{target} completed jobs per tenant")
    # Each tenant's own policy advanced one version per completed job, nobody else's.
    store = PolicyStore(broker)
    for tenant, name in (("acme", "pick"), ("bolt", "push"), ("cora", "demo")):
        latest = await store.latest(tenant, name)
        assert latest.version == 1 + target, (tenant, latest.version)
        manifest = json.loads((d.out / tenant / name / "manifest.json").read_text())
        assert manifest["version"] == latest.version and manifest["jobs_applied"] == target
        done = [
            j
            for j in d.sched.core.jobs.values()
            if j.tenant_id == tenant and j.state is S.COMPLETED
        ]
        assert sorted(j.result_version for j in done) == list(range(2, 2 + target))
    # RL jobs went through the advantage stage; SFT jobs went straight to ready.
    rl_job = next(
        j for j in d.sched.core.jobs.values() if j.tenant_id == "acme" and j.state is S.COMPLETED
    )
    states = [h.event.job.state for h in await JobEventLog(broker).history("acme", rl_job.job_id)]
    assert states[:4] == [S.RESERVED, S.PRODUCING, S.NEEDS_ADVANTAGES, S.COMPUTING_ADVANTAGES]
    sft_job = next(
        j for j in d.sched.core.jobs.values() if j.tenant_id == "cora" and j.state is S.COMPLETED
    )
    states = [h.event.job.state for h in await JobEventLog(broker).history("cora", sft_job.job_id)]
    assert states == [S.RESERVED, S.READY, S.LEASED, S.COMPLETED]
    # One trace per training job, across producer, advantage stage and actor.
    finished = spans.get_finished_spans()
    root = next(
        sp
        for sp in finished
        if sp.name == "rl.job" and sp.attributes.get("job_id") == rl_job.job_id
    )
    in_trace = {sp.name for sp in finished if sp.context.trace_id == root.context.trace_id}
    assert {"rl.job", "stage.advantages", "actor.train"} <= in_trace, in_trace
    # The SDK sees its own job events.
    seen = []
    async for ev in acme.events("pick"):
        seen.append(ev.job.state)
        if ev.job.state is S.COMPLETED:
            break
    assert S.RESERVED in seen and seen[-1] is S.COMPLETED

    # Evaluation pinned to a version: success rate over N episodes, no Training Queue entries.
    tq_before = await TrainingQueue(broker).list_partitions("acme")
    report = await acme.evaluate("pick", version=2, episodes=2)
    assert (
        report["version"] == 2 and report["episodes"] == 2 and 0.0 <= report["success_rate"] <= 1.0
    )
    assert await TrainingQueue(broker).list_partitions("acme") == tq_before
    # The sampled policy (its Gaussian, seeded): other actions than the mean's, the
    # same ones again for the same seed.
    sampled = [await acme.evaluate("pick", version=2, episodes=2, policy="sampled")
               for _ in range(2)]
    assert sampled[0]["mean_return"] == sampled[1]["mean_return"]
    assert sampled[0]["mean_return"] != report["mean_return"]

    # Export: safetensors + manifest that load back to the same actions.
    out = await acme.export("pick", tmp_path / "acme_head", version=3)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["base_model"] == "qwen2.5-vl-tiny"
    assert manifest["action_module"] == "oft_mlp" and "schema_signature" in manifest
    exported = TenantModule.import_safetensors(out)
    rec = await store.get("acme", "pick", 3)
    served = module_from_weights(rec, await store.load_weights(rec))
    feats, state = torch.randn(3, exported.cfg.feature_dim), torch.randn(3, exported.cfg.state_dim)
    torch.testing.assert_close(exported.act(feats, state), served.act(feats, state))

    # Once every job is terminal, no partition is left behind.
    for c in (acme, bolt, cora):
        for wl in await c.list_workloads():
            if wl.record.spec.task_type != "eval":
                await c.cancel_workload(wl.name)

    async def drained() -> bool:
        live = [
            j
            for j in d.sched.core.jobs.values()
            if j.state not in (S.COMPLETED, S.DROPPED, S.FAILED)
        ]
        return not live

    await wait_for(drained, 120, "every job terminal")
    await d.sched.sweep_partitions()
    await wait_for(lambda: _zero_bytes(broker), 30, "Training Queue empty")
    for c in (acme, bolt, cora):
        await c.close()


async def _zero_bytes(broker: Broker) -> bool:
    return await TrainingQueue(broker).partition_bytes() == 0


async def test_stale_rl_job_is_dropped_and_its_partition_cleared(
    deployment: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    d = deployment
    acme = await client(nats_server, broker, "acme")
    # Staleness 0: a job rolled out with version v is stale once v+1 is published.
    await acme.create_workload(
        WorkloadSpec(
            name="pick",
            task_type="rl",
            env="PickCube-v1",
            num_envs=1,
            horizon=6,
            action_horizon=2,
            scheduling=Scheduling(max_in_flight=2, max_policy_staleness=0),
        )
    )

    async def dropped() -> bool:
        return any(j.state is S.DROPPED for j in d.sched.core.jobs.values())

    await wait_for(dropped, 300, "a stale job dropped")
    await acme.cancel_workload("pick")
    job = next(j for j in d.sched.core.jobs.values() if j.state is S.DROPPED)
    assert "stale" in job.reason and "max_policy_staleness 0" in job.reason
    assert job.behavior_policy_version < d.sched.core.current_version("acme", "pick")
    await wait_for(
        lambda: _partition_gone(broker, job.partition_id), 30, "dropped partition cleared"
    )
    await acme.close()


async def _partition_gone(broker: Broker, partition: str) -> bool:
    return all(p != partition for _, p in await TrainingQueue(broker).list_partitions("acme"))


class CrashAfterCheckpoint(Actor):
    """Dies after the step's checkpoint is written, before the job is completed."""

    crashed = 0

    async def _finish(self, job: Any, st: Any, **kw: Any) -> None:
        if kw.get("loss") is not None and self.crashed == 0:
            self.crashed += 1
            raise asyncio.CancelledError  # as abrupt as a kill: nothing after the checkpoint runs
        await super()._finish(job, st, **kw)


@pytest.mark.parametrize("where", ["same host", "other host"])
async def test_actor_restart_resumes_exactly(
    broker: Broker,
    backbone: Backbone,
    nats_server: EmbeddedNats,
    sft_dataset: str,
    tmp_path: Path,
    datasets_root: Path,
    where: str,
) -> None:
    """The actor dies between its step's commit and the job's completion; a new one
    (on the same disk, or on another host with no disk in common: the checkpoint in
    force is JetStream's) completes that job with the version it produced."""
    d = Deployment(broker, backbone, tmp_path / "actor", datasets_root, lease_ttl_s=2.0)
    d.start_actor = lambda actor=None: Deployment.start_actor(  # type: ignore[method-assign]
        d,
        actor
        or CrashAfterCheckpoint(
            broker, backbone, instance="actor-1", out_dir=d.out, lease_wait_s=0.5
        ),
    )
    await d.start()
    try:
        cora = await client(nats_server, broker, "cora")
        await cora.create_workload(
            WorkloadSpec(
                name="demo",
                task_type="sft",
                dataset=sft_dataset,
                batch_size=8,
                action_horizon=2,
                scheduling=Scheduling(max_in_flight=4, completion_target=4),
            )
        )
        await wait_for(lambda: _crashed(d), 120, "the actor to crash after a checkpoint")
        await asyncio.gather(d.tasks["actor"], return_exceptions=True)
        crashed_ckpt = json.loads((d.out / "cora" / "demo" / "manifest.json").read_text())
        # A new actor process on the same checkpoint directory, or on another host.
        out_2 = d.out if where == "same host" else tmp_path / "host-b"
        Deployment.start_actor(
            d, Actor(broker, backbone, instance="actor-2", out_dir=out_2, lease_wait_s=0.5)
        )

        async def four_done() -> bool:
            return completed_by_tenant(d)["cora"] >= 4

        await wait_for(four_done, 200, "4 completed SFT jobs after the restart")
        done = [
            j
            for j in d.sched.core.jobs.values()
            if j.tenant_id == "cora" and j.state is S.COMPLETED
        ]
        # Versions 2..5, each exactly once: the crashed job was completed with the
        # version its step produced, not stepped again.
        assert sorted(j.result_version for j in done) == [2, 3, 4, 5]
        redone = next(j for j in done if j.result_version == crashed_ckpt["version"])
        assert redone.holder == "" and redone.attempt >= 2
        st = await d.actor.tenant("cora", "demo")
        assert (
            st.module.version == 5
            and (await PolicyStore(broker).latest("cora", "demo")).version == 5
        )
        # The optimizer state continued across the crash (Adam's step count: one per
        # update, none reset), and the cluster's checkpoint is version 5's.
        steps = {int(v["step"]) for v in st.module.optimizer.state_dict()["state"].values()}
        assert steps == {4}, steps
        rec = await d.actor.trainer_state.load("cora", "demo")
        assert rec is not None and rec.record.version == 5 and rec.record.written_by == "actor-2"
        await cora.close()
    finally:
        await d.close()


async def _crashed(d: Deployment) -> bool:
    return isinstance(d.actor, CrashAfterCheckpoint) and d.actor.crashed > 0


async def test_invalid_workloads_get_clear_errors(
    deployment: Deployment, nats_server: EmbeddedNats, broker: Broker, tmp_path: Path
) -> None:
    acme = await client(nats_server, broker, "acme")
    with pytest.raises(InvalidSpec, match="tenant 'acme' has no dataset"):
        await acme.create_workload(
            WorkloadSpec(name="demo", task_type="sft", dataset=str(tmp_path))
        )
    with pytest.raises(UnknownTenant, match="has no workload 'ghost'"):
        await acme.create_workload(
            WorkloadSpec(name="rl2", task_type="rl", env="PickCube-v1", init_from_workload="ghost")
        )
    await acme.create_workload(
        WorkloadSpec(
            name="one",
            task_type="rl",
            env="PickCube-v1",
            scheduling=Scheduling(completion_target=1),
        )
    )
    with pytest.raises(InvalidSpec, match="already runs an active rl workload"):
        await acme.create_workload(WorkloadSpec(name="two", task_type="rl", env="PushCube-v1"))
    msg = await acme._b.nc.request(  # the tenant's connection: replies in its inboxes
        broker.names.api("acme", "create_workload"), b'{"spec": {"name": 3}}', timeout=10
    )
    reply = decode(msg.data, ApiReply)
    assert (
        reply.error is not None
        and reply.error.code == "invalid_message"
        and "name" in reply.error.message
    )
    # A body nested 8,000 deep is a clear refusal, not an internal error (issue 24).
    deep = b'{"zzz": ' + b"[" * 8000 + b"]" * 8000 + b', "spec": {}}'
    msg = await acme._b.nc.request(broker.names.api("acme", "create_workload"), deep, timeout=10)
    reply = decode(msg.data, ApiReply)
    assert reply.error is not None and reply.error.code == "invalid_message", reply
    assert "internal" not in reply.error.message
    # `joynexus status` sees the tenant, its policy and the inference engine.
    from joynexus.ops.admin.status import collect, render

    state = await collect(broker)
    assert state["scheduler"]["policies"][0]["tenant_id"] == "acme"
    assert state["inference_engines"] and state["inference_engines"][0]["endpoints"]
    assert "Inference engines" in render(state) and "acme" in render(state)
    # Nothing else broke: the valid workload is registered and admitted.
    assert (await acme.get_workload("one")).record.state == "active"
    await acme.cancel_workload("one")
    await acme.close()


async def test_rollout_as_a_service_and_tenant_submitted_batches(
    deployment: Deployment, nats_server: EmbeddedNats, broker: Broker, sft_dataset: str
) -> None:
    """A tenant runs its own environment, asks the Inference Queue for actions,
    and hands the rollout to training; another submits its own SFT batches."""
    from joynexus.agents.envs.maniskill import OBS_IMAGES, OBS_STATE, make_env, rollout
    from joynexus.agents.producers import chunk_targets

    d = deployment
    dana = await client(nats_server, broker, "dana")
    await dana.create_workload(
        WorkloadSpec(
            name="own",
            task_type="rl",
            env="PickCube-v1",
            source="tenant",
            action_horizon=2,
            scheduling=Scheduling(max_in_flight=2),
        )
    )
    v1 = await dana.latest_version("own")
    env = await asyncio.to_thread(
        make_env, "PickCube-v1", obs="rgb", num_envs=1, image_size=64, seed=3
    )
    try:

        async def act(obs: dict[str, Any]) -> Any:
            return await dana.act(
                "own",
                images={"base_camera": obs[f"{OBS_IMAGES}.base_camera"]},
                state=obs[OBS_STATE],
                version=v1,
            )

        out = await rollout(env, act, horizon=6, seed=3)
        # act's default instruction is the one the workload trains and is evaluated
        # with (the task's), not "": the features, and so the actions, depend on it.
        rec = await dana.get_workload("own")
        assert rec.instruction == env.spec.instruction != ""
        obs = env.reset(seed=[3])
        ask = {"images": {"base_camera": obs[f"{OBS_IMAGES}.base_camera"]},
               "state": obs[OBS_STATE], "version": v1}
        default = await dana.act("own", **ask)
        assert np.array_equal(default, await dana.act("own", instruction=rec.instruction, **ask))
        assert not np.array_equal(default, await dana.act("own", instruction="do a dance", **ask))
    finally:
        await asyncio.to_thread(env.close)
    # The rollout's fields are Training Queue fields already; learn action chunks.
    data = dict(out)
    data["actions"] = chunk_targets(
        data.pop("action"), out["env_id"], out["episode_index"], out["frame_index"], 2
    )
    job = await dana.submit_rollout("own", data, behavior_policy_version=v1)
    assert (
        job.state is S.NEEDS_ADVANTAGES and job.producer_role == "tenant" and job.sample_count == 6
    )

    eve = await client(nats_server, broker, "eve")
    await eve.create_workload(
        WorkloadSpec(
            name="mine",
            task_type="sft",
            dataset=sft_dataset,
            source="tenant",
            action_horizon=2,
        )
    )
    schema_state = out["obs_state"].shape[1]
    rng = np.random.default_rng(0)
    batch = {
        "obs_image_base_camera": rng.integers(0, 255, (4, 3, 64, 64), dtype=np.uint8),
        "obs_state": rng.standard_normal((4, schema_state), dtype=np.float32),
        "actions": rng.uniform(-1, 1, (4, 2, 4)).astype(np.float32),
    }
    sft_job = await eve.submit_sft_batch("mine", batch)
    assert sft_job.state is S.READY

    async def both_trained() -> bool:
        states = {j.job_id: j.state for j in d.sched.core.jobs.values()}
        return states.get(job.job_id) is S.COMPLETED and states.get(sft_job.job_id) is S.COMPLETED

    await wait_for(both_trained, 120, "the tenant-submitted jobs to be trained")
    assert await dana.latest_version("own") == v1 + 1
    assert await eve.latest_version("mine") == 2
    # Clear errors: missing fields, a service-fed workload, another tenant's job id.
    with pytest.raises(InvalidSpec, match="lacks fields"):
        await eve.submit_sft_batch("mine", {"obs_state": batch["obs_state"]})
    await eve.create_workload(
        WorkloadSpec(
            name="fed",
            task_type="rl",
            env="PickCube-v1",
            scheduling=Scheduling(completion_target=1),
        )
    )
    with pytest.raises(InvalidSpec, match="fed by the service"):
        await eve.submit_rollout("fed", data, behavior_policy_version=1)
    msg = await eve._b.nc.request(
        broker.names.api("eve", "close_job"), b'{"job_id": "%s"}' % job.job_id.encode(), timeout=10
    )
    reply = decode(msg.data, ApiReply)
    assert reply.error is not None and reply.error.code == "unknown_job"  # dana's job is not eve's
    await eve.cancel_workload("fed")
    await dana.close()
    await eve.close()
