"""The π0.5 base family and its ``pi05_expert`` head, at the tiny size (random weights,
built from the project's configs and tokenizer, nothing downloaded): grouped == serial
for forwards, train steps and weights; the cache's size bounded and reported."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grouped_checks import assert_same_steps

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
from joynexus.agents.models.heads.pi05 import Pi05ExpertHead
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.pi05_base import Pi05Base, cache_bytes, discretize_state
from joynexus.agents.models.pi05_config import GEMMA_VARIANTS, Pi05BaseConfig
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

pytestmark = pytest.mark.timeout(120)

H = 4  # action horizon of the tests' tenants


@pytest.fixture(scope="module")
def base() -> Pi05Base:
    torch.set_num_threads(1)
    return Pi05Base.build(Pi05BaseConfig(max_state_dim=8))


def batch(seed: int, b: int, state_dim: int = 5, cams: tuple[str, ...] = ("front", "wrist"),
          text: str = "push the cube to the goal") -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    schema = FeatureSchema(cams, (56, 56), state_dim, 3, H, base_model="pi05-tiny")
    imgs = {c: torch.randint(0, 256, (b, 3, 56, 56), generator=g, dtype=torch.uint8) for c in cams}
    texts = [text if i % 2 else f"{text} now" for i in range(b)]
    return canonicalize_request(schema, imgs, texts, torch.randn(b, state_dim, generator=g))


def tenant(base: Pi05Base, name: str, state_dim: int, seed: int, head: str = "pi05_expert",
           action_dim: int = 3) -> TenantModule:
    cfg = HeadConfig(feature_dim=base.feature_dim, state_dim=state_dim, action_dim=action_dim, action_horizon=H,
                     hidden=32, flow_steps=3, seed=seed, kv_layers=base.kv_layout[0] if head == "pi05_expert" else 0)
    return TenantModule(name, head, cfg, lr=1e-3)


def test_state_is_discretised_into_256_bins_as_openpi() -> None:
    import numpy as np

    bins = discretize_state(np.array([[-1.0, -0.999, 0.0, 0.999, 1.0]]))
    assert bins.tolist() == [[0, 0, 128, 255, 255]]


def test_prefix_layout_and_cache_bytes_are_reported(base: Pi05Base) -> None:
    d = base.describe(n_cameras=2, state_dim=5)
    n, kvh, hd = base.kv_layout
    assert (n, kvh, hd) == (2, 1, 8) and d["feature_dim"] == n * 2 * kvh * hd == base.feature_dim
    assert d["family"] == "pi05" and d["params"]["base"] == base.num_params() > d["params"]["vision"] > 0
    # two cameras of (56 / 14)^2 SigLIP tokens, then the prompt
    fb = batch(1, 2)
    feats = base.encode_tokens(for_base(base, fb, tenant(base, "a", 5, 0)))
    assert feats.h_B_L_D is not None and feats.real_B_L is not None
    assert bool(feats.real_B_L[:, : 2 * 16].all())
    longest = int(feats.real_B_L.sum(1).max())
    assert d["prefix_tokens_per_sample"] <= longest + 8  # the describe() instruction is short
    assert cache_bytes(feats) == 2 * longest * (base.feature_dim + 1) * 4
    assert d["kv_bytes_per_row"] == d["prefix_tokens_per_sample"] * (base.feature_dim + 1) * 4
    # A real-size base's figures come from the same formula (no weights built).
    big = GEMMA_VARIANTS["gemma_2b"]
    assert big["depth"] * 2 * big["num_kv_heads"] * big["head_dim"] == 9216


def test_prompt_bounds_refuse_hostile_inputs(base: Pi05Base) -> None:
    head = tenant(base, "a", 9, 0).head
    assert isinstance(head, Pi05ExpertHead)
    with pytest.raises(ShapeMismatch, match="max_state_dim"):
        base.prepare(batch(2, 1, state_dim=9), head.prefix_state(torch.zeros(1, 9)))
    long_text = "x " * 5000
    _, lengths = base.tokenize([long_text], torch.zeros(1, 3).numpy())
    assert int(lengths[0]) <= 1 + base.config.max_text_tokens + 64  # instruction cut, fixed prompt around it
    with pytest.raises(InvalidSpec, match="kv_layers"):
        tenant(base, "b", 5, 0, head="pi05_expert").head.__class__(
            HeadConfig(feature_dim=base.feature_dim, state_dim=5, kv_layers=3))
    # An extreme state is clipped into the prompt's bins, never out of them.
    ids2, _ = base.tokenize(["go"], torch.full((1, 3), 1e30).numpy())
    assert ids2.shape[0] == 1


def test_grouped_equals_serial_forward(base: Pi05Base) -> None:
    specs = [(5, 0, batch(3, 2, 5)), (7, 1, batch(4, 3, 7, text="pick up the red cube")), (4, 2, batch(5, 1, 4))]
    reqs = []
    for sd, seed, fb in specs:
        noise = torch.randn(fb.batch_size, H, 3, generator=torch.Generator().manual_seed(seed))
        reqs.append(ActRequest(tenant(base, f"t{seed}", sd, seed), fb, noise))
    grouped = grouped_forward(base, reqs)
    serial = serial_forward(base, reqs)
    assert [tuple(g.shape) for g in grouped] == [(2, H, 3), (3, H, 3), (1, H, 3)]
    for g, s in zip(grouped, serial, strict=True):
        torch.testing.assert_close(g, s, atol=1e-5, rtol=1e-5)
    # Rows are independent: a row's actions do not depend on who shares its forward.
    alone = serial_forward(base, [ActRequest(reqs[1].tenant, reqs[1].batch, reqs[1].noise)])[0]
    torch.testing.assert_close(grouped[1], alone, atol=1e-5, rtol=1e-5)
    # Different noise gives different actions (the expert really denoises).
    other = serial_forward(base, [ActRequest(reqs[0].tenant, reqs[0].batch, torch.zeros(2, H, 3))])[0]
    assert not torch.allclose(other, grouped[0])


def test_grouped_train_steps_equal_serial_and_isolate_tenants(base: Pi05Base) -> None:
    def items() -> list[TrainItem]:
        out = []
        for i, (sd, fb) in enumerate([(5, batch(6, 2, 5)), (7, batch(7, 3, 7)), (6, batch(8, 2, 6))]):
            head = "flow_matching" if i == 2 else "pi05_expert"  # a pooled head shares the same forward
            target = torch.randn(fb.batch_size, H, 3, generator=torch.Generator().manual_seed(50 + i))
            out.append(TrainItem(tenant(base, f"t{i}", sd, i, head=head), fb, target))
        return out

    g_items, s_items, i_items = items(), items(), items()
    g_curves = [grouped_train_step(base, g_items) for _ in range(4)]
    s_curves = [serial_train_step(base, s_items) for _ in range(4)]
    i_curves = [isolated_train_step(base, i_items) for _ in range(4)]  # the actor's step
    assert i_curves == g_curves
    assert_same_steps(g_curves, s_curves, g_items, s_items)
    assert [it.tenant.version for it in g_items] == [4, 4, 4]
    # The expert's loss falls on its own data (it learns through the cache).
    assert g_curves[-1][0] < g_curves[0][0] or g_curves[-1][1] < g_curves[0][1]

    before = [{k: v.clone() for k, v in it.tenant.head.state_dict().items()} for it in g_items]
    grouped_train_step(base, [g_items[1]])
    for i in (0, 2):
        after = g_items[i].tenant.head.state_dict()
        assert all(torch.equal(before[i][k], after[k]) for k in before[i])
    assert any(not torch.equal(before[1][k], v) for k, v in g_items[1].tenant.head.state_dict().items())
    assert not any(p.requires_grad for p in base.model.parameters())


def test_incompatible_cameras_duplicate_tenants_and_a_missing_state_are_refused(base: Pi05Base) -> None:
    a = tenant(base, "a", 5, 0)
    b = tenant(base, "b", 5, 1)
    with pytest.raises(IncompatibleBatches):
        grouped_forward(base, [ActRequest(a, batch(9, 1)), ActRequest(b, batch(10, 1, cams=("front",)))])
    with pytest.raises(InvalidSpec, match="twice"):
        grouped_train_step(base, [TrainItem(a, batch(9, 1), torch.zeros(1, H, 3)),
                                  TrainItem(a, batch(10, 1), torch.zeros(1, H, 3))])
    # Without the prompt's state the base refuses to guess it.
    with pytest.raises(InvalidSpec, match="prefix state"):
        base.encode_tokens(batch(9, 1))


def test_cache_path_equals_lerobots_sample_actions(base: Pi05Base) -> None:
    """LeRobot's own PI05Pytorch.sample_actions (its prefix, masks, positions, denoising
    loop) on the same weights, inputs and noise gives the cache path's actions to 1e-5."""
    from joynexus.agents.models.pi05_lerobot import lerobot_model, openpi_transformers

    tm = tenant(base, "a", 5, 3)
    with torch.no_grad():  # a trained-looking expert: the adaptive norms' zero init would hide their path
        for p in tm.head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    fb = batch(11, 3, 5)
    inputs = base.prepare(fb, tm.head.prefix_state(fb.state_B_S))
    noise = torch.randn(3, H, 32, generator=torch.Generator().manual_seed(5))
    ours = tm.act(base.features(inputs).tokens(), fb.state_B_S, noise=noise, steps=4)
    with openpi_transformers():
        ref_model = lerobot_model(base, tm.head, steps=4)
        real = torch.arange(inputs.ids_B_T.shape[1])[None, :] < inputs.lengths_B[:, None]
        images = list(inputs.pixels_K_B_C_S_S)
        ref = ref_model.sample_actions(images, [torch.ones(3, dtype=torch.bool)] * len(images),
                                       inputs.ids_B_T, real, noise=noise.clone(), num_steps=4)
    assert ref.shape == (3, H, 32)
    torch.testing.assert_close(ours, ref[..., :3], atol=1e-5, rtol=1e-5)
    assert float((ours - noise[..., :3]).abs().max()) > 1e-2  # the expert moved the noise
    # The patch is gone after the block: the base's own forward is the release's again.
    import transformers.models.gemma.modeling_gemma as mg

    assert mg.GemmaRMSNorm.forward.__qualname__.startswith("GemmaRMSNorm")


