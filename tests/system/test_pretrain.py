"""``joynexus base pretrain``: a base pre-trained on real CPU ManiSkill renders sees the cube.

Real renders (lavapipe), real training steps on the tiny Qwen2.5-VL, the real
save_pretrained / from_pretrained round trip. Kept small (a handful of
episodes, a few hundred steps); the figures that decide the base are in the
command's report, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.ops.admin.pretrain_base import REPORT_FILE, make_base
from joynexus.schemas.errors import InvalidSpec

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("base") / "pushcube"
    report = make_base(out, tasks=("PushCube-v1",), renders=120, steps=200, batch_size=32, seed=0)
    return out, report


def test_pretrained_base_sees_the_cube_better_than_the_random_one(made: tuple[Path, dict]) -> None:
    out, report = made
    before, after = report["probe_random"]["PushCube-v1"], report["probe_pretrained"]["PushCube-v1"]
    assert report["renders"]["PushCube-v1"] == 120
    assert after["test_frames"] > 0 and after["train_frames"] > after["test_frames"]
    # Held-out episodes: the probe on the features of the saved and reloaded base finds
    # the cube better than on the random base's.
    assert after["cube_xy_cm"] < before["cube_xy_cm"], (before, after)
    assert report["loss_last"] < 0.5 * report["loss_first"]
    assert json.loads((out / REPORT_FILE).read_text())["steps"] == 200


def test_saved_base_loads_frozen_with_its_settings_and_tokenizer(made: tuple[Path, dict]) -> None:
    out, _ = made
    for f in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (out / f).is_file(), f
    # The service's path: BackboneConfig(path=...) through Backbone.build (from_pretrained).
    bb = Backbone.build(BackboneConfig(size="tiny", path=str(out)))
    assert not bb.model.training and not any(p.requires_grad for p in bb.model.parameters())
    assert bb.config.image_size == 56 and bb.config.tokenizer == "bpe"
    ids = bb.tokenizer("push the cube to the red and white target", add_special_tokens=False)["input_ids"]
    assert len(ids) < 15  # the BPE saved with the base, not bytes (41)
    # Not the random base any more (the probe on this loaded base is in the report: test above).
    random_bb = Backbone.build(BackboneConfig(size="tiny", image_size=56))
    with torch.no_grad():
        assert not torch.equal(bb.model.visual.patch_embed.proj.weight, random_bb.model.visual.patch_embed.proj.weight)


def test_make_base_refuses_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(InvalidSpec, match="not empty"):
        make_base(tmp_path / "full", renders=100, steps=1)
    with pytest.raises(InvalidSpec, match="choose from"):
        make_base(tmp_path / "new", tasks=("Nope-v1",), renders=100, steps=1)
    with pytest.raises(InvalidSpec, match="steps"):
        make_base(tmp_path / "new", renders=100, steps=0)
