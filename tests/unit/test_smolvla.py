"""The SmolVLA base family and its ``smolvla_expert`` head, at the tiny size (random weights,
built from the project's configs and tokenizer, nothing downloaded): grouped == serial for
forwards, train steps and weights; the cache path equal to LeRobot's own ``VLAFlowMatching``
(its ``sample_actions`` and its training forward); the real size's shapes equal to what
LeRobot builds from the same config; the cache's size bounded and reported."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from joynexus.agents.models.features import (
    FeatureBatch,
    FeatureSchema,
    IncompatibleBatches,
    canonicalize_request,
)
from joynexus.agents.models.grouped import (
    ActRequest,
    TrainItem,
    for_base,
    grouped_forward,
    grouped_train_step,
    isolated_train_step,
    serial_forward,
    serial_train_step,
)
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.smolvla import SmolVLAExpertHead, smolvla_expert_from_lerobot
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.smolvla_base import SmolVLABase
from joynexus.agents.models.smolvla_config import SMOLVLM_SIZES, SmolVLABaseConfig
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

pytestmark = pytest.mark.timeout(180)

H = 4  # action horizon of the tests' tenants
S = 32  # the tiny base's image side


@pytest.fixture(scope="module")
def base() -> SmolVLABase:
    torch.set_num_threads(1)
    return SmolVLABase.build(SmolVLABaseConfig(max_state_dim=8))


def batch(seed: int, b: int, state_dim: int = 5, cams: tuple[str, ...] = ("front", "wrist"),
          text: str = "push the cube to the goal", side: int = S) -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    schema = FeatureSchema(cams, (side, side), state_dim, 3, H, base_model="smolvla-tiny")
    imgs = {c: torch.randint(0, 256, (b, 3, side, side), generator=g, dtype=torch.uint8) for c in cams}
    texts = [text if i % 2 else f"{text} now, carefully" for i in range(b)]
    return canonicalize_request(schema, imgs, texts, torch.randn(b, state_dim, generator=g))


def tenant(base: SmolVLABase, name: str, state_dim: int, seed: int, head: str = "smolvla_expert",
           action_dim: int = 3, hidden: int = 48) -> TenantModule:
    cfg = HeadConfig(feature_dim=base.feature_dim, state_dim=state_dim, action_dim=action_dim, action_horizon=H,
                     hidden=hidden, flow_steps=3, seed=seed,
                     kv_layers=base.kv_layout[0] if head == "smolvla_expert" else 0)
    return TenantModule(name, head, cfg, lr=1e-3)


def jitter(m: TenantModule, salt: int = 0) -> None:
    """A trained-looking expert: unit norms and fresh inits would hide some paths."""
    with torch.no_grad():
        for p in m.head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + salt)))


def test_prefix_layout_and_cache_bytes_are_reported(base: SmolVLABase) -> None:
    from joynexus.agents.models.pi05_base import cache_bytes

    d = base.describe(n_cameras=2)
    n, kvh, hd = base.kv_layout
    assert (n, kvh, hd) == (4, 2, 16) and d["feature_dim"] == n * 2 * kvh * hd == base.feature_dim == 256
    assert d["family"] == "smolvla" and d["params"]["base"] == base.num_params() > d["params"]["vision"] > 0
    assert len(base.model.text_model.layers) == 4  # LeRobot keeps num_vlm_layers of the 5
    fb = batch(1, 2)
    feats = base.encode_tokens(for_base(base, fb, tenant(base, "a", 5, 0)))
    assert feats.h_B_L_D is not None and feats.real_B_L is not None
    # two cameras of (32 / 8)^2 / 2^2 = 4 tokens, then the text, the state token, then pads
    assert base.config.image_tokens == 4 and bool(feats.real_B_L[:, :8].all())
    lengths = feats.real_B_L.sum(1)
    assert all(bool(feats.real_B_L[i, : int(lengths[i])].all()) for i in range(2))  # real tokens first
    assert int(lengths[0]) != int(lengths[1])  # the two instructions differ in length
    longest = int(lengths.max())
    assert cache_bytes(feats) == 2 * longest * (base.feature_dim + 1) * 4
    assert d["kv_bytes_per_row"] == d["prefix_tokens_per_sample"] * (base.feature_dim + 1) * 4
    _, lens = base.tokenize(["pick up the cube"])
    assert d["prefix_tokens_per_sample"] == 2 * 4 + int(lens[0]) + 1


def test_hostile_inputs_are_refused_or_bounded(base: SmolVLABase) -> None:
    head = tenant(base, "a", 9, 0).head
    assert isinstance(head, SmolVLAExpertHead)
    with pytest.raises(ShapeMismatch, match="max_state_dim"):
        base.prepare(batch(2, 1, state_dim=9), head.prefix_state(torch.zeros(1, 9)))
    with pytest.raises(InvalidSpec, match="NaN"):
        base.state(torch.tensor([[float("nan"), 0.0]]))
    _, lengths = base.tokenize(["x " * 5000, ""])
    assert int(lengths[0]) == base.config.max_text_tokens and int(lengths[1]) >= 1
    with pytest.raises(InvalidSpec, match="no SmolVLA base's cache"):
        SmolVLAExpertHead(HeadConfig(feature_dim=base.feature_dim, state_dim=5, kv_layers=3))
    with pytest.raises(InvalidSpec, match="max_action_dim"):
        SmolVLAExpertHead(HeadConfig(feature_dim=base.feature_dim, state_dim=5, action_dim=33, kv_layers=4))
    # An image of another size is resized with LeRobot's left/top padding, never refused.
    odd = batch(3, 1, side=20)
    assert base.images(odd.images, odd.schema.camera_slots).shape == (2, 1, 3, S, S)


def test_grouped_equals_serial_forward(base: SmolVLABase) -> None:
    specs = [(5, 0, batch(3, 2, 5)), (7, 1, batch(4, 3, 7, text="pick up the red cube")), (4, 2, batch(5, 1, 4))]
    reqs = []
    for sd, seed, fb in specs:
        m = tenant(base, f"t{seed}", sd, seed)
        jitter(m, seed)
        noise = torch.randn(fb.batch_size, H, 3, generator=torch.Generator().manual_seed(seed))
        reqs.append(ActRequest(m, fb, noise))
    grouped = grouped_forward(base, reqs)
    serial = serial_forward(base, reqs)
    assert [tuple(g.shape) for g in grouped] == [(2, H, 3), (3, H, 3), (1, H, 3)]
    for g, s in zip(grouped, serial, strict=True):
        torch.testing.assert_close(g, s, atol=1e-5, rtol=1e-5)
    alone = serial_forward(base, [ActRequest(reqs[1].tenant, reqs[1].batch, reqs[1].noise)])[0]
    torch.testing.assert_close(grouped[1], alone, atol=1e-5, rtol=1e-5)
    other = serial_forward(base, [ActRequest(reqs[0].tenant, reqs[0].batch, torch.zeros(2, H, 3))])[0]
    assert not torch.allclose(other, grouped[0])
    # The state reaches the actions through the prefix's state token (the base's state_proj).
    fb = reqs[0].batch
    moved = replace(fb, state_B_S=fb.state_B_S + 1.0)
    shifted = serial_forward(base, [ActRequest(reqs[0].tenant, moved, reqs[0].noise)])[0]
    assert not torch.allclose(shifted, grouped[0])


def test_grouped_train_steps_equal_serial_and_isolate_tenants(base: SmolVLABase) -> None:
    def items() -> list[TrainItem]:
        out = []
        for i, (sd, fb) in enumerate([(5, batch(6, 2, 5)), (7, batch(7, 3, 7)), (6, batch(8, 2, 6))]):
            head = "flow_matching" if i == 2 else "smolvla_expert"  # a pooled head shares the same forward
            target = torch.randn(fb.batch_size, H, 3, generator=torch.Generator().manual_seed(50 + i))
            out.append(TrainItem(tenant(base, f"t{i}", sd, i, head=head), fb, target))
        return out

    g_items, s_items, i_items = items(), items(), items()
    g_curves = [grouped_train_step(base, g_items) for _ in range(4)]
    s_curves = [serial_train_step(base, s_items) for _ in range(4)]
    i_curves = [isolated_train_step(base, i_items) for _ in range(4)]  # the actor's step
    assert i_curves == g_curves
    for lg_step, ls_step in zip(g_curves, s_curves, strict=True):
        for lg, ls in zip(lg_step, ls_step, strict=True):
            assert abs(lg - ls) <= 1e-4 * max(1.0, abs(ls)), (g_curves, s_curves)
    for gi, si in zip(g_items, s_items, strict=True):
        gs, ss = gi.tenant.head.state_dict(), si.tenant.head.state_dict()
        for k in gs:
            torch.testing.assert_close(gs[k], ss[k], atol=1e-5, rtol=1e-4)
    assert [it.tenant.version for it in g_items] == [4, 4, 4]
    assert g_curves[-1][0] < g_curves[0][0] or g_curves[-1][1] < g_curves[0][1]

    before = [{k: v.clone() for k, v in it.tenant.head.state_dict().items()} for it in g_items]
    grouped_train_step(base, [g_items[1]])
    for i in (0, 2):
        after = g_items[i].tenant.head.state_dict()
        assert all(torch.equal(before[i][k], after[k]) for k in before[i])
    assert any(not torch.equal(before[1][k], v) for k, v in g_items[1].tenant.head.state_dict().items())
    assert not any(p.requires_grad for p in base.model.parameters())
    assert not base.state_proj.weight.requires_grad


def test_incompatible_cameras_duplicate_tenants_and_a_missing_state_are_refused(base: SmolVLABase) -> None:
    a = tenant(base, "a", 5, 0)
    b = tenant(base, "b", 5, 1)
    with pytest.raises(IncompatibleBatches):
        grouped_forward(base, [ActRequest(a, batch(9, 1)), ActRequest(b, batch(10, 1, cams=("front",)))])
    with pytest.raises(InvalidSpec, match="twice"):
        grouped_train_step(base, [TrainItem(a, batch(9, 1), torch.zeros(1, H, 3)),
                                  TrainItem(a, batch(10, 1), torch.zeros(1, H, 3))])
    with pytest.raises(InvalidSpec, match="prefix state"):
        base.encode_tokens(batch(9, 1))


def _lerobot_inputs(base: SmolVLABase, fb: FeatureBatch, tm: TenantModule) -> tuple[Any, list[Any], list[Any], Any]:
    inputs = base.prepare(fb, tm.head.prefix_state(fb.state_B_S))
    real = torch.arange(inputs.ids_B_T.shape[1])[None, :] < inputs.lengths_B[:, None]
    images = list(inputs.pixels_K_B_C_S_S)
    return inputs, images, [torch.ones(fb.batch_size, dtype=torch.bool)] * len(images), real


def test_cache_path_equals_lerobots_sample_actions(base: SmolVLABase, offline: None) -> None:
    """LeRobot's own VLAFlowMatching.sample_actions (its prefix, masks, positions, RoPE, expert
    and denoising loop) on the same weights, inputs and noise gives the cache path's actions
    to 1e-5; and its training forward gives the same per-element losses at the same noise and time."""
    from joynexus.agents.models.smolvla_lerobot import lerobot_smolvla

    tm = tenant(base, "a", 5, 3)
    jitter(tm)
    fb = batch(11, 3, 5)
    inputs, images, masks, real = _lerobot_inputs(base, fb, tm)
    noise = torch.randn(3, H, 32, generator=torch.Generator().manual_seed(5))
    feats = base.features(inputs).tokens()
    ours = tm.act(feats, fb.state_B_S, noise=noise, steps=4)
    ref_model = lerobot_smolvla(base, tm.head, steps=4)
    with torch.no_grad():
        ref = ref_model.sample_actions(images, masks, inputs.ids_B_T, real, inputs.state_B_S, noise=noise.clone())
    assert ref.shape == (3, H, 32)
    head = tm.head
    assert isinstance(head, SmolVLAExpertHead)
    torch.testing.assert_close(ours, head.denorm_action(ref[..., :3]), atol=1e-5, rtol=1e-5)
    assert float((ours - head.denorm_action(noise[..., :3])).abs().max()) > 1e-2  # the expert moved the noise
    # Training: LeRobot's forward (the whole prefix and suffix in one pass) vs the head over the cache.
    actions = torch.randn(3, H, 32, generator=torch.Generator().manual_seed(6))
    t = torch.tensor([0.9, 0.5, 0.05])
    with torch.no_grad():
        ref_losses = ref_model.forward(images, masks, inputs.ids_B_T, real, inputs.state_B_S, actions, noise, t)
        cache, rl = head._cache(feats)
        te = t[:, None, None]
        v = head.velocity(cache, rl, te * noise + (1 - te) * actions, t)
    torch.testing.assert_close((noise - actions - v) ** 2, ref_losses, atol=1e-5, rtol=1e-5)


def test_real_size_matches_lerobots_smolvlm2_500m_shapes(offline: None) -> None:
    """The ``smolvlm2_500m`` base and expert, on the meta device, have exactly the parameter
    names and shapes LeRobot's VLAFlowMatching builds from the same config (16 kept layers,
    the 720-wide expert, its cross-attention k/v projections)."""
    from lerobot.policies.smolvla.modeling_smolvla import VLAFlowMatching

    from joynexus.agents.models.heads.base import build_head
    from joynexus.agents.models.heads.smolvla import smolvla_lerobot_keys
    from joynexus.agents.models.smolvla_config import build_smolvlm_config
    from joynexus.agents.models.smolvla_describe import meta_base
    from joynexus.agents.models.smolvla_lerobot import lerobot_smolvla_config, offline_smolvlm

    ours = meta_base("smolvlm2_500m")
    cfg = ours.config
    assert cfg.expert_width == 720 and cfg.image_tokens == 64 and ours.feature_dim == 16 * 2 * 5 * 64
    with torch.device("meta"), offline_smolvlm(build_smolvlm_config(cfg, len(ours.tokenizer))):
        ref = VLAFlowMatching(lerobot_smolvla_config(cfg, cfg.expert_width, horizon=50, steps=10))
    ref_shapes = {k: tuple(v.shape) for k, v in ref.named_parameters()}
    base_shapes = {f"vlm_with_expert.vlm.model.{k}": tuple(v.shape) for k, v in ours.model.named_parameters()}
    base_shapes.update({f"state_proj.{k}": tuple(v.shape) for k, v in ours.state_proj.named_parameters()})
    with torch.device("meta"):
        head = build_head("smolvla_expert", HeadConfig(ours.feature_dim, 8, 7, 50, hidden=720, kv_layers=16))
    head_shapes = {k[len("model."):]: tuple(v.shape) for k, v in smolvla_lerobot_keys(dict(head.named_parameters())).items()}
    ignored = ("vlm_with_expert.vlm.lm_head.",)  # never read by SmolVLA; not held here
    assert {k: v for k, v in ref_shapes.items() if not k.startswith(ignored)} == {**base_shapes, **head_shapes}
    assert base_shapes["vlm_with_expert.vlm.model.text_model.layers.15.self_attn.k_proj.weight"] == (320, 960)
    assert "vlm_with_expert.vlm.model.text_model.layers.16.mlp.up_proj.weight" not in base_shapes
    assert head_shapes["vlm_with_expert.lm_expert.layers.1.self_attn.k_proj.weight"] == (320, 320)  # cross
    assert head_shapes["vlm_with_expert.lm_expert.layers.0.self_attn.k_proj.weight"] == (320, 720)  # self
    assert head_shapes["vlm_with_expert.lm_expert.layers.0.mlp.up_proj.weight"] == (2048, 720)


def test_base_describe_command(base: SmolVLABase, capsys: pytest.CaptureFixture[str]) -> None:
    """``joynexus base describe --base smolvla``: counted without weights, agreeing with a built base."""
    import json

    from joynexus.agents.models.families import describe
    from joynexus.ops.cli.app import main

    assert main(["base", "describe", "--base", "smolvla", "--cameras", "2", "--state-dim", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    built = SmolVLABase.build(SmolVLABaseConfig())  # describe counts the default max_state_dim (32)
    assert d["family"] == "smolvla" and d["params"]["base"] == built.num_params()
    assert d["params"]["head"] == tenant(base, "a", 5, 0).num_params()  # the tiny expert (width 48)
    assert d["feature_dim"] == base.feature_dim and d["kv_layers"] == 4 and d["expert_width"] == 48
    assert d["prefix_tokens_per_sample"] == built.prefix_tokens(2)
    assert d["kv_bytes_per_row"] == d["prefix_tokens_per_sample"] * (base.feature_dim + 1) * 4
    real = describe("smolvla", "smolvlm2_500m", cameras=3, state_dim=8)
    assert real["feature_dim"] == 10240 and real["image_tokens"] == 64
    assert real["prefix_tokens_per_sample"] > 3 * 64  # three cameras of 64 tokens, the text, the state
    assert 250_000_000 < real["params"]["base"] < 400_000_000  # SigLIP-B/16 + 16 SmolLM2 layers + embeddings
    assert 50_000_000 < real["params"]["head"] < 150_000_000  # the 720-wide, 16-layer expert
    assert main(["base", "describe", "--base", "smolvla", "--size", "huge"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_base_family_is_chosen_per_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from joynexus.agents.models.families import build_base
    from joynexus.ops.cli.app import main
    from joynexus.ops.runtime.launcher import BASE_ROLES, launch, role_slots

    slots = role_slots("nats://127.0.0.1:1", "ns", ["scheduler", "inference", "actor"], out_dir=Path("/tmp/x/actor"),
                       extra={r: ["--base", "smolvla", "--backbone", "tiny"] for r in BASE_ROLES})
    argv = {s.role: s.argv for s in slots}  # type: ignore[attr-defined]
    assert argv["inference"][-4:] == ["--base", "smolvla", "--backbone", "tiny"]
    assert launch("nats://127.0.0.1:1", "ns", ["scheduler"], out_dir=Path("/tmp/x"), base=("smolvla", "bench")) == 2
    assert "sizes are" in capsys.readouterr().err
    assert main(["agent", "inference", "--base", "smolvla", "--backbone", "gemma_2b", "--nats", "nats://127.0.0.1:1"]) == 2
    assert "not a smolvla size" in capsys.readouterr().err
    b = build_base("smolvla", "tiny")
    assert isinstance(b, SmolVLABase) and b.family == "smolvla" and b.config.base_model == "smolvla-tiny"
    with pytest.raises(InvalidSpec, match="expected a LeRobot policy directory"):
        build_base("smolvla", "tiny", path="/nonexistent")


def test_specs_name_smolvla_expert_only_on_a_smolvla_base() -> None:
    from joynexus.agents.featureschema import SMOLVLA_KV, feature_dim
    from joynexus.agents.models.policyio import fresh_module
    from joynexus.schemas.catalog import SMOLVLA_BASE_MODELS, base_family
    from joynexus.schemas.workloads import WorkloadSpec

    for name, size in SMOLVLA_BASE_MODELS.items():  # the light tables agree with the configs
        s = SMOLVLM_SIZES[size]
        t = s["text"]
        assert SMOLVLA_KV[size] == (s["num_vlm_layers"], t["num_key_value_heads"] * t["head_dim"])
        assert feature_dim(name) == s["num_vlm_layers"] * 2 * t["num_key_value_heads"] * t["head_dim"]
        assert base_family(name) == "smolvla"
    spec = WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="smolvla-tiny",
                        action_module="smolvla_expert", head_hidden=48, action_horizon=H)
    schema = FeatureSchema(("front",), (S, S), 5, 3, H, base_model="smolvla-tiny")
    m = fresh_module("acme", spec, schema, {})
    assert isinstance(m.head, SmolVLAExpertHead) and m.cfg.kv_layers == 4 and m.cfg.feature_dim == 256
    base = SmolVLABase.build(SmolVLABaseConfig())
    fb = canonicalize_request(schema, {"front": torch.zeros(1, 3, S, S, dtype=torch.uint8)}, "go", torch.zeros(1, 5))
    assert serial_forward(base, [ActRequest(m, fb)])[0].shape == (1, H, 3)
    WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="smolvla-tiny", action_module="gr00t_flow")
    for other in ("qwen2.5-vl-tiny", "pi05-tiny"):
        with pytest.raises(InvalidSpec, match="attends to a smolvla base"):
            WorkloadSpec(name="w", task_type="sft", dataset="d", base_model=other, action_module="smolvla_expert")
    with pytest.raises(InvalidSpec, match="attends to a pi05 base"):
        WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="smolvla-tiny", action_module="pi05_expert")
    with pytest.raises(InvalidSpec, match="must be even"):
        WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="smolvla-tiny",
                     action_module="smolvla_expert", head_hidden=33)


def test_a_lerobot_policys_expert_becomes_a_tenants_head(base: SmolVLABase, tmp_path: Any, offline: None) -> None:
    """LeRobot's own VLAFlowMatching state dict, saved under SmolVLAPolicy's names, loads into a
    fresh ``smolvla_expert`` (every expert weight, nothing else) and acts the same."""
    from safetensors.torch import load_file, save_file

    from joynexus.agents.models.smolvla_lerobot import lerobot_smolvla

    src = tenant(base, "a", 5, 3)
    jitter(src, 1)
    ref = lerobot_smolvla(base, src.head, steps=3)
    sd = {f"model.{k}": v.contiguous() for k, v in ref.state_dict().items()
          if not k.startswith(("vlm_with_expert.vlm.", "state_proj."))}  # the base stays the resident one
    save_file(sd, str(tmp_path / "model.safetensors"))
    dst = tenant(base, "b", 5, 99)
    missing, unexpected = dst.head.load_state_dict(
        smolvla_expert_from_lerobot(load_file(str(tmp_path / "model.safetensors"))), strict=False)
    assert set(missing) == {"state_mean", "state_std", "action_mean", "action_std"}
    assert unexpected == []
    fb = batch(12, 2, 5)
    noise = torch.randn(2, H, 32, generator=torch.Generator().manual_seed(1))
    a, b = (serial_forward(base, [ActRequest(m, fb, noise)])[0] for m in (src, dst))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(InvalidSpec, match="no SmolVLA action expert"):
        smolvla_expert_from_lerobot({"model.vlm_with_expert.vlm.x": torch.zeros(1)})


def test_the_cache_counts_against_an_engines_rows(base: SmolVLABase) -> None:
    from joynexus.agents.models.families import cache_row_cap, describe, kv_budget_bytes

    four = FeatureSchema(("a", "b", "c", "d"), (S, S), 8, 3, H, base_model="smolvla-tiny")
    fb = canonicalize_request(four, {c: torch.zeros(1, 3, S, S, dtype=torch.uint8) for c in four.camera_slots},
                              "é" * 4000, torch.full((1, 8), -0.9))
    feats = base.encode_tokens(for_base(base, fb, tenant(base, "a", 8, 0)))
    assert feats.real_B_L is not None and int(feats.real_B_L.sum()) == base.max_prefix_tokens(4)
    per_row = base.kv_bytes_per_row(base.max_prefix_tokens())
    assert cache_row_cap(base, 64, 10 * per_row) == 10 and cache_row_cap(base, 64, 10**12) == 64
    real = describe("smolvla", "smolvlm2_500m", cameras=2)
    assert real["rows_within_kv_budget"] == kv_budget_bytes() // real["max_kv_bytes_per_row"] < 1024


def test_bench_families_smoke() -> None:
    from joynexus.ops.bench.families import bench_families

    r = bench_families("smolvla", "tiny", tenants=2, rows=(1, 2), repeats=2)
    assert r["family"] == "smolvla" and r["base_model"] == "smolvla-tiny" and r["params"] > 0
    assert set(r["grid"]) == {"2x1", "2x2"}
    for cell in r["grid"].values():
        assert cell["rounds"] == 2 and cell["grouped_ms"] > 0 and cell["serial_ms"] > 0
        lo, hi = cell["speedup_ci95"]
        assert lo <= cell["speedup"] <= hi


def test_a_lerobot_policy_directory_becomes_the_resident_base(tmp_path: Any, offline: None,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``--backbone-path DIR`` with what SmolVLAPolicy.save_pretrained writes: the size read from
    the tensors' shapes, every VLM weight and state_proj loaded (the same cache as the source
    base), the expert's weights in the same file becoming a tenant's head; hostile files refused."""
    import json

    from safetensors.torch import load_file, save_file

    from joynexus.agents.models.families import build_base
    from joynexus.agents.models.smolvla_checkpoint import load_smolvla_base
    from joynexus.agents.models.smolvla_lerobot import lerobot_smolvla

    src = SmolVLABase.build(SmolVLABaseConfig(max_state_dim=6, seed=7))
    tm = tenant(src, "a", 5, 3)
    jitter(tm, 2)
    policy = lerobot_smolvla(src, tm.head, steps=3)
    save_file({f"model.{k}": v.contiguous() for k, v in policy.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"type": "smolvla", "tokenizer_max_length": 48,
                                                      "vlm_model_name": "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"}))
    loaded = build_base("smolvla", "smolvlm2_500m", path=str(tmp_path))  # the directory fixes the size
    assert isinstance(loaded, SmolVLABase) and loaded.config.base_model == "smolvla-tiny"
    assert loaded.config.max_state_dim == 6 and not any(p.requires_grad for p in loaded.model.parameters())
    fb = batch(13, 2, 5)
    state = tm.head.prefix_state(fb.state_B_S)
    want = src.features(src.prepare(fb, state)).tokens()
    torch.testing.assert_close(loaded.features(loaded.prepare(fb, state)).tokens(), want, atol=0, rtol=0)
    fresh = SmolVLABase.build(SmolVLABaseConfig(max_state_dim=6))
    assert not torch.equal(fresh.features(fresh.prepare(fb, state)).tokens(), want)
    # `joynexus base describe --base smolvla --path DIR`: the same figures, without loading a tensor.
    from joynexus.ops.cli.app import main

    capsys.readouterr()  # LeRobot's own prints so far
    assert main(["base", "describe", "--base", "smolvla", "--path", str(tmp_path), "--state-dim", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["size"] == "tiny" and d["max_state_dim"] == 6 and d["params"]["base"] == loaded.num_params()
    assert d["prefix_tokens_per_sample"] == loaded.prefix_tokens(1) and d["path"] == str(tmp_path)
    assert main(["base", "describe", "--base", "pi05", "--path", str(tmp_path)]) == 2
    assert "its policy type is 'smolvla'; a pi05 base loads type ['pi05']" in capsys.readouterr().err
    dst = tenant(loaded, "b", 5, 99)
    dst.head.load_state_dict(smolvla_expert_from_lerobot(load_file(str(tmp_path / "model.safetensors"))), strict=False)
    noise = torch.randn(2, H, 32, generator=torch.Generator().manual_seed(2))
    a, b = (serial_forward(base_, [ActRequest(m, fb, noise)])[0] for base_, m in ((src, tm), (loaded, dst)))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Hostile directories: a VLM of no hosted size or misshapen, tensors missing, bytes that are
    # not safetensors, a config that is not SmolVLA's.
    sd = load_file(str(tmp_path / "model.safetensors"))
    for layer, match in ((0, "none of the hosted SmolVLM sizes"), (3, "do not load into smolvla-tiny")):
        key = f"model.vlm_with_expert.vlm.model.text_model.layers.{layer}.mlp.up_proj.weight"
        save_file({**sd, key: torch.zeros(7, 64)}, str(tmp_path / "model.safetensors"))
        with pytest.raises(InvalidSpec, match=match):
            load_smolvla_base(str(tmp_path))
    save_file({k: v for k, v in sd.items() if "connector" not in k}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidSpec, match="not a LeRobot SmolVLA checkpoint"):
        load_smolvla_base(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(InvalidSpec, match="not a safetensors file"):
        load_smolvla_base(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"type": "pi05"}))
    with pytest.raises(InvalidSpec, match="not a SmolVLA policy config"):
        load_smolvla_base(str(tmp_path))
