"""SFT and RL through the SDK with ``action_module="pi05_expert"`` (``"smolvla_expert"``) on a
deployment whose resident base is the tiny π0.5 (SmolVLA), built offline: the roles in
process on a real nats-server, a LeRobot dataset made by the scripted expert, each completed job one new version, and the trained
policy acting through the Inference Queue as the same head does in process. RL: ManiSkill's
PushCube-v1 rolled out through the Inference Queue (one shared prefix forward, the tenant's
expert denoising), the advantage stage, the actor's AWR steps on the flow-matching expert; a
few versions, not learning."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from joynexus.agents.actor.agent import Actor
from joynexus.agents.advantage import AdvantageAgent
from joynexus.agents.control import ControlPlane
from joynexus.agents.inference import EnginePool
from joynexus.agents.models.families import build_base
from joynexus.agents.models.features import canonicalize_request
from joynexus.agents.models.grouped import ActRequest, serial_forward
from joynexus.agents.models.policyio import PolicyStore, feature_schema_of, module_from_weights
from joynexus.agents.producers import PolicyInitializer, ProducerAgent
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.workloads import Scheduling, WorkloadSpec
from joynexus.sdk import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: Each prefix-cache family: its tiny base model, its expert head, the head's width, the cache's layers.
FAMILIES = {"pi05": ("pi05-tiny", "pi05_expert", 32, 2), "smolvla": ("smolvla-tiny", "smolvla_expert", 48, 4)}


@pytest.fixture
async def deployment(broker: Broker, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[dict[str, Any]]:
    from joynexus.agents.envs.lerobot_data import generate_dataset

    generate_dataset("PushCube-v1", tmp_path / "datasets" / "cora" / "push", episodes=2, obs="rgb",
                     image_size=64, seed=0)
    family = getattr(request, "param", "pi05")
    base = build_base(family, "tiny")
    stop, tasks = asyncio.Event(), []
    sched = SchedulerAgent(broker, instance="sched", lease_ttl_s=10, expire_every_s=0.2)
    await sched.start()
    control = ControlPlane(broker, init_policy=PolicyInitializer(broker), instance="control",
                           datasets_root=tmp_path / "datasets")
    await control.start()
    pool = EnginePool(broker, base, max_batch=8, max_wait_ms=5)
    await pool.scale_to(1)
    actor = Actor(broker, base, instance="actor", out_dir=tmp_path / "actor", lease_wait_s=0.5)
    tasks.append(asyncio.create_task(actor.run(stop)))
    advantage = AdvantageAgent(broker, instance="adv", ack_wait_s=10)
    tasks.append(asyncio.create_task(advantage.worker.run(stop)))
    for kind in ("sft", "rl"):
        tasks.append(asyncio.create_task(ProducerAgent(broker, kind, instance=f"prod-{kind}").run(stop)))
    yield {"base": base, "sched": sched, "out": tmp_path / "actor", "family": family}
    stop.set()
    await asyncio.wait(tasks, timeout=30)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()
    await control.stop()
    await sched.stop()


@pytest.mark.parametrize(("deployment", "expert_state"),
                         [("pi05", "prompt"), ("pi05", "token"), ("smolvla", "prompt")],
                         indirect=["deployment"])
async def test_sft_with_the_pi05_expert_through_the_sdk(
    deployment: dict[str, Any], nats_server: EmbeddedNats, broker: Broker, expert_state: str
) -> None:
    """Each prefix-cache family's expert, and either setting of π0.5's ``expert_state``, travels
    from the spec to the actor's head, the published version and the inference engine's copy
    (the token head's ``state_proj`` too)."""
    base_model, head, hidden, kv_layers = FAMILIES[deployment["family"]]
    target = 3
    cora = await Client.connect(nats_server.url, tenant="cora", namespace=broker.names.namespace)
    wl = await cora.create_workload(WorkloadSpec(
        name="demo", task_type="sft", dataset="push", base_model=base_model, action_module=head,
        head_hidden=hidden, batch_size=8, action_horizon=2, expert_state=expert_state,  # type: ignore[arg-type]
        scheduling=Scheduling(max_in_flight=4, completion_target=target)))
    async for _ in wl.events():  # returns once the workload has ended
        pass
    wl = await wl.refresh()
    assert wl.record.state == "done", wl.record
    store = PolicyStore(broker)
    latest = await store.latest("cora", "demo")
    assert latest.version == 1 + target and latest.head_type == head
    assert latest.head_config["kv_layers"] == kv_layers
    assert latest.head_config.get("expert_state", "prompt") == expert_state
    module = module_from_weights(latest, await store.load_weights(latest))
    assert (getattr(module.head, "state_proj", None) is not None) == (expert_state == "token")
    # The trained policy acts through the Inference Queue exactly as its head does in process.
    base = deployment["base"]
    g = np.random.default_rng(0)
    fs = feature_schema_of(latest)
    assert fs.base_model == base_model
    images = {c: g.integers(0, 256, (2, 3, *fs.image_hw), dtype=np.uint8) for c in fs.camera_slots}
    state = g.standard_normal((2, fs.state_dim)).astype(np.float32)
    got = await cora.act("demo", images=images, state=state, instruction="push the cube")
    # The engine's copy is as fresh as this one: its first draw of noise is this one's.
    fb = canonicalize_request(fs, {c: torch.from_numpy(v) for c, v in images.items()}, "push the cube", state)
    (want,) = serial_forward(base, [ActRequest(module, fb)])
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=0)
    # The deployment's base, as `joynexus status --json` shows it.
    from joynexus.ops.admin.status import collect

    status = await collect(broker)
    assert status["base"] == {"family": deployment["family"], "params": base.num_params(), "base_model": base_model}
    await cora.close()


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
