"""``WorkloadSpec.init_from_checkpoint`` end to end on a real nats-server: a tenant names a
LeRobot π0.5 checkpoint in its dataset space, and version 1 of its ``pi05_expert`` holds that
checkpoint's expert; a checkpoint outside the space or of another width is refused at create."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadSpec

pytestmark = pytest.mark.timeout(180)


async def test_version_1_is_the_checkpoints_expert(nats_server, broker, tmp_path: Path) -> None:
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from safetensors.torch import load, load_file

    from joynexus.agents.control import ControlPlane
    from joynexus.agents.models.pi05_lerobot import lerobot_tiny, openpi_transformers
    from joynexus.agents.producers import PolicyInitializer
    from joynexus.agents.scheduler import SchedulerAgent
    from joynexus.broker.policy import PolicyRecords
    from joynexus.sdk import Client

    datasets = tmp_path / "datasets"
    ckpt = datasets / "acme" / "ckpts" / "pi05"
    with openpi_transformers(), lerobot_tiny(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        state = {"observation.state": PolicyFeature(FeatureType.STATE, (8,))}
        PI05Policy(PI05Config(device="cpu", image_resolution=(56, 56), input_features=state)).save_pretrained(ckpt)
    shutil.copytree(ckpt, tmp_path / "elsewhere")
    sched = SchedulerAgent(broker)
    await sched.start()
    control = ControlPlane(broker, init_policy=PolicyInitializer(broker), instance="control",
                           datasets_root=datasets)
    await control.start()
    kw = dict(task_type="rl", env="PushCube-v1", base_model="pi05-tiny", action_module="pi05_expert",
              head_hidden=32, action_horizon=2)
    try:
        acme = await Client.connect(nats_server.url, tenant="acme", namespace=broker.names.namespace)
        async with acme:
            wl = await acme.create_workload(WorkloadSpec(name="rl", init_from_checkpoint="ckpts/pi05", **kw))
            assert wl.record.spec.init_from_checkpoint == str(ckpt.resolve())
            await acme.cancel_workload("rl")  # one active rl workload per tenant
            for name in ("../../elsewhere", str(tmp_path / "elsewhere"), "ckpts"):
                with pytest.raises(InvalidSpec, match="has no LeRobot checkpoint"):
                    await acme.create_workload(WorkloadSpec(name="x", init_from_checkpoint=name, **kw))
            with pytest.raises(InvalidSpec, match="head_hidden is 64"):
                await acme.create_workload(WorkloadSpec(name="y", init_from_checkpoint="ckpts/pi05",
                                                        **{**kw, "head_hidden": 64}))
    finally:
        await control.stop()
        await sched.stop()
    records = PolicyRecords(broker)
    v1 = load(await records.load_weights(await records.get("acme", "rl", 1)))
    theirs = load_file(str(ckpt / "model.safetensors"))
    name = "expert.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(v1[name], theirs["model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.down_proj.weight"],
                               atol=0, rtol=0)
    torch.testing.assert_close(v1["action_out_proj.bias"], theirs["model.action_out_proj.bias"], atol=0, rtol=0)
