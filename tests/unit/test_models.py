"""Models: offline backbone, canonical features, tenant heads, grouped vs serial execution.

All on the tiny backbone (random weights, built from config, nothing downloaded).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from grouped_checks import assert_same_steps

from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.features import (
    FeatureBatch,
    FeatureSchema,
    IncompatibleBatches,
    canonicalize_request,
    concat_batches,
    pad_history,
    split_rows,
)
from joynexus.agents.models.grouped import (
    ActRequest,
    TrainItem,
    grouped_forward,
    grouped_train_step,
    plan_groups,
    serial_forward,
    serial_train_step,
)
from joynexus.agents.models.heads.base import HEADS, HeadConfig, build_head
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.tokenizer import SPECIAL_TOKENS, build_tokenizer, train_tokenizer
from joynexus.schemas.catalog import BASE_FAMILY_HEADS
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

pytestmark = pytest.mark.timeout(60)

CAMS = ("front", "wrist")
HW = (56, 56)
# Batched matmuls may reorder float sums: grouped and serial agree to ~1e-6, not bit for bit.
ATOL = 1e-5


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.build(BackboneConfig(size="tiny"))


def make_batch(seed: int, b: int, state_dim: int = 8, instr: str | None = None,
               cams: tuple[str, ...] = CAMS, hw: tuple[int, int] = HW, action_dim: int = 7) -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    schema = FeatureSchema(cams, hw, state_dim, action_dim, 8)
    images = {s: torch.randint(0, 256, (b, 3, *hw), dtype=torch.uint8, generator=g) for s in cams}
    instructions = [instr or f"task {seed} item {i}" + " x" * (i + seed % 3) for i in range(b)]
    return canonicalize_request(schema, images, instructions, torch.randn(b, state_dim, generator=g))


# -- backbone ---------------------------------------------------------------


def test_backbone_builds_offline_frozen_and_encodes(backbone: Backbone) -> None:
    assert not any(p.requires_grad for p in backbone.model.parameters())
    assert not backbone.model.training
    feats = backbone.encode(make_batch(0, 3))
    assert feats.shape == (3, backbone.feature_dim) and feats.dtype == torch.float32
    assert torch.isfinite(feats).all()
    # Different images/text -> different features (the inputs reach the output).
    assert (feats[0] - feats[1]).abs().max() > 1e-4


def test_batched_vision_path_matches_plain_model_forward(backbone: Backbone) -> None:
    inputs = backbone.prepare(make_batch(5, 3))
    assert backbone._fast_vision_ok(inputs.image_grid_thw_N_3)
    torch.testing.assert_close(backbone.forward(inputs), backbone.reference_forward(inputs), atol=ATOL, rtol=1e-5)


def test_features_do_not_depend_on_padding_or_neighbours(backbone: Backbone) -> None:
    short, long = make_batch(1, 1, instr="go"), make_batch(2, 1, instr="a much longer instruction " * 2)
    alone = backbone.encode(short)
    together = backbone.encode(concat_batches([long, short]))
    torch.testing.assert_close(together[1:], alone, atol=ATOL, rtol=0)


def test_save_and_load_local_dir_same_features(backbone: Backbone, tmp_path: Path) -> None:
    backbone.save(tmp_path / "bb")
    assert (tmp_path / "bb" / "config.json").is_file()
    assert (tmp_path / "bb" / "preprocessor_config.json").is_file()
    loaded = Backbone.load(tmp_path / "bb")
    assert loaded.config.path == str(tmp_path / "bb")
    batch = make_batch(3, 2)
    torch.testing.assert_close(loaded.encode(batch), backbone.encode(batch), atol=0, rtol=0)
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_tokenizer_round_trips_bytes_and_has_special_tokens() -> None:
    tok = build_tokenizer()
    text = "pick up the cube → ünïcode\t\n!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # byte i is id i, no merges
    assert tok.decode(ids) == text
    vocab = tok.get_vocab()
    for s in SPECIAL_TOKENS:
        assert s in vocab and vocab[s] >= 256
    assert tok.pad_token == "<|endoftext|>"


def test_bpe_tokenizer_has_merges_round_trips_and_is_the_config_default() -> None:
    tok = train_tokenizer()
    instr = "push the cube to the red and white target"
    ids = tok(instr, add_special_tokens=False)["input_ids"]
    assert len(ids) <= 10 < len(instr.encode())  # words of the corpus are single tokens
    for text in (instr, "an unseen word: zyxwvut → ü\t!"):  # byte fallback covers any text
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    for s in SPECIAL_TOKENS:
        assert s in tok.get_vocab()
    bb = Backbone.build(BackboneConfig(size="tiny"))
    assert bb.config.tokenizer == "bpe" and len(bb.tokenizer) == len(tok)
    assert bb.model.get_input_embeddings().weight.shape[0] == len(tok)
    # Mostly image tokens at 112 px (16 per image): the prompt is no longer mostly bytes.
    big = Backbone.build(BackboneConfig(size="tiny", image_size=112))
    row, n = big.tokenize([instr], 1)
    image = int((row[0, : int(n[0])] == big.special_ids["<|image_pad|>"]).sum())
    assert image / int(n[0]) > 0.5


@pytest.mark.timeout(180)
def test_bpe_tokenizer_is_the_same_in_every_process() -> None:
    """The actor and the inference engines each build the base: same ids everywhere."""
    import json
    import subprocess
    import sys

    code = (
        "import json,sys; from joynexus.agents.models.tokenizer import train_tokenizer; "
        "json.dump(sorted(train_tokenizer().get_vocab().items()), sys.stdout)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=170)
    here = sorted(train_tokenizer().get_vocab().items())
    assert [tuple(kv) for kv in json.loads(out.stdout)] == here and len(here) > 300


def test_loaded_base_keeps_its_own_tokenizer(tmp_path: Path) -> None:
    byte_base = Backbone.build(BackboneConfig(size="tiny", tokenizer="bytes"))
    byte_base.save(tmp_path / "bytes")
    loaded = Backbone.build(BackboneConfig(size="tiny", path=str(tmp_path / "bytes")))  # default says bpe
    assert loaded.config.tokenizer == "bytes"
    assert loaded.tokenizer("cube", add_special_tokens=False)["input_ids"] == list(b"cube")
    batch = make_batch(6, 2)
    torch.testing.assert_close(loaded.encode(batch), byte_base.encode(batch), atol=0, rtol=0)


def test_mrope_3d_positions_are_used(backbone: Backbone) -> None:
    inputs = backbone.prepare(make_batch(4, 2))
    pos = backbone.rope_positions(inputs)
    b, L = inputs.input_ids_B_L.shape
    assert pos.shape == (3, b, L)
    one_d = torch.arange(L).expand(3, b, L)
    assert not torch.equal(pos, one_d)  # image tokens get (t, h, w) grid positions
    img = inputs.input_ids_B_L[0] == backbone.special_ids["<|image_pad|>"]
    assert not torch.equal(pos[1, 0, img], pos[2, 0, img])  # height and width rows differ on images
    # Same as the model's own per-row get_rope_index over the whole batch.
    ref, _ = backbone.model.get_rope_index(inputs.input_ids_B_L, inputs.image_grid_thw_N_3)
    torch.testing.assert_close(pos, ref)
    # And the 3-D positions change the features relative to the 1-D fallback.
    with torch.inference_mode():
        kw = dict(input_ids=inputs.input_ids_B_L, pixel_values=inputs.pixel_values_P_F,
                  image_grid_thw=inputs.image_grid_thw_N_3, use_cache=False)
        h3 = backbone.model(position_ids=pos, **kw).last_hidden_state
        h1 = backbone.model(position_ids=one_d.contiguous(), **kw).last_hidden_state
    assert (h3 - h1).abs().max() > 1e-4


def test_backbone_config_validates() -> None:
    with pytest.raises(InvalidSpec, match="size"):
        BackboneConfig(size="huge")  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec, match="multiple of 28"):
        BackboneConfig(image_size=50)
    with pytest.raises(InvalidSpec, match="not a local directory"):
        BackboneConfig(path="/nonexistent/qwen")


# -- features -----------------------------------------------------------------


def test_canonicalize_shapes_and_errors() -> None:
    schema = FeatureSchema(CAMS, HW, 4, 7, 8, history_len=3)
    assert schema.signature() == "qwen2.5-vl-tiny|cams=front,wrist|img=3x56x56|state=4|act=8x7|hist=3"
    hwc = {s: torch.zeros(2, 56, 56, 3, dtype=torch.uint8) for s in CAMS}
    fb = canonicalize_request(schema, hwc, "pick", torch.zeros(2, 4), history=torch.ones(2, 1, 4))
    assert fb.images["front"].shape == (2, 3, 56, 56)
    assert fb.instructions == ("pick", "pick") and fb.history_B_H_S is not None
    assert fb.history_B_H_S.shape == (2, 3, 4)
    with pytest.raises(ShapeMismatch, match="state"):
        canonicalize_request(schema, hwc, "pick", torch.zeros(2, 5))
    with pytest.raises(ShapeMismatch, match="images\\['wrist'\\]"):
        canonicalize_request(schema, {**hwc, "wrist": torch.zeros(2, 3, 32, 32, dtype=torch.uint8)}, "p", torch.zeros(2, 4))
    with pytest.raises(InvalidSpec, match="missing \\['wrist'\\]"):
        canonicalize_request(schema, {"front": hwc["front"]}, "p", torch.zeros(2, 4))
    with pytest.raises(ShapeMismatch, match="instructions"):
        canonicalize_request(schema, hwc, ["a", "b", "c"], torch.zeros(2, 4))


def test_nan_rejected_naming_the_field() -> None:
    schema = FeatureSchema(CAMS, HW, 4, 7, 8)
    imgs = {s: torch.zeros(1, 3, 56, 56, dtype=torch.uint8) for s in CAMS}
    bad = torch.zeros(1, 4)
    bad[0, 2] = float("nan")
    with pytest.raises(InvalidSpec, match="state contains 1 NaN"):
        canonicalize_request(schema, imgs, "p", bad)
    fimgs = {s: torch.zeros(1, 3, 56, 56) for s in CAMS}
    fimgs["wrist"][0, 0, 0, 0] = float("inf")
    with pytest.raises(InvalidSpec, match="images\\['wrist'\\] contains"):
        canonicalize_request(schema, fimgs, "p", torch.zeros(1, 4))


def test_history_padding_and_split_rows() -> None:
    h = torch.arange(6.0).view(1, 2, 3)
    padded = pad_history(h, 4)
    assert padded.shape == (1, 4, 3) and torch.equal(padded[0, 0], h[0, 0]) and torch.equal(padded[0, 3], h[0, 1])
    assert torch.equal(pad_history(h, 1)[0, 0], h[0, 1])
    parts = split_rows(torch.arange(5), [slice(0, 2), slice(2, 5)])
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3, 4]]
    with pytest.raises(ShapeMismatch):
        split_rows(torch.arange(4), [slice(0, 2), slice(2, 5)])


def test_incompatible_schemas_cannot_be_grouped(backbone: Backbone) -> None:
    a = make_batch(0, 1)
    b = make_batch(1, 1, hw=(84, 84))
    c = make_batch(2, 1, cams=("front",))
    d = make_batch(3, 2, state_dim=3, action_dim=4)  # state/action may differ: still compatible
    assert concat_batches([a, d]).slices == (slice(0, 1), slice(1, 3))
    for other in (b, c):
        with pytest.raises(IncompatibleBatches, match="cannot share a backbone forward"):
            concat_batches([a, other])
    assert plan_groups([a, b, d, c]) == [[0, 2], [1], [3]]
    tm = TenantModule("t", "oft_mlp", HeadConfig(backbone.feature_dim, 8))
    with pytest.raises(InvalidSpec):
        grouped_forward(backbone, [ActRequest(tm, a), ActRequest(tm, b)])


# -- heads ----------------------------------------------------------------------


def test_heads_registered_by_name_and_unknown_rejected() -> None:
    assert {"oft_mlp", "flow_matching", "value"} <= set(HEADS)
    cfg = HeadConfig(64, 8)
    assert build_head("oft_mlp", cfg).act(torch.zeros(2, 64), torch.zeros(2, 8)).shape == (2, 8, 7)
    assert build_head("value", cfg).act(torch.zeros(2, 64), torch.zeros(2, 8)).shape == (2,)
    with pytest.raises(InvalidSpec, match=r"unknown action module 'diffusion_xl'.*oft_mlp"):
        build_head("diffusion_xl", cfg)
    with pytest.raises(ShapeMismatch, match="state must be"):
        build_head("oft_mlp", cfg).act(torch.zeros(2, 64), torch.zeros(2, 5))


def test_head_is_tiny_next_to_bench_backbone() -> None:
    bench = Backbone.build(BackboneConfig(size="bench"))
    limit = 0.01 * bench.num_params()
    for name in set(HEADS) - set(BASE_FAMILY_HEADS):  # those size to their own base (test_pi05)
        n = sum(p.numel() for p in build_head(name, HeadConfig(bench.feature_dim, 8)).parameters())
        assert n < limit, (name, n, limit)


@pytest.mark.parametrize("head_type", ["oft_mlp", "flow_matching", "value"])
def test_each_head_loss_decreases(head_type: str) -> None:
    g = torch.Generator().manual_seed(0)
    feats, state = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    if head_type == "value":
        target = state.sum(-1) * 0.3
    else:
        target = torch.tanh(state[:, None, :7] + torch.linspace(0, 1, 8)[None, :, None])
    tm = TenantModule("t", head_type, HeadConfig(64, 8, seed=1), lr=3e-3)
    rng0 = tm.head.generator.get_state()

    def fixed_loss() -> float:  # same noise/t draws each time: a deterministic yardstick
        keep = tm.head.generator.get_state()
        tm.head.generator.set_state(rng0)
        with torch.no_grad():
            out = float(tm.head.loss(feats, state, target))
        tm.head.generator.set_state(keep)
        return out

    first = fixed_loss()
    for _ in range(40):
        tm.train_step(feats, state, target)
    # Flow matching has an irreducible floor (the noise is random); the others go well below.
    assert fixed_loss() < (0.85 if head_type == "flow_matching" else 0.5) * first
    assert tm.version == 40


def test_flow_matching_sampling_deterministic_given_noise() -> None:
    head = build_head("flow_matching", HeadConfig(64, 8, flow_steps=5))
    feats, state = torch.randn(3, 64), torch.randn(3, 8)
    noise = torch.randn(3, 8, 7)
    a = head.act(feats, state, noise=noise)
    b = head.act(feats, state, noise=noise.clone())
    assert torch.equal(a, b)
    assert not torch.equal(a, head.act(feats, state, noise=noise + 1.0))
    # Same seed, no explicit noise: same draws from the head's own generator.
    h2 = build_head("flow_matching", HeadConfig(64, 8, flow_steps=5))
    h3 = build_head("flow_matching", HeadConfig(64, 8, flow_steps=5))
    assert torch.equal(h2.act(feats, state), h3.act(feats, state))


def test_flow_matching_act_integrates_the_trained_velocity_field() -> None:
    """act() splits velocity()'s first layer to save work per step: it must still be
    Euler integration of the very field the loss trains (velocity(), with its cat)."""
    head = build_head("flow_matching", HeadConfig(64, 8, hidden=96, flow_steps=5, seed=4))
    torch.nn.init.normal_(head.net[0].bias)  # a bias that is not zero, so its place matters
    feats, state, noise = torch.randn(3, 64), torch.randn(3, 8), torch.randn(3, 8, 7)
    x, cond = noise.reshape(3, -1), head._cond(feats, state)
    for k in range(5):
        x = x + 0.2 * head.velocity(x, torch.full((3,), k * 0.2), cond)
    torch.testing.assert_close(head.act(feats, state, noise=noise), head.denorm_action(x.view(3, 8, 7)),
                               rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        head.net[0].weight[:, -1] += 1.0  # the time embedding's last input: act must see it
    assert not torch.allclose(head.act(feats, state, noise=noise), head.denorm_action(x.view(3, 8, 7)))


def test_tenant_module_state_dict_round_trip(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    feats, state, target = torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g), torch.randn(4, 8, 7, generator=g)
    a = TenantModule("acme", "flow_matching", HeadConfig(64, 8, seed=2))
    for _ in range(3):
        a.train_step(feats, state, target)
    sd = a.state_dict()
    assert sd["version"] == 3 and sd["optimizer"]["state"], "optimizer moments must be saved"
    b = TenantModule.from_state_dict(sd)
    assert b.version == 3
    for k, v in a.optimizer.state_dict()["state"][0].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(b.optimizer.state_dict()["state"][0][k]))
    # Resumed module continues exactly like the original.
    assert a.train_step(feats, state, target) == b.train_step(feats, state, target)
    with pytest.raises(InvalidSpec, match="build a TenantModule with the saved type"):
        TenantModule("acme", "oft_mlp", HeadConfig(64, 8)).load_state_dict(sd)
    path = a.export_safetensors(tmp_path / "export")
    c = TenantModule.import_safetensors(path)
    assert c.version == a.version and c.head_type == "flow_matching"
    for k, v in a.head.state_dict().items():
        assert torch.equal(v, c.head.state_dict()[k])


# -- grouped execution ------------------------------------------------------------


def _three_tenants(backbone: Backbone) -> list[tuple[str, FeatureBatch, int]]:
    return [("oft_mlp", make_batch(10, 2, state_dim=8), 0),
            ("flow_matching", make_batch(11, 3, state_dim=5), 1),
            ("value", make_batch(12, 1, state_dim=4), 2)]


def test_grouped_vs_serial_forward_close(backbone: Backbone) -> None:
    reqs = []
    for head_type, batch, seed in _three_tenants(backbone):
        cfg = HeadConfig(backbone.feature_dim, batch.schema.state_dim, seed=seed)
        noise = torch.randn(batch.batch_size, 8, 7) if head_type == "flow_matching" else None
        reqs.append(ActRequest(TenantModule(f"t{seed}", head_type, cfg), batch, noise))
    grouped = grouped_forward(backbone, reqs)
    serial = serial_forward(backbone, reqs)
    assert [g.shape for g in grouped] == [(2, 8, 7), (3, 8, 7), (1,)]
    for g, s in zip(grouped, serial, strict=True):
        torch.testing.assert_close(g, s, atol=ATOL, rtol=1e-5)


def test_grouped_train_step_matches_serial_and_isolates_tenants(backbone: Backbone) -> None:
    def tenants() -> list[TrainItem]:
        items = []
        for head_type, batch, seed in _three_tenants(backbone):
            g = torch.Generator().manual_seed(100 + seed)
            b = batch.batch_size
            target = torch.randn(b, generator=g) if head_type == "value" else torch.randn(b, 8, 7, generator=g)
            tm = TenantModule(f"t{seed}", head_type, HeadConfig(backbone.feature_dim, batch.schema.state_dim, seed=seed))
            items.append(TrainItem(tm, batch, target))
        return items

    g_items, s_items = tenants(), tenants()
    g_curves = [grouped_train_step(backbone, g_items) for _ in range(5)]
    s_curves = [serial_train_step(backbone, s_items) for _ in range(5)]
    assert_same_steps(g_curves, s_curves)
    assert [it.tenant.version for it in g_items] == [5, 5, 5]

    # One tenant's step never touches another tenant's weights.
    before = [{k: v.clone() for k, v in it.tenant.head.state_dict().items()} for it in g_items]
    grouped_train_step(backbone, [g_items[1]])
    after = [it.tenant.head.state_dict() for it in g_items]
    for i in (0, 2):
        assert all(torch.equal(before[i][k], after[i][k]) for k in before[i])
    assert any(not torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert [it.tenant.version for it in g_items] == [5, 6, 5]
    assert not any(p.requires_grad for p in backbone.model.parameters())


@pytest.mark.parametrize("head_type", ["oft_mlp", "flow_matching"])
def test_sample_weights_weigh_the_loss(head_type: str) -> None:
    """Advantage-weighted RL: equal weights give the plain mean; a zero weight drops a sample."""
    cfg = HeadConfig(feature_dim=16, state_dim=3, action_dim=2, action_horizon=2, seed=3)
    feats = torch.randn(4, 16)
    state = torch.randn(4, 3)
    target = torch.randn(4, 2, 2)

    def loss(weight, rows=slice(None)):
        head = build_head(head_type, cfg)  # same seed: same init and same noise draws
        return float(head.loss(feats[rows], state[rows], target[rows], weight))

    assert loss(torch.full((4,), 2.0)) == pytest.approx(loss(None), rel=1e-6)
    if head_type == "oft_mlp":  # deterministic per sample: dropping rows equals weight 0
        assert loss(torch.tensor([1.0, 1.0, 0.0, 0.0])) == pytest.approx(loss(None, slice(0, 2)), rel=1e-6)
    with pytest.raises(ShapeMismatch, match="sample weights must be"):
        loss(torch.ones(3))


@pytest.mark.parametrize("head_type", ["oft_mlp", "flow_matching"])
def test_heads_normalise_with_the_data_stats_and_carry_them(head_type: str, tmp_path: Path) -> None:
    """State enters as (s - mean) / std, the loss is on normalised actions, act() answers
    in the data's units, and the statistics travel in the weights (export, state_dict)."""
    torch.manual_seed(0)
    cfg = HeadConfig(feature_dim=8, state_dim=3, action_dim=2, action_horizon=2, hidden=64)
    m = TenantModule("t", head_type, cfg, lr=3e-3)
    s_mean, s_std = [0.1, -0.2, 0.05], [0.01, 0.02, 0.03]
    a_mean, a_std = [5.0, -3.0], [0.5, 2.0]
    m.set_normalization({"observation.state": {"mean": s_mean, "std": s_std},
                         "action": {"mean": a_mean, "std": [0.5, 2.0]}})
    z_state = torch.randn(256, 3)
    state = z_state * torch.tensor(s_std) + torch.tensor(s_mean)
    # actions depend on the (tiny-scaled) state: learnable only if the state is normalised
    z_act = torch.stack([z_state[:, 0], -z_state[:, 1]], dim=1)[:, None, :].expand(-1, 2, -1)
    target = z_act * torch.tensor(a_std) + torch.tensor(a_mean)
    feats = torch.zeros(256, 8)
    for _ in range(300):
        m.train_step(feats, state, target)
    pred = m.act(feats, state, noise=torch.zeros(256, 2, 2)) if head_type == "flow_matching" \
        else m.act(feats, state)
    err = (pred - target).abs().mean() / torch.tensor(a_std).mean()
    assert err < 0.35, float(err)
    assert abs(float(pred.mean(dim=(0, 1))[0]) - 5.0) < 0.5  # in the data's units
    p = m.export_safetensors(tmp_path / "h")
    back = TenantModule.import_safetensors(p)
    assert back.normalization()["action"]["mean"] == pytest.approx(a_mean)
    assert back.normalization()["observation.state"]["std"] == pytest.approx(s_std)
    again = TenantModule.from_state_dict(m.state_dict())
    assert torch.equal(again.head.state_mean, m.head.state_mean)
    with pytest.raises(ShapeMismatch):
        m.set_normalization({"action": {"mean": [0.0], "std": [1.0]}})
