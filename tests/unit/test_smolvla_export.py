"""``joynexus base export-lerobot --base smolvla``: a tiny SmolVLA base and a tenant's
``smolvla_expert`` written as a LeRobot ``SmolVLAPolicy`` directory load back in LeRobot's
``SmolVLAPolicy.from_pretrained`` (strict, offline: the VLM's config and tokenizer from the
directory's ``vlm/``) and act as the service does, to 1e-5; the directory loads back here as
the same base; a head of another family or a used directory is refused."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from joynexus.agents.models.features import FeatureSchema, canonicalize_request
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.schemas.errors import InvalidSpec

pytestmark = pytest.mark.timeout(180)

H, S, A, SIDE = 4, 5, 3, 32


def _write_head_export(module: TenantModule, out: Path) -> None:
    """What ``Client.export`` writes: head.safetensors plus manifest.json."""
    from joynexus.agents.models.policyio import weights_bytes

    out.mkdir(parents=True)
    (out / "head.safetensors").write_bytes(weights_bytes(module, 3))
    (out / "manifest.json").write_text(json.dumps({
        "tenant_id": "acme", "workload": "sft", "version": 3, "action_module": "smolvla_expert",
        "head_config": asdict(module.cfg), "base_model": "smolvla-tiny",
        "feature_schema": {"camera_slots": ["front"], "image_hw": [SIDE, SIDE], "state_dim": S, "action_dim": A,
                           "action_horizon": H}}))


def test_export_loads_in_lerobots_from_pretrained_with_the_same_actions(
        tmp_path: Path, offline: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import lerobot.policies.smolvla.smolvlm_with_expert as swe
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (
        policy_action_to_transition,
        transition_to_policy_action,
    )
    from transformers import AutoTokenizer

    from joynexus.agents.models.families import build_base
    from joynexus.agents.models.smolvla_checkpoint import load_smolvla_base
    from joynexus.ops.cli.app import main

    torch.set_num_threads(1)
    base = build_base("smolvla", "tiny")  # what the service's roles build
    cfg = HeadConfig(feature_dim=base.feature_dim, state_dim=S, action_dim=A, action_horizon=H, hidden=48,
                     flow_steps=3, seed=5, kv_layers=base.kv_layout[0])
    tm = TenantModule("acme", "smolvla_expert", cfg)
    with torch.no_grad():
        for p in tm.head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + 11)))
    tm.set_normalization({"observation.state": {"mean": [0.1] * S, "std": [2.0] * S},
                          "action": {"mean": [0.5, 0.0, -0.2], "std": [2.0, 1.0, 0.5]}})
    _write_head_export(tm, tmp_path / "head")
    out = tmp_path / "lerobot"
    assert main(["base", "export-lerobot", "--base", "smolvla", "--head", str(tmp_path / "head"), "--out", str(out),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["normalization"] == "mean_std" and report["base_model"] == "smolvla-tiny"
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json",
            "vlm"} <= set(os.listdir(out))
    # transformers builds a SmolVLMProcessor only with the num2words package (absent here): answer that
    # one read with the exported tokenizer, the only part of it VLAFlowMatching reads.
    vlm = str(out / "vlm")
    monkeypatch.setattr(swe, "AutoProcessor", SimpleNamespace(
        from_pretrained=lambda name, **kw: SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(name))))
    policy = SmolVLAPolicy.from_pretrained(out, local_files_only=True, strict=True)
    assert policy.config.vlm_model_name == str(Path(vlm).resolve()) and policy.config.chunk_size == H
    schema = FeatureSchema(("front",), (SIDE, SIDE), S, A, H, base_model="smolvla-tiny")
    g = torch.Generator().manual_seed(3)
    imgs = torch.randint(0, 256, (2, 3, SIDE, SIDE), generator=g, dtype=torch.uint8)
    state = torch.randn(2, S, generator=g)
    texts = ["push the cube", "push the cube to the goal"]
    fb = canonicalize_request(schema, {"front": imgs}, texts, state)
    noise = torch.randn(2, H, 32, generator=torch.Generator().manual_seed(6))
    inputs = base.prepare(fb, tm.head.prefix_state(fb.state_B_S))
    ours = tm.act(base.features(inputs).tokens(), fb.state_B_S, noise=noise)
    # LeRobot end to end: its preprocessor (newline, the exported tokenizer, mean/std), the policy, its postprocessor.
    pre = PolicyProcessorPipeline.from_pretrained(out, "policy_preprocessor.json", local_files_only=True)
    post = PolicyProcessorPipeline.from_pretrained(out, "policy_postprocessor.json", local_files_only=True,
                                                   to_transition=policy_action_to_transition,
                                                   to_output=transition_to_policy_action)
    batch: dict[str, Any] = {"observation.images.front": imgs.float() / 255.0, "observation.state": state,
                             "task": texts}
    with torch.no_grad():
        theirs = post(policy.predict_action_chunk(pre(batch), noise=noise.clone()))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert float((ours - tm.head.denorm_action(noise[..., :A])).abs().max()) > 1e-2  # the expert moved the noise
    back = load_smolvla_base(str(out))  # the directory is also a resident base
    assert back.config.base_model == "smolvla-tiny"
    torch.testing.assert_close(back.features(inputs).tokens(), base.features(inputs).tokens(), atol=0, rtol=0)
    # Refusals: a used directory; a head of another family.
    assert main(["base", "export-lerobot", "--base", "smolvla", "--head", str(tmp_path / "head"), "--out",
                 str(out)]) == 2
    assert "new or empty directory" in capsys.readouterr().err
    from joynexus.agents.models.smolvla_export import export_smolvla

    with pytest.raises(InvalidSpec, match="holds a smolvla_expert"):
        export_smolvla(base, SimpleNamespace(head_type="pi05_expert", head=None), tmp_path / "x", cameras=["front"])