def test_base_describe_command(base: Pi05Base, capsys: pytest.CaptureFixture[str]) -> None:
    """``joynexus base describe``: counted without weights, agreeing with a built base."""
    import json

    from joynexus.agents.models.families import describe
    from joynexus.ops.cli.app import main

    assert main(["base", "describe", "--base", "pi05", "--cameras", "2", "--state-dim", "5", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["family"] == "pi05" and d["params"]["base"] == base.num_params()
    assert d["params"]["head"] == tenant(base, "a", 5, 0).num_params()  # the tiny expert (width 32)
    assert d["feature_dim"] == base.feature_dim and d["kv_layers"] == base.kv_layout[0]
    assert d["kv_bytes_per_row"] == d["prefix_tokens_per_sample"] * (base.feature_dim + 1) * 4
    real = describe("pi05", "gemma_300m", cameras=1, state_dim=8)
    assert real["feature_dim"] == 18 * 2 * 256 and real["prefix_tokens_per_sample"] > 256  # 224 px: 256 image tokens
    assert real["params"]["base"] > 300_000_000  # so400m tower + gemma_300m, counted on the meta device
    assert main(["base", "describe", "--base", "pi05", "--size", "huge"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_base_family_is_chosen_per_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    """``joynexus up --base F --backbone S`` hands the family and size to exactly the roles
    that build the base; a size the family lacks is refused before anything starts."""
    from pathlib import Path

    from joynexus.ops.cli.app import main
    from joynexus.ops.runtime.launcher import BASE_ROLES, launch, role_slots

    slots = role_slots("nats://127.0.0.1:1", "ns", ["scheduler", "inference", "actor", "actor-forward"],
                       out_dir=Path("/tmp/x/actor"), extra={r: ["--base", "pi05", "--backbone", "tiny"]
                                                            for r in BASE_ROLES})
    argv = {s.role: s.argv for s in slots}  # type: ignore[attr-defined]
    for r in ("inference", "actor", "actor-forward"):
        assert argv[r][-4:] == ["--base", "pi05", "--backbone", "tiny"]
    assert "--base" not in argv["scheduler"]
    assert launch("nats://127.0.0.1:1", "ns", ["scheduler"], out_dir=Path("/tmp/x"), base=("pi05", "bench")) == 2
    assert "sizes are" in capsys.readouterr().err
    assert main(["agent", "inference", "--base", "pi05", "--backbone", "bench", "--nats", "nats://127.0.0.1:1"]) == 2
    assert "not a pi05 size" in capsys.readouterr().err
    from joynexus.agents.models.families import build_base

    with pytest.raises(InvalidSpec, match=r"config\.json or model\.safetensors is missing"):
        build_base("pi05", "tiny", path="/tmp")  # a LeRobot checkpoint directory: test_pi05_checkpoint
    with pytest.raises(InvalidSpec, match="choose one of"):
        build_base("groot", "tiny")


def test_specs_name_pi05_expert_only_on_a_pi05_base() -> None:
    """A workload may ask for ``pi05_expert`` on a π0.5 base; its fresh head attends to that
    base's cache (``kv_layers``, ``feature_dim`` from the torch-free tables)."""
    from joynexus.agents.featureschema import PI05_KV, feature_dim
    from joynexus.agents.models.policyio import fresh_module
    from joynexus.schemas.catalog import PI05_BASE_MODELS
    from joynexus.schemas.workloads import WorkloadSpec

    for name, size in PI05_BASE_MODELS.items():  # the light tables agree with the configs
        g = GEMMA_VARIANTS[size]
        assert PI05_KV[size] == (g["depth"], g["num_kv_heads"] * g["head_dim"])
        assert feature_dim(name) == g["depth"] * 2 * g["num_kv_heads"] * g["head_dim"]
    spec = WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="pi05-tiny",
                        action_module="pi05_expert", head_hidden=32, action_horizon=H)
    schema = FeatureSchema(("front",), (56, 56), 5, 3, H, base_model="pi05-tiny")
    m = fresh_module("acme", spec, schema, {})
    assert isinstance(m.head, Pi05ExpertHead) and m.cfg.kv_layers == 2 and m.cfg.feature_dim == 32
    base = Pi05Base.build(Pi05BaseConfig())
    fb = canonicalize_request(schema, {"front": torch.zeros(1, 3, 56, 56, dtype=torch.uint8)}, "go", torch.zeros(1, 5))
    assert serial_forward(base, [ActRequest(m, fb)])[0].shape == (1, H, 3)
    # Another head on the π0.5 base is fine; pi05_expert on a Qwen base is refused at the door.
    WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="pi05-tiny", action_module="gr00t_flow")
    with pytest.raises(InvalidSpec, match="attends to a pi05 base"):
        WorkloadSpec(name="w", task_type="sft", dataset="d", action_module="pi05_expert")
    with pytest.raises(InvalidSpec, match="must be even"):
        WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="pi05-tiny", action_module="pi05_expert",
                     head_hidden=33)
    with pytest.raises(InvalidSpec, match="not hosted"):
        WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="pi05-huge")


