"""``WorkloadSpec.init_from_checkpoint`` end to end on a real nats-server: a tenant names a
LeRobot π0.5 (SmolVLA) checkpoint in its dataset space, and version 1 of its ``pi05_expert``
(``smolvla_expert``) holds that checkpoint's expert; a checkpoint outside the space, of another
width or of the other policy type is refused at create."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadSpec

pytestmark = pytest.mark.timeout(180)


async def _create_from(nats_server: Any, broker: Any, datasets: Path, tmp_path: Path, name: str,
                       kw: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Create an rl workload from ``ckpts/<name>`` (then the refusals: paths outside the space, a
    width of 64, the checkpoint retyped as the other family) and return version 1's weights."""
    from safetensors.torch import load

    from joynexus.agents.control import ControlPlane
    from joynexus.agents.producers import PolicyInitializer
    from joynexus.agents.scheduler import SchedulerAgent
    from joynexus.broker.policy import PolicyRecords
    from joynexus.sdk import Client

    ckpt = datasets / "acme" / "ckpts" / name
    shutil.copytree(ckpt, tmp_path / "elsewhere")
    other = {"pi05": "smolvla", "smolvla": "pi05"}[name]
    shutil.copytree(ckpt, ckpt.parent / "retyped")
    (ckpt.parent / "retyped" / "config.json").write_text(json.dumps({"type": other}))
    sched = SchedulerAgent(broker)
    await sched.start()
    control = ControlPlane(broker, init_policy=PolicyInitializer(broker), instance="control",
                           datasets_root=datasets)
    await control.start()
    try:
        acme = await Client.connect(nats_server.url, tenant="acme", namespace=broker.names.namespace)
        async with acme:
            wl = await acme.create_workload(WorkloadSpec(name="rl", init_from_checkpoint=f"ckpts/{name}", **kw))
            assert wl.record.spec.init_from_checkpoint == str(ckpt.resolve())
            await acme.cancel_workload("rl")  # one active rl workload per tenant
            for path in ("../../elsewhere", str(tmp_path / "elsewhere"), "ckpts"):
                with pytest.raises(InvalidSpec, match="has no LeRobot checkpoint"):
                    await acme.create_workload(WorkloadSpec(name="x", init_from_checkpoint=path, **kw))
            with pytest.raises(InvalidSpec, match="head_hidden is 64"):
                await acme.create_workload(WorkloadSpec(name="y", init_from_checkpoint=f"ckpts/{name}",
                                                        **{**kw, "head_hidden": 64}))
            with pytest.raises(InvalidSpec, match=f"policy type is '{other}'"):
                await acme.create_workload(WorkloadSpec(name="z", init_from_checkpoint="ckpts/retyped", **kw))
    finally:
        await control.stop()
        await sched.stop()
    records = PolicyRecords(broker)
    return load(await records.load_weights(await records.get("acme", "rl", 1)))


async def test_version_1_is_the_checkpoints_expert(nats_server, broker, tmp_path: Path) -> None:
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from safetensors.torch import load_file

    from joynexus.agents.models.pi05_lerobot import lerobot_tiny, openpi_transformers

    datasets = tmp_path / "datasets"
    ckpt = datasets / "acme" / "ckpts" / "pi05"
    with openpi_transformers(), lerobot_tiny(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        state = {"observation.state": PolicyFeature(FeatureType.STATE, (8,))}
        PI05Policy(PI05Config(device="cpu", image_resolution=(56, 56), input_features=state)).save_pretrained(ckpt)
    v1 = await _create_from(nats_server, broker, datasets, tmp_path, "pi05", dict(
        task_type="rl", env="PushCube-v1", base_model="pi05-tiny", action_module="pi05_expert", head_hidden=32,
        action_horizon=2))
    theirs = load_file(str(ckpt / "model.safetensors"))
    name = "expert.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(v1[name], theirs["model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.down_proj.weight"],
                               atol=0, rtol=0)
    torch.testing.assert_close(v1["action_out_proj.bias"], theirs["model.action_out_proj.bias"], atol=0, rtol=0)


async def test_version_1_is_the_smolvla_checkpoints_expert(nats_server, broker, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from joynexus.agents.models.heads.base import HeadConfig
    from joynexus.agents.models.heads.tenant import TenantModule
    from joynexus.agents.models.smolvla_base import SmolVLABase
    from joynexus.agents.models.smolvla_config import SmolVLABaseConfig
    from joynexus.agents.models.smolvla_lerobot import lerobot_smolvla

    datasets = tmp_path / "datasets"
    ckpt = datasets / "acme" / "ckpts" / "smolvla"
    ckpt.mkdir(parents=True)
    base = SmolVLABase.build(SmolVLABaseConfig())
    src = TenantModule("src", "smolvla_expert", HeadConfig(feature_dim=base.feature_dim, state_dim=8, action_dim=4,
                                                          action_horizon=2, hidden=48, kv_layers=base.kv_layout[0],
                                                          seed=11), lr=1e-3)
    with torch.no_grad():  # weights no fresh head of any seed holds
        for p in src.head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    policy = lerobot_smolvla(base, src.head, steps=3)  # type: ignore[arg-type]
    save_file({f"model.{k}": v.contiguous() for k, v in policy.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"type": "smolvla"}))
    v1 = await _create_from(nats_server, broker, datasets, tmp_path, "smolvla", dict(
        task_type="rl", env="PushCube-v1", base_model="smolvla-tiny", action_module="smolvla_expert",
        head_hidden=48, action_horizon=2))
    theirs = load_file(str(ckpt / "model.safetensors"))
    torch.testing.assert_close(v1["lm_expert.layers.1.mlp.down_proj.weight"],
                               theirs["model.vlm_with_expert.lm_expert.layers.1.mlp.down_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(v1["action_out_proj.bias"], theirs["model.action_out_proj.bias"], atol=0, rtol=0)
