"""A resident SmolVLA base and a tenant's ``smolvla_expert`` written as a LeRobot
``SmolVLAPolicy`` directory (``joynexus base export-lerobot --base smolvla``), for LeRobot's
``SmolVLAPolicy.from_pretrained``.

The directory holds what LeRobot's ``save_pretrained`` writes: ``config.json``
(``SmolVLAConfig``: chunk, steps, kept layers, expert width, state and image sizes, the
tenant's cameras, state and action features), ``model.safetensors`` (LeRobot's own
``VLAFlowMatching`` state dict holding the base's VLM and ``state_proj`` and the head's
expert; the ``lm_head``s LeRobot allocates and never reads written as zeros), and the
pre/post processors of LeRobot's ``make_smolvla_pre_post_processors`` (mean/std with the
head's statistics; identity when it has none). LeRobot reads its VLM's config and tokenizer
from ``vlm_model_name``, a hub name; here it names ``vlm/`` in the directory (absolute path),
holding the project's SmolVLM config and tokenizer (its image-token attributes mapped onto
existing special tokens: ``add_image_special_tokens`` is off, so they are never read), so
nothing is downloaded. LeRobot's ``SmolVLMWithExpertModel`` also builds a ``SmolVLMProcessor``
from it, which transformers will not make without the ``num2words`` package (not installed
here); with it absent, a caller answers that one read (tests: the tokenizer in ``vlm/``).
``joynexus.json`` says what was written. See docs/ARCHITECTURE.md, "Model families: the SmolVLA base".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.pi05_export import export_target, lerobot_stats
from joynexus.schemas.errors import InvalidSpec

__all__ = ["VLM_DIR", "export_smolvla"]

#: Where the VLM's config and tokenizer go inside an export (``vlm_model_name``).
VLM_DIR = "vlm"
#: LeRobot reads these image tokens' ids off the tokenizer (never used: no image special tokens).
_IMAGE_TOKENS = {"fake_image_token": "<|vision_start|>", "global_image_token": "<|vision_end|>",
                 "image_token": "<|image_pad|>"}


def _save_vlm(base: Any, vlm: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from joynexus.agents.models.smolvla_config import build_smolvlm_config

    build_smolvlm_config(base.config, len(base.tokenizer)).save_pretrained(str(vlm))
    tok = base.tokenizer
    named = {k: v for k, v in tok.special_tokens_map.items() if k != "additional_special_tokens"}
    out = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, **named,
                                  additional_special_tokens=list(tok.additional_special_tokens),
                                  extra_special_tokens=_IMAGE_TOKENS)
    if len(out) != len(tok):
        raise InvalidSpec("the SmolVLA tokenizer lacks the special tokens an export maps image tokens onto")
    out.save_pretrained(str(vlm))


def export_smolvla(base: Any, module: Any, out: str | Path, *, cameras: Sequence[str],
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``base`` + ``module``'s ``smolvla_expert`` as a LeRobot ``SmolVLAPolicy`` directory at
    ``out`` (new or empty); returns what was written. ``cameras``: the tenant's camera slots."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors
    from safetensors.torch import save_file

    from joynexus.agents.models.smolvla_lerobot import lerobot_smolvla, lerobot_smolvla_config

    if module.head_type != "smolvla_expert":
        raise InvalidSpec(f"a LeRobot SmolVLA policy holds a smolvla_expert, not a {str(module.head_type)[:40]!r} head")
    head = module.head
    c: HeadConfig = head.cfg
    target = export_target(base, c, cameras, out)
    vlm = (target / VLM_DIR).resolve()
    _save_vlm(base, vlm)
    side = base.config.image_size
    stats = lerobot_stats(head)
    norm = NormalizationMode.MEAN_STD if stats else NormalizationMode.IDENTITY
    cfg = lerobot_smolvla_config(base.config, c.hidden, c.action_horizon, c.flow_steps)
    cfg.vlm_model_name = str(vlm)
    cfg.resize_imgs_with_padding = (side, side)
    cfg.normalization_mapping = {"VISUAL": NormalizationMode.IDENTITY, "STATE": norm, "ACTION": norm}
    cfg.input_features = {**{f"observation.images.{s}": PolicyFeature(FeatureType.VISUAL, (3, side, side))
                             for s in cameras},
                          "observation.state": PolicyFeature(FeatureType.STATE, (c.state_dim,))}
    cfg.output_features = {"action": PolicyFeature(FeatureType.ACTION, (c.action_dim,))}
    cfg._save_pretrained(target)
    with contextlib.redirect_stdout(sys.stderr):  # LeRobot prints while it builds; stdout is the report's
        model = lerobot_smolvla(base, head, steps=c.flow_steps)
    sd = {f"model.{k}": (torch.zeros_like(v) if ".lm_head." in k else v).detach().to(torch.float32).contiguous()
          for k, v in model.state_dict().items()}
    save_file(sd, str(target / "model.safetensors"))
    pre, post = make_smolvla_pre_post_processors(cfg, dataset_stats=stats)  # type: ignore[arg-type]
    pre.save_pretrained(str(target))
    post.save_pretrained(str(target))
    info = {"base_model": base.config.base_model, "size": base.config.size, "vlm_model_name": str(vlm),
            "normalization": "mean_std" if stats else "identity", "cameras": list(cameras), **(extra or {})}
    (target / "joynexus.json").write_text(json.dumps(info, indent=2))
    return {"out": str(target), "files": sorted(os.listdir(target)), **info}