def test_a_lerobot_checkpoints_expert_becomes_a_tenants_head(base: Pi05Base, tmp_path: Any) -> None:
    """LeRobot's own PI05Pytorch state dict, saved as LeRobot's ``model.safetensors`` names it,
    loads into a fresh ``pi05_expert`` (strict: every expert weight, nothing else) and acts the same."""
    from safetensors.torch import load_file, save_file

    from joynexus.agents.models.heads.pi05 import expert_from_lerobot
    from joynexus.agents.models.pi05_lerobot import lerobot_model, openpi_transformers

    src = tenant(base, "a", 5, 3)
    with torch.no_grad():
        for p in src.head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + 1)))
    with openpi_transformers():
        ref = lerobot_model(base, src.head, steps=3)
    sd = {f"model.{k}": v.contiguous() for k, v in ref.state_dict().items()
          if not k.startswith("paligemma_with_expert.paligemma.")}  # the base stays the resident one
    save_file(sd, str(tmp_path / "model.safetensors"))
    dst = tenant(base, "b", 5, 99)
    missing, unexpected = dst.head.load_state_dict(expert_from_lerobot(load_file(str(tmp_path / "model.safetensors"))),
                                                   strict=False)
    assert set(missing) == {"state_mean", "state_std", "action_mean", "action_std"}
    assert unexpected == []
    fb = batch(12, 2, 5)
    noise = torch.randn(2, H, 32, generator=torch.Generator().manual_seed(1))
    a, b = (serial_forward(base, [ActRequest(m, fb, noise)])[0] for m in (src, dst))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(InvalidSpec, match=r"no π0\.5 action expert"):
        expert_from_lerobot({"model.paligemma_with_expert.paligemma.x": torch.zeros(1)})


