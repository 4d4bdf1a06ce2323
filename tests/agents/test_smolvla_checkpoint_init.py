"""``WorkloadSpec.init_from_checkpoint`` for a ``smolvla_expert``, end to end on a real
nats-server: a tenant names a LeRobot SmolVLA checkpoint in its dataset space, and version 1
of its head holds that checkpoint's expert; a checkpoint outside the space, of another width
or of another policy type is refused at create."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadSpec

pytestmark = pytest.mark.timeout(180)


async def test_version_1_is_the_smolvla_checkpoints_expert(nats_server, broker, tmp_path: Path) -> None:
    from safetensors.torch import load, load_file, save_file

    from joynexus.agents.control import ControlPlane
    from joynexus.agents.models.heads.base import HeadConfig
    from joynexus.agents.models.heads.tenant import TenantModule
    from joynexus.agents.models.smolvla_base import SmolVLABase
    from joynexus.agents.models.smolvla_config import SmolVLABaseConfig
    from joynexus.agents.models.smolvla_lerobot import lerobot_smolvla
    from joynexus.agents.producers import PolicyInitializer
    from joynexus.agents.scheduler import SchedulerAgent
    from joynexus.broker.policy import PolicyRecords
    from joynexus.sdk import Client

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
    shutil.copytree(ckpt, tmp_path / "elsewhere")
    pi05 = datasets / "acme" / "ckpts" / "typed-pi05"
    shutil.copytree(ckpt, pi05)
    (pi05 / "config.json").write_text(json.dumps({"type": "pi05"}))
    sched = SchedulerAgent(broker)
    await sched.start()
    control = ControlPlane(broker, init_policy=PolicyInitializer(broker), instance="control",
                           datasets_root=datasets)
    await control.start()
    kw = dict(task_type="rl", env="PushCube-v1", base_model="smolvla-tiny", action_module="smolvla_expert",
              head_hidden=48, action_horizon=2)
    try:
        acme = await Client.connect(nats_server.url, tenant="acme", namespace=broker.names.namespace)
        async with acme:
            wl = await acme.create_workload(WorkloadSpec(name="rl", init_from_checkpoint="ckpts/smolvla", **kw))
            assert wl.record.spec.init_from_checkpoint == str(ckpt.resolve())
            await acme.cancel_workload("rl")  # one active rl workload per tenant
            for name in ("../../elsewhere", str(tmp_path / "elsewhere"), "ckpts"):
                with pytest.raises(InvalidSpec, match="has no LeRobot checkpoint"):
                    await acme.create_workload(WorkloadSpec(name="x", init_from_checkpoint=name, **kw))
            with pytest.raises(InvalidSpec, match="head_hidden is 64"):
                await acme.create_workload(WorkloadSpec(name="y", init_from_checkpoint="ckpts/smolvla",
                                                        **{**kw, "head_hidden": 64}))
            with pytest.raises(InvalidSpec, match="policy type is 'pi05'"):
                await acme.create_workload(WorkloadSpec(name="z", init_from_checkpoint="ckpts/typed-pi05", **kw))
    finally:
        await control.stop()
        await sched.stop()
    records = PolicyRecords(broker)
    v1 = load(await records.load_weights(await records.get("acme", "rl", 1)))
    theirs = load_file(str(ckpt / "model.safetensors"))
    torch.testing.assert_close(v1["lm_expert.layers.1.mlp.down_proj.weight"],
                               theirs["model.vlm_with_expert.lm_expert.layers.1.mlp.down_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(v1["action_out_proj.bias"], theirs["model.action_out_proj.bias"], atol=0, rtol=0)
