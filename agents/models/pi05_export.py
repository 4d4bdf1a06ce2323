"""A resident π0.5 base and a tenant's ``pi05_expert`` written as a LeRobot ``PI05Policy``
checkpoint (``joynexus base export-lerobot``), for LeRobot's ``PI05Policy.from_pretrained``.

The directory holds what LeRobot's ``save_pretrained`` writes and its loader reads
offline: ``config.json`` (``PI05Config``: the chunk, steps, state and image sizes, the
tenant's cameras, state and action features), ``model.safetensors`` (the base's
PaliGemma and the expert under LeRobot's names, in the shapes LeRobot builds: the
embeddings padded with zero rows to PaliGemma's 257,152-token vocabulary and stored under
both tied names, an all-zero expert ``lm_head`` LeRobot allocates and never reads),
``policy_preprocessor.json``/``policy_postprocessor.json`` made by LeRobot's own
``make_pi05_pre_post_processors`` (mean/std normalisation with the head's statistics,
the state's scaled as ``prefix_state`` scales it; identity when the head has none) whose
tokenizer is the project's, saved in ``tokenizer/`` and named by its local path, and
``joynexus.json`` (the base model, the tenant's workload and version).

LeRobot's config names only ``gemma_300m`` and ``gemma_2b``: a ``tiny`` base is written as
``gemma_2b`` (expert ``gemma_300m``) and loads with LeRobot's construction at the tiny
size (``pi05_lerobot.lerobot_tiny``, tests); ``joynexus.json`` says which. LeRobot 0.4.4
builds a ``gemma_300m`` PaliGemma with a 2048-wide image projector its text model cannot
take, so a ``gemma_300m`` base is refused. See docs/ARCHITECTURE.md, "Model families".
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from joynexus.agents.models.heads.base import PREFIX_STATE_SPAN, HeadConfig
from joynexus.agents.models.heads.pi05 import pi05_lerobot_keys
from joynexus.agents.models.pi05_checkpoint import BASE_PREFIX, EXPERT_PREFIX, check_lerobot_head
from joynexus.agents.models.pi05_lerobot import LEROBOT_VOCAB
from joynexus.schemas.errors import InvalidSpec

__all__ = ["LEROBOT_VARIANT", "export_lerobot", "export_target", "head_from_export", "lerobot_stats"]

#: The ``paligemma_variant`` LeRobot's config is given for each base size (None: refused).
LEROBOT_VARIANT: dict[str, str | None] = {"tiny": "gemma_2b", "gemma_2b": "gemma_2b", "gemma_300m": None}


def head_from_export(path: str) -> tuple[Any, dict[str, Any]]:
    """A head exported by ``Client.export`` (``head.safetensors`` + ``manifest.json``) rebuilt
    as a ``TenantModule``, and its manifest."""
    from safetensors.torch import load_file

    from joynexus.agents.models.heads.tenant import TenantModule

    try:
        manifest = json.loads(Path(path, "manifest.json").read_text())
        cfg = HeadConfig(**manifest["head_config"])
        module = TenantModule(str(manifest.get("tenant_id", "export")), str(manifest["action_module"]), cfg)
        module.head.load_state_dict(load_file(str(Path(path, "head.safetensors"))))
    except InvalidSpec:
        raise
    except Exception as e:  # missing files, another layout, weights of other shapes
        raise InvalidSpec(f"{path!r} is not a head exported by Client.export ({type(e).__name__}: {str(e)[:200]})") from None
    module.version = int(manifest.get("version", 0))
    module.head.eval()
    return module, manifest


def lerobot_stats(head: Any, state_span: float = 1.0) -> dict[str, dict[str, torch.Tensor]] | None:
    """LeRobot's mean/std statistics of the head's normalisation (None: identity). The state's
    std is scaled by ``state_span`` (π0.5: ``PREFIX_STATE_SPAN``, as LeRobot's normalised state
    is what the prompt bins; SmolVLA: 1)."""
    b = {k: head.get_buffer(k).detach().float() for k in ("state_mean", "state_std", "action_mean", "action_std")}
    if all(bool((b[k] == (1.0 if k.endswith("std") else 0.0)).all()) for k in b):
        return None
    return {"observation.state": {"mean": b["state_mean"], "std": b["state_std"] * state_span},
            "action": {"mean": b["action_mean"], "std": b["action_std"]}}


def export_target(base: Any, c: HeadConfig, cameras: Sequence[str], out: str | Path) -> Path:
    """``out`` made, after checking that the head (config ``c``) reads ``base``'s cache, that
    ``cameras`` are names and that ``out`` is a new or empty directory (``InvalidSpec``)."""
    if c.feature_dim != base.feature_dim or c.kv_layers != base.kv_layout[0]:
        raise InvalidSpec(f"the head reads a cache {c.feature_dim} wide over {c.kv_layers} layers; this "
                          f"{base.config.base_model} base gives {base.feature_dim} over {base.kv_layout[0]}")
    if not cameras or not all(isinstance(s, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", s) for s in cameras):
        raise InvalidSpec(f"camera slots {list(cameras)[:8]} must be names")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InvalidSpec(f"--out {str(target)[:200]!r} must be a new or empty directory")
    target.mkdir(parents=True, exist_ok=True)
    return target


def _state_dict(base: Any, head: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in base.model.state_dict().items():
        t = v.detach().to(torch.float32).cpu()
        if k in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
            if t.shape[0] > LEROBOT_VOCAB:
                raise InvalidSpec(f"the base's vocabulary ({t.shape[0]}) exceeds LeRobot's {LEROBOT_VOCAB}")
            t = torch.cat([t, t.new_zeros(LEROBOT_VOCAB - t.shape[0], t.shape[1])])
        out[BASE_PREFIX + k] = t.contiguous().clone()
    for k, v in pi05_lerobot_keys(head.state_dict()).items():
        out[k] = v.detach().to(torch.float32).cpu().contiguous().clone()
    out[EXPERT_PREFIX + "lm_head.weight"] = torch.zeros(LEROBOT_VOCAB, head.cfg.hidden)
    return out


def export_lerobot(base: Any, module: Any, out: str | Path, *, cameras: Sequence[str],
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``base`` + ``module``'s ``pi05_expert`` as a LeRobot ``PI05Policy`` directory at
    ``out`` (new or empty); returns what was written. ``cameras``: the tenant's camera slots."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.pi05 import processor_pi05
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from safetensors.torch import save_file

    head = module.head
    check_lerobot_head(module.head_type, head.cfg)
    variant = LEROBOT_VARIANT[base.config.paligemma_variant]
    if variant is None:
        raise InvalidSpec("LeRobot 0.4.4 builds a gemma_300m PaliGemma with a 2048-wide image projector its 1024-wide "
                          "text model cannot read: export a tiny or gemma_2b base")
    c: HeadConfig = head.cfg
    target = export_target(base, c, cameras, out)
    side = base.config.image_size
    stats = lerobot_stats(head, PREFIX_STATE_SPAN)
    norm = NormalizationMode.MEAN_STD if stats else NormalizationMode.IDENTITY
    cfg = PI05Config(
        paligemma_variant=variant, action_expert_variant="gemma_300m", chunk_size=c.action_horizon,
        n_action_steps=c.action_horizon, num_inference_steps=c.flow_steps, max_state_dim=base.config.max_state_dim,
        image_resolution=(side, side), device="cpu", tokenizer_max_length=base.prompt.max_tokens,
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": norm, "ACTION": norm},
        input_features={**{f"observation.images.{s}": PolicyFeature(FeatureType.VISUAL, (3, side, side))
                           for s in cameras},
                        "observation.state": PolicyFeature(FeatureType.STATE, (c.state_dim,))},
        output_features={"action": PolicyFeature(FeatureType.ACTION, (c.action_dim,))},
    )
    cfg._save_pretrained(target)
    save_file(_state_dict(base, head), str(target / "model.safetensors"))
    tok_dir = (target / "tokenizer").resolve()
    base.tokenizer.save_pretrained(str(tok_dir))
    step = processor_pi05.TokenizerProcessorStep
    processor_pi05.TokenizerProcessorStep = lambda **kw: step(**{**kw, "tokenizer_name": str(tok_dir)})  # type: ignore[misc,assignment]
    try:  # LeRobot's factory, with the project's tokenizer where it names PaliGemma's on a hub
        pre, post = processor_pi05.make_pi05_pre_post_processors(cfg, dataset_stats=stats)  # type: ignore[arg-type]
    finally:
        processor_pi05.TokenizerProcessorStep = step  # type: ignore[misc]
    pre.save_pretrained(str(target))
    post.save_pretrained(str(target))
    info = {"base_model": base.config.base_model, "paligemma_variant": base.config.paligemma_variant,
            "lerobot_paligemma_variant": variant, "normalization": "mean_std" if stats else "identity",
            "cameras": list(cameras), **(extra or {})}
    (target / "joynexus.json").write_text(json.dumps(info, indent=2))
    return {"out": str(target), "files": sorted(os.listdir(target)), **info}
