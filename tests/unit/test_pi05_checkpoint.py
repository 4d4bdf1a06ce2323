"""LeRobot π0.5 checkpoints in and out (issue 26, items 1 and 4), at the tiny size.

A checkpoint LeRobot's own ``PI05Policy.save_pretrained`` writes (a seeded random tiny
policy, ``pi05_lerobot.lerobot_tiny``) loads here as the resident base (its size read
from the shapes) plus a tenant's initial expert, acting as LeRobot's ``sample_actions``
does to 1e-5; an export (``joynexus base export-lerobot``) loads back in LeRobot's
``PI05Policy.from_pretrained`` with the same actions; corrupt, mismatched or hostile
inputs are refused with a clear ``InvalidSpec`` before anything is built.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from joynexus.agents.models.features import FeatureSchema, canonicalize_request
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.schemas.errors import InvalidSpec

pytestmark = pytest.mark.timeout(180)

H, S, A = 4, 5, 3  # action horizon, state and action dims of the tests' tenant


def _perturb(params: Any, seed: int) -> None:
    """A trained-looking expert: the adaptive norms' zero init would hide their path."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _lerobot_config(side: int = 56, state_dim: int = 8) -> Any:
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    return PI05Config(chunk_size=H, n_action_steps=H, num_inference_steps=3, max_state_dim=state_dim,
                      image_resolution=(side, side), device="cpu",
                      input_features={"observation.images.front": PolicyFeature(FeatureType.VISUAL, (3, side, side)),
                                      "observation.state": PolicyFeature(FeatureType.STATE, (S,))},
                      output_features={"action": PolicyFeature(FeatureType.ACTION, (A,))})