def test_the_cache_counts_against_an_engines_rows(base: Pi05Base, monkeypatch: pytest.MonkeyPatch) -> None:
    """A π0.5 engine's max_rows is cut so a full batch's caches fit the budget; the bound on a
    row's prefix holds for the longest prompt and four cameras."""
    from joynexus.agents.models.families import (
        KV_BUDGET_ENV,
        cache_row_cap,
        describe,
        kv_budget_bytes,
    )

    four = FeatureSchema(("a", "b", "c", "d"), (56, 56), 8, 3, H, base_model="pi05-tiny")
    fb = canonicalize_request(four, {c: torch.zeros(1, 3, 56, 56, dtype=torch.uint8) for c in four.camera_slots},
                              "é" * 4000, torch.full((1, 8), -0.9))
    feats = base.encode_tokens(for_base(base, fb, tenant(base, "a", 8, 0)))
    assert feats.real_B_L is not None and int(feats.real_B_L.sum()) <= base.max_prefix_tokens(4)
    per_row = base.kv_bytes_per_row(base.max_prefix_tokens())
    assert cache_row_cap(base, 64, 10 * per_row) == 10 and cache_row_cap(base, 64, 10**12) == 64
    assert cache_row_cap(base, 64, 1) == 1  # never below one row
    monkeypatch.setenv(KV_BUDGET_ENV, "1024")
    real = describe("pi05", "gemma_2b", cameras=2)
    assert real["rows_within_kv_budget"] == kv_budget_bytes() // real["max_kv_bytes_per_row"] < 64
    monkeypatch.setenv(KV_BUDGET_ENV, "-1")
    with pytest.raises(InvalidSpec, match="must be > 0"):
        kv_budget_bytes()


