"""A tenant's ``smolvla_expert`` started from a LeRobot ``SmolVLAPolicy`` checkpoint
(``WorkloadSpec.init_from_checkpoint``), at the tiny size: the checkpoint's expert acts as the
head it was saved from, to the bit; a checkpoint of another policy type (a π0.5 one for a
``smolvla_expert`` and the other way round), of another base size, of another width or
holding NaN is refused before any weight reaches the head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from joynexus.agents.models.features import FeatureSchema, canonicalize_request
from joynexus.agents.models.grouped import ActRequest, serial_forward
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.smolvla_base import SmolVLABase
from joynexus.agents.models.smolvla_config import SmolVLABaseConfig
from joynexus.schemas.errors import InvalidSpec

pytestmark = pytest.mark.timeout(180)

H = 4
S = 32


@pytest.fixture(scope="module")
def base() -> SmolVLABase:
    torch.set_num_threads(1)
    return SmolVLABase.build(SmolVLABaseConfig(max_state_dim=8))


def tenant(base: SmolVLABase, seed: int, hidden: int = 48) -> TenantModule:
    cfg = HeadConfig(feature_dim=base.feature_dim, state_dim=5, action_dim=3, action_horizon=H, hidden=hidden,
                     flow_steps=3, seed=seed, kv_layers=base.kv_layout[0])
    return TenantModule(f"t{seed}", "smolvla_expert", cfg, lr=1e-3)


def save_policy(base: SmolVLABase, tm: TenantModule, out: Path) -> dict[str, torch.Tensor]:
    """What SmolVLAPolicy.save_pretrained writes for ``base`` and ``tm``'s expert: its state dict
    under ``model.`` and a config.json of type smolvla."""
    from safetensors.torch import save_file

    from joynexus.agents.models.smolvla_lerobot import lerobot_smolvla

    policy = lerobot_smolvla(base, tm.head, steps=3)  # type: ignore[arg-type]
    sd = {f"model.{k}": v.contiguous() for k, v in policy.state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"type": "smolvla", "tokenizer_max_length": 48}))
    return sd


def test_a_smolvla_checkpoints_expert_starts_a_tenants_head(base: SmolVLABase, tmp_path: Path, offline: None) -> None:
    from safetensors.torch import save_file

    from joynexus.agents.models.families import init_expert_head

    src = tenant(base, 3)
    with torch.no_grad():
        for p in src.head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ckpt = tmp_path / "ckpt"
    sd = save_policy(base, src, ckpt)
    dst = tenant(base, 99)
    schema = FeatureSchema(("front",), (S, S), 5, 3, H, base_model="smolvla-tiny")
    g = torch.Generator().manual_seed(4)
    fb = canonicalize_request(schema, {"front": torch.randint(0, 256, (2, 3, S, S), generator=g, dtype=torch.uint8)},
                              ["push the cube", "push it"], torch.randn(2, 5, generator=g))
    noise = torch.randn(2, H, 32, generator=torch.Generator().manual_seed(1))
    before = serial_forward(base, [ActRequest(dst, fb, noise)])[0]
    init_expert_head(dst.head, str(ckpt))
    a, b = (serial_forward(base, [ActRequest(m, fb, noise)])[0] for m in (src, dst))
    torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert not torch.equal(before, a)  # the fresh head acted otherwise: the load changed it
    for k, v in src.head.state_dict().items():
        if k not in ("state_mean", "state_std", "action_mean", "action_std"):
            assert torch.equal(dst.head.state_dict()[k], v), k

    # Refusals, each before a weight reaches the head.
    with pytest.raises(InvalidSpec, match="head_hidden is 64"):
        init_expert_head(tenant(base, 0, hidden=64).head, str(ckpt))
    key = "model.vlm_with_expert.lm_expert.layers.1.mlp.down_proj.weight"
    bad = tmp_path / "nan"
    shutil.copytree(ckpt, bad)
    save_file({**sd, key: torch.full_like(sd[key], float("nan"))}, str(bad / "model.safetensors"))
    victim = tenant(base, 5)
    kept = {k: v.clone() for k, v in victim.head.state_dict().items()}
    with pytest.raises(InvalidSpec, match="NaN or inf"):
        init_expert_head(victim.head, str(bad))
    assert all(torch.equal(v, victim.head.state_dict()[k]) for k, v in kept.items())
    # A VLM of another size (three kept layers, not four): its expert cannot attend to this base.
    save_file({k: v for k, v in sd.items() if ".text_model.layers.3." not in k}, str(bad / "model.safetensors"))
    with pytest.raises(InvalidSpec, match="is not this workload's base"):
        init_expert_head(tenant(base, 6).head, str(bad))
    # A π0.5 checkpoint (type pi05) for a smolvla_expert, and this SmolVLA one for a pi05_expert.
    shutil.copy(ckpt / "model.safetensors", bad / "model.safetensors")
    (bad / "config.json").write_text(json.dumps({"type": "pi05"}))
    with pytest.raises(InvalidSpec, match="policy type is 'pi05'"):
        init_expert_head(tenant(base, 7).head, str(bad))
    pi05 = TenantModule("p", "pi05_expert", HeadConfig(feature_dim=2 * 2 * 16, state_dim=5, action_dim=3,
                                                       action_horizon=H, hidden=32, kv_layers=2), lr=1e-3)
    with pytest.raises(InvalidSpec, match="policy type is 'smolvla'"):
        init_expert_head(pi05.head, str(ckpt))


def test_the_spec_lets_a_smolvla_expert_start_from_a_checkpoint() -> None:
    from joynexus.schemas.workloads import WorkloadSpec

    kw: dict[str, Any] = dict(name="r", task_type="sft", dataset="d", base_model="smolvla-tiny",
                              action_module="smolvla_expert", head_hidden=48)
    assert WorkloadSpec(**kw, init_from_checkpoint="ckpts/smolvla").init_from_checkpoint == "ckpts/smolvla"
    with pytest.raises(InvalidSpec, match="starts a pi05_expert or smolvla_expert head, not 'oft_mlp'"):
        WorkloadSpec(**{**kw, "action_module": "oft_mlp", "base_model": "qwen2.5-vl-tiny"},
                     init_from_checkpoint="ckpts/smolvla")