@pytest.fixture(scope="module")
def lerobot_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A seeded random tiny PI05Policy (expert perturbed) saved by LeRobot's save_pretrained."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    from joynexus.agents.models.pi05_lerobot import lerobot_tiny, openpi_transformers

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("lerobot") / "pi05"
    with openpi_transformers(), lerobot_tiny(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        policy = PI05Policy(_lerobot_config())
        _perturb((p for n, p in policy.named_parameters() if "paligemma." not in n), 3)
        policy.save_pretrained(out)
    return out, policy.eval()


def _batch(seed: int, b: int = 2) -> Any:
    g = torch.Generator().manual_seed(seed)
    schema = FeatureSchema(("front",), (56, 56), S, A, H, base_model="pi05-tiny")
    imgs = {"front": torch.randint(0, 256, (b, 3, 56, 56), generator=g, dtype=torch.uint8)}
    return canonicalize_request(schema, imgs, ["push the cube", "push the cube to the goal"][:b],
                                torch.randn(b, S, generator=g))


def _head(base: Any, seed: int = 0, hidden: int = 32) -> TenantModule:
    cfg = HeadConfig(feature_dim=base.feature_dim, state_dim=S, action_dim=A, action_horizon=H, hidden=hidden,
                     flow_steps=3, seed=seed, kv_layers=base.kv_layout[0])
    return TenantModule("acme", "pi05_expert", cfg)


def _lerobot_actions(model: Any, base: Any, inputs: Any, noise: torch.Tensor) -> torch.Tensor:
    """LeRobot's ``PI05Pytorch.sample_actions`` on the same prompt ids, images and noise."""
    from joynexus.agents.models.pi05_lerobot import openpi_transformers

    real = torch.arange(inputs.ids_B_T.shape[1])[None, :] < inputs.lengths_B[:, None]
    images = list(inputs.pixels_K_B_C_S_S)
    b = inputs.batch_size
    with openpi_transformers(), torch.no_grad():
        return model.sample_actions(images, [torch.ones(b, dtype=torch.bool)] * len(images), inputs.ids_B_T, real,
                                    noise=noise.clone())


def test_a_lerobot_checkpoint_is_the_base_and_a_tenants_expert(lerobot_ckpt: tuple[Path, Any]) -> None:
    """``build_base("pi05", path=DIR)``: the size from the shapes (tiny, 56 px, 8 state values), the
    PaliGemma LeRobot's exactly; ``init_expert``: its expert. Actions == LeRobot's to 1e-5."""
    from joynexus.agents.models.families import build_base
    from joynexus.agents.models.pi05_checkpoint import init_expert

    path, policy = lerobot_ckpt
    base = build_base("pi05", "gemma_2b", str(path))  # the size argument is not read: the shapes are
    c = base.config
    assert (c.paligemma_variant, c.image_size, c.max_state_dim, c.base_model) == ("tiny", 56, 8, "pi05-tiny")
    theirs = policy.model.paligemma_with_expert.paligemma.state_dict()
    for k, v in base.model.state_dict().items():
        torch.testing.assert_close(v, theirs[k], atol=0, rtol=0)
    tm = _head(base, seed=99)
    init_expert(tm.head, str(path))
    fb = _batch(21)
    inputs = base.prepare(fb, tm.head.prefix_state(fb.state_B_S))
    noise = torch.randn(2, H, 32, generator=torch.Generator().manual_seed(4))
    ours = tm.act(base.features(inputs).tokens(), fb.state_B_S, noise=noise, steps=3)
    ref = _lerobot_actions(policy.model, base, inputs, noise)
    torch.testing.assert_close(ours, ref[..., :A], atol=1e-5, rtol=1e-5)
    assert float((ours - noise[..., :A]).abs().max()) > 1e-2  # the expert moved the noise
    with pytest.raises(InvalidSpec, match="32 wide, this workload's head_hidden is 64"):
        init_expert(_head(base, hidden=64).head, str(path))


def _write_head_export(module: TenantModule, out: Path) -> None:
    """What ``Client.export`` writes: head.safetensors plus manifest.json."""
    from dataclasses import asdict

    from joynexus.agents.models.policyio import weights_bytes

    out.mkdir(parents=True)
    (out / "head.safetensors").write_bytes(weights_bytes(module, 3))
    (out / "manifest.json").write_text(json.dumps({
        "tenant_id": "acme", "workload": "sft", "version": 3, "action_module": "pi05_expert",
        "head_config": asdict(module.cfg), "base_model": "pi05-tiny",
        "feature_schema": {"camera_slots": ["front"], "image_hw": [56, 56], "state_dim": S, "action_dim": A,
                           "action_horizon": H}}))


def test_export_loads_in_lerobots_from_pretrained_with_the_same_actions(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``joynexus base export-lerobot``: LeRobot's from_pretrained loads every key (strict) and its
    sample_actions, unnormalised with the exported statistics, equal the service's actions to
    1e-5; LeRobot's processors load offline and normalise the state as the prompt takes it; the
    directory loads back here as the same base."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from lerobot.processor import PolicyProcessorPipeline

    from joynexus.agents.models.families import build_base
    from joynexus.agents.models.pi05_lerobot import lerobot_tiny, openpi_transformers
    from joynexus.ops.cli.app import main

    torch.set_num_threads(1)
    base = build_base("pi05", "tiny")  # what the service's roles build
    tm = _head(base, seed=5)
    _perturb(tm.head.parameters(), 11)
    tm.set_normalization({"observation.state": {"mean": [0.1] * S, "std": [2.0] * S},
                          "action": {"mean": [0.5, 0.0, -0.2], "std": [2.0, 1.0, 0.5]}})
    _write_head_export(tm, tmp_path / "head")
    out = tmp_path / "lerobot"
    assert main(["base", "export-lerobot", "--base", "pi05", "--head", str(tmp_path / "head"), "--out", str(out),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["normalization"] == "mean_std" and report["paligemma_variant"] == "tiny"
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json",
            "tokenizer"} <= set(os.listdir(out))
    with openpi_transformers(), lerobot_tiny():
        policy = PI05Policy.from_pretrained(out, local_files_only=True)
    for k, v in tm.head.state_dict().items():  # from_pretrained warns and keeps random weights on failure
        if k.startswith("expert.layers.0.self_attn"):
            lk = "paligemma_with_expert.gemma_expert.model." + k[len("expert."):]
            torch.testing.assert_close(policy.model.state_dict()[lk], v, atol=0, rtol=0)
    assert policy.config.chunk_size == H and policy.config.num_inference_steps == 3
    fb = _batch(22)
    inputs = base.prepare(fb, tm.head.prefix_state(fb.state_B_S))
    noise = torch.randn(2, H, 32, generator=torch.Generator().manual_seed(6))
    ours = tm.act(base.features(inputs).tokens(), fb.state_B_S, noise=noise)
    ref = _lerobot_actions(policy.model, base, inputs, noise)[..., :A] * tm.head.action_std + tm.head.action_mean
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)

    pre = PolicyProcessorPipeline.from_pretrained(out, "policy_preprocessor.json", local_files_only=True)
    post = PolicyProcessorPipeline.from_pretrained(out, "policy_postprocessor.json", local_files_only=True)
    assert len(pre.steps) == 6 and len(post.steps) == 2
    state = torch.tensor([[0.4, -1.0, 2.5, 0.1, 0.0]])
    normalizer = pre.steps[2]
    got = normalizer({"observation": {"observation.state": state}, "action": None,
                      "complementary_data": {"task": ["x"]}})
    from lerobot.processor.core import TransitionKey

    normed = got[TransitionKey.OBSERVATION]["observation.state"]
    torch.testing.assert_close(normed, tm.head.prefix_state(state), atol=1e-5, rtol=1e-5)

    from joynexus.agents.models.pi05_checkpoint import load_pi05_base

    back = load_pi05_base(str(out))
    assert back.config == base.config and back.model.config.text_config.vocab_size == 257_152
    torch.testing.assert_close(back.features(inputs).tokens(), base.features(inputs).tokens(), atol=0, rtol=0)


def _corrupt(src: Path, dst: Path, change: Any) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    change(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return str(dst)


def test_corrupt_or_mismatched_checkpoints_are_refused_before_a_role_starts(
        lerobot_ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    """Each refusal is an InvalidSpec naming the problem, from config.json and the header alone
    where it can (``check_base``, what ``up`` and ``agent`` run before any role starts)."""
    from joynexus.agents.models.families import build_base, check_base
    from joynexus.ops.runtime.launcher import launch

    src, _ = lerobot_ckpt
    p = "model.paligemma_with_expert.paligemma."
    emb = p + "lm_head.weight"
    cases: dict[str, tuple[str, str]] = {}
    cases["narrow"] = (_corrupt(src, tmp_path / "narrow", lambda sd: sd.update(
        {emb: sd[emb][:, :48].contiguous()})), "no size served here")
    cases["missing"] = (_corrupt(src, tmp_path / "missing", lambda sd: sd.pop(
        p + "model.language_model.norm.weight")), r"missing \['model.language_model.norm.weight'\]")
    cases["nan"] = (_corrupt(src, tmp_path / "nan", lambda sd: sd[p + "model.language_model.norm.weight"].fill_(
        float("nan"))), "NaN or inf")
    cases["no expert"] = (_corrupt(src, tmp_path / "noexp", lambda sd: sd.pop("model.action_in_proj.weight")),
                          "action_in_proj.weight' is missing")
    shutil.copytree(src, tmp_path / "type")
    cfg = json.loads((tmp_path / "type" / "config.json").read_text())
    (tmp_path / "type" / "config.json").write_text(json.dumps({**cfg, "type": "smolvla"}))
    cases["type"] = (str(tmp_path / "type"), "policy type is 'smolvla'")
    shutil.copytree(src, tmp_path / "trunc")
    w = tmp_path / "trunc" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    cases["truncated"] = (str(tmp_path / "trunc"), "corrupt")
    (tmp_path / "empty").mkdir()
    cases["empty"] = (str(tmp_path / "empty"), "missing")
    for name, (path, msg) in cases.items():
        with pytest.raises(InvalidSpec, match=msg):
            if name in ("missing", "nan"):  # found when the weights are read
                build_base("pi05", "tiny", path)
            else:
                check_base("pi05", "tiny", path)
    rc = launch("nats://127.0.0.1:9", "t", ["inference"], out_dir=tmp_path / "o", base=("pi05", "tiny"),
                base_path=cases["type"][0])
    assert rc == 2  # refused before anything connects or starts


def test_tenant_checkpoint_paths_are_confined_to_its_space(lerobot_ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    """``resolve_checkpoint``: the tenant's own checkpoint resolves; traversal, absolute paths
    outside, another tenant's space, a symlinked directory or weights file out all read the same."""
    from joynexus.agents.datasets import resolve_checkpoint

    src, _ = lerobot_ckpt
    root = tmp_path / "datasets"
    shutil.copytree(src, root / "acme" / "ckpts" / "pi05")
    shutil.copytree(src, root / "bolt" / "pi05")
    shutil.copytree(src, tmp_path / "outside")
    own = resolve_checkpoint(root, "acme", "ckpts/pi05")
    assert own == os.path.realpath(root / "acme" / "ckpts" / "pi05")
    assert resolve_checkpoint(root, "acme", own) == own  # absolute, inside the space
    (root / "acme" / "link").symlink_to(tmp_path / "outside")
    (root / "acme" / "weights").mkdir()
    shutil.copy(src / "config.json", root / "acme" / "weights" / "config.json")
    (root / "acme" / "weights" / "model.safetensors").symlink_to(tmp_path / "outside" / "model.safetensors")
    (root / "acme" / "noconfig").mkdir()
    shutil.copy(src / "model.safetensors", root / "acme" / "noconfig" / "model.safetensors")
    hostile = ["../bolt/pi05", str(root / "bolt" / "pi05"), str(tmp_path / "outside"), "link", "weights",
               "noconfig", "ckpts/../../bolt/pi05", "", "a\x00b"]
    for req in hostile:
        with pytest.raises(InvalidSpec) as e:
            resolve_checkpoint(root, "acme", req)
        assert "has no LeRobot checkpoint" in str(e.value) and "bolt" not in str(e.value).replace(req, "")
    with pytest.raises(InvalidSpec):
        resolve_checkpoint(root, "../bolt", "pi05")  # a tenant name is one path component


def test_the_spec_says_where_a_checkpoint_applies() -> None:
    from joynexus.agents.models.pi05_checkpoint import check_lerobot_head
    from joynexus.schemas.workloads import WorkloadSpec

    kw: dict[str, Any] = dict(name="r", task_type="rl", env="PickCube-v1", base_model="pi05-tiny",
                              action_module="pi05_expert")
    spec = WorkloadSpec(**kw, init_from_checkpoint="ckpts/pi05")
    assert spec.init_from_checkpoint == "ckpts/pi05" and spec.warmup_updates() == 10
    assert WorkloadSpec(**kw).init_from_checkpoint is None
    for change, msg in (({"action_module": "oft_mlp", "base_model": "qwen2.5-vl-tiny"}, "starts a pi05_expert"),
                        ({"init_from_export": "heads/x"}, "give one of"),
                        ({"init_from_checkpoint": "a" * 1025}, "1 to 1024"),
                        ({"init_from_checkpoint": ""}, "1 to 1024")):
        with pytest.raises(InvalidSpec, match=msg):
            WorkloadSpec(**{**kw, "init_from_checkpoint": "ckpts/pi05", **change})
    with pytest.raises(InvalidSpec, match="applies to sft and rl"):
        WorkloadSpec(name="e", task_type="eval", env="PickCube-v1", init_from_workload="r",
                     init_from_checkpoint="ckpts/pi05")
    with pytest.raises(InvalidSpec, match="continuous state"):  # LeRobot's PI05Pytorch has no state token
        WorkloadSpec(**kw, expert_state="token", init_from_checkpoint="ckpts/pi05")
    assert WorkloadSpec(**kw, expert_state="token").expert_state == "token"
    for cfg in ({"expert_state": "token"}, HeadConfig(feature_dim=32, state_dim=S, kv_layers=2, expert_state="token")):
        with pytest.raises(InvalidSpec, match=r"no LeRobot π0\.5 form"):
            check_lerobot_head("pi05_expert", cfg)
    check_lerobot_head("pi05_expert", HeadConfig(feature_dim=32, state_dim=S, kv_layers=2))
    with pytest.raises(InvalidSpec, match="holds a pi05_expert"):
        check_lerobot_head("oft_mlp", {})


def _meta_shapes(variant: str, projector: int | None = None) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a real-size LeRobot π0.5 checkpoint, from models on the meta device."""
    from transformers import PaliGemmaForConditionalGeneration

    from joynexus.agents.models.pi05_checkpoint import BASE_PREFIX, EXPERT_PREFIX
    from joynexus.agents.models.pi05_config import (
        EXPERT_OF,
        GEMMA_VARIANTS,
        Pi05BaseConfig,
        build_paligemma_config,
    )
    from joynexus.agents.models.pi05_lerobot import LEROBOT_VOCAB, lerobot_expert
    from joynexus.agents.models.tokenizer import train_tokenizer

    pcfg = build_paligemma_config(Pi05BaseConfig(paligemma_variant=variant, image_size=224), train_tokenizer())
    pcfg.text_config.vocab_size = pcfg.vocab_size = LEROBOT_VOCAB
    if projector:
        pcfg.vision_config.projection_dim = projector
    e = GEMMA_VARIANTS[EXPERT_OF[variant]]
    with torch.device("meta"):
        base = PaliGemmaForConditionalGeneration(pcfg)
        expert = lerobot_expert(e["width"], e["head_dim"], e["depth"])
    shapes = {BASE_PREFIX + k: tuple(v.shape) for k, v in base.state_dict().items()}
    shapes |= {EXPERT_PREFIX + k: tuple(v.shape) for k, v in expert.state_dict().items()}
    return shapes | {"model.action_in_proj.weight": (e["width"], 32)}


def test_real_sizes_are_read_from_the_shapes() -> None:
    """A gemma_2b and a gemma_300m checkpoint (shapes only, nothing allocated) read as their
    variants at 224 px; LeRobot's own gemma_300m layout (a 2048-wide image projector for a
    1024-wide text model) is refused; a checkpoint's size never comes from its config's name."""
    from joynexus.agents.models.lerobot_checkpoint import LeRobotCheckpoint
    from joynexus.agents.models.pi05_checkpoint import checkpoint_geometry

    for variant in ("gemma_2b", "gemma_300m"):
        ck = LeRobotCheckpoint("ck", {"type": "pi05", "paligemma_variant": "gemma_2b"}, _meta_shapes(variant), {})
        geo = checkpoint_geometry(ck)
        assert (geo["paligemma_variant"], geo["image_size"], geo["vocab"]) == (variant, 224, 257_152)
        assert geo["expert_width"] == 1024 and geo["max_state_dim"] == 32
    with pytest.raises(InvalidSpec, match="image projector maps 1152 -> 2048"):
        checkpoint_geometry(LeRobotCheckpoint("ck", {"type": "pi05"}, _meta_shapes("gemma_300m", 2048), {}))


def test_the_agent_refuses_a_bad_checkpoint_before_its_role_starts(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from joynexus.ops.cli.app import main

    (tmp_path / "config.json").write_text(json.dumps({"type": "pi05"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    assert main(["agent", "inference", "--base", "pi05", "--backbone-path", str(tmp_path),
                 "--nats", "nats://127.0.0.1:1"]) == 2
    assert "not safetensors" in capsys.readouterr().err


def test_a_state_token_expert_is_neither_exported_nor_started_from_a_checkpoint(
        lerobot_ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    from joynexus.agents.models.families import build_base
    from joynexus.agents.models.pi05_checkpoint import init_expert
    from joynexus.agents.models.pi05_export import export_lerobot

    base = build_base("pi05", "tiny")
    cfg = HeadConfig(feature_dim=base.feature_dim, state_dim=S, action_dim=A, action_horizon=H, hidden=32,
                     kv_layers=base.kv_layout[0], expert_state="token")
    tm = TenantModule("acme", "pi05_expert", cfg)
    with pytest.raises(InvalidSpec, match="expert_state='token'"):
        export_lerobot(base, tm, tmp_path / "out", cameras=["front"])
    assert not (tmp_path / "out").exists()  # refused before anything is written
    with pytest.raises(InvalidSpec, match="expert_state='token'"):
        init_expert(tm.head, str(lerobot_ckpt[0]))


def test_base_describe_reads_a_pi05_directory_without_its_tensors(lerobot_ckpt: tuple[Path, Any], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``joynexus base describe --base pi05 --path DIR``: the figures of the base ``--backbone-path``
    loads and of the expert ``init_from_checkpoint`` starts, from config.json and the header alone."""
    import safetensors

    from joynexus.agents.models.families import build_base
    from joynexus.ops.cli.app import main

    path = str(lerobot_ckpt[0])
    loaded = build_base("pi05", "tiny", path)
    want_head = _head(loaded).num_params()

    def no_tensor(*a: Any, **kw: Any) -> None:
        raise AssertionError("describe read a tensor")

    monkeypatch.setattr(safetensors, "safe_open", no_tensor)
    capsys.readouterr()
    assert main(["base", "describe", "--base", "pi05", "--path", path, "--state-dim", str(S), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["family"], d["size"], d["path"], d["max_state_dim"], d["image_size"]) == ("pi05", "tiny", path, 8, 56)
    assert d["params"]["base"] == loaded.num_params() and d["vocab"] == loaded.model.config.text_config.vocab_size
    assert d["params"]["head"] == want_head and d["expert_width"] == 32
    assert d["feature_dim"] == loaded.feature_dim and d["kv_layers"] == loaded.kv_layout[0]
    tokens = loaded.prefix_tokens(1, "push the cube to the goal region", state_dim=S)
    assert d["prefix_tokens_per_sample"] == tokens and d["kv_bytes_per_row"] == loaded.kv_bytes_per_row(tokens)
    # The checkpoint bounds the state; a directory of another type, or none, is refused.
    assert main(["base", "describe", "--base", "pi05", "--path", path, "--state-dim", "9"]) == 2
    assert "at most max_state_dim=8" in capsys.readouterr().err
    other = tmp_path / "smolvla"
    shutil.copytree(path, other)
    (other / "config.json").write_text(json.dumps({"type": "smolvla"}))
    assert main(["base", "describe", "--base", "pi05", "--path", str(other)]) == 2
    assert "a pi05 base loads type ['pi05']" in capsys.readouterr().err
    assert main(["base", "describe", "--base", "pi05", "--path", str(tmp_path / "none")]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["base", "describe", "--base", "qwen2_5_vl", "--path", path]) == 2
    assert "only a pi05 or smolvla base" in capsys.readouterr().err