def test_bench_families_smoke() -> None:
    """``joynexus bench families`` at its smallest: the grid's arms ran and their ratio is reported."""
    from joynexus.ops.bench.families import bench_families

    r = bench_families("pi05", "tiny", tenants=2, rows=(1, 2), repeats=2)
    assert r["family"] == "pi05" and r["params"] > 0 and set(r["grid"]) == {"2x1", "2x2"}
    for cell in r["grid"].values():
        assert cell["rounds"] == 2 and cell["grouped_ms"] > 0 and cell["serial_ms"] > 0
        lo, hi = cell["speedup_ci95"]
        assert lo <= cell["speedup"] <= hi
    assert "load1" in r["load"]


def test_the_learning_plan_runs_pi05_expert_on_a_pi05_deployment() -> None:
    from joynexus.ops.bench.learning import plans_for
    from joynexus.schemas.workloads import WorkloadSpec

    (plan,) = plans_for(False, ["PushCube-v1/pi05_expert"])
    assert plan.base == "pi05" and plan.action_module == "pi05_expert" and plan.target == 0.8
    assert plan.expert_state == "token" and plan.head_hidden == 128  # the state token; a step fast enough for 600
    (prompt,) = plans_for(False, ["PushCube-v1/pi05_expert-prompt"])  # π0.5 as LeRobot has it, report only
    assert (prompt.action_module, prompt.expert_state, prompt.target) == ("pi05_expert", "prompt", None)
    assert prompt.head_hidden % 2 == 0  # the expert's width
    for p in (plan, prompt):  # the specs the plan makes are valid
        WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="pi05-tiny", action_module=p.action_module,
                     head_hidden=p.head_hidden, expert_state=p.expert_state)  # type: ignore[arg-type]
