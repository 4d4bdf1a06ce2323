"""``joynexus base describe --base pi05 [--path DIR]``: a π0.5 base's and its expert's costs,
counted on the meta device (no weights allocated, so ``gemma_2b`` is described in seconds).

With ``--path``, a LeRobot ``PI05Policy`` directory is described from its ``config.json`` and
its tensors' shapes alone (``pi05_checkpoint.read_pi05``: the Gemma variant, image side,
vocabulary rows, expert width and ``max_state_dim``; no tensor is read), so the figures are
those of the base ``--backbone-path DIR`` would load and of the expert ``init_from_checkpoint``
would start.

See docs/ARCHITECTURE.md, "Model families: the π0.5 base".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from joynexus.schemas.errors import InvalidSpec

__all__ = ["describe_pi05"]

#: The instruction the figures are counted for (as ``families.describe`` counts the other families).
_INSTRUCTION = "push the cube to the goal region"


def _count(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def describe_pi05(size: str, cameras: int, state_dim: int, action_dim: int, action_horizon: int,
                  budget_bytes: int, path: str | None = None) -> dict[str, Any]:
    """Family, parameters of the base and of one tenant's default expert, prefix tokens per
    sample, bytes per row of its cache. ``path``: a LeRobot PI05Policy directory, whose shapes
    fix the size (``size`` unused)."""
    from transformers import PaliGemmaForConditionalGeneration

    from joynexus.agents.models.heads.base import HeadConfig, build_head
    from joynexus.agents.models.pi05_base import Pi05Prompt
    from joynexus.agents.models.pi05_config import (
        GEMMA_VARIANTS,
        Pi05BaseConfig,
        build_paligemma_config,
    )
    from joynexus.agents.models.tokenizer import train_tokenizer

    tok = train_tokenizer()
    vocab: int | None = None
    if path is not None:
        from joynexus.agents.models.pi05_checkpoint import read_pi05

        _, geo = read_pi05(path)
        if state_dim > geo["max_state_dim"]:
            raise InvalidSpec(f"state_dim={state_dim}: this π0.5 checkpoint takes at most "
                              f"max_state_dim={geo['max_state_dim']} values")
        size, vocab = geo["paligemma_variant"], geo["vocab"]
        cfg = Pi05BaseConfig(paligemma_variant=size, image_size=geo["image_size"],  # type: ignore[arg-type]
                             max_state_dim=geo["max_state_dim"])
    else:
        cfg = Pi05BaseConfig(paligemma_variant=size, image_size=56 if size == "tiny" else 224,  # type: ignore[arg-type]
                             max_state_dim=max(32, state_dim) if size != "tiny" else max(8, state_dim))
    pcfg = build_paligemma_config(cfg, tok)
    if vocab is not None:  # the checkpoint's rows, as load_pi05_base builds it
        pcfg.text_config.vocab_size = pcfg.vocab_size = vocab
        pcfg.image_token_index = vocab
    with torch.device("meta"):
        base_params = _count(PaliGemmaForConditionalGeneration(pcfg))
    prompt = Pi05Prompt(tok, cfg)  # the prompt layout only: no weights are built
    zeros = np.zeros((1, state_dim), dtype=np.float32)
    tokens = cameras * cfg.image_tokens + int(prompt.tokenize([_INSTRUCTION], zeros)[1][0])
    g = cfg.gemma
    kv_dim = g["depth"] * 2 * g["num_kv_heads"] * g["head_dim"]
    width = GEMMA_VARIANTS[cfg.expert_variant]["width"]
    hcfg = HeadConfig(kv_dim, state_dim, action_dim, action_horizon, hidden=width, kv_layers=g["depth"])
    with torch.device("meta"):
        head_params = _count(build_head("pi05_expert", hcfg))
    worst = (4 * cfg.image_tokens + prompt.max_tokens) * (kv_dim + 1) * 4
    return {"family": "pi05", "size": size, "params": {"base": base_params, "head": head_params},
            "head": "pi05_expert", "cameras": cameras, "state_dim": state_dim,
            "prefix_tokens_per_sample": tokens, "kv_bytes_per_row": tokens * (kv_dim + 1) * 4,
            "feature": "per-layer prefix keys and values", "feature_dim": kv_dim, "kv_layers": g["depth"],
            "max_kv_bytes_per_row": worst, "rows_within_kv_budget": budget_bytes // worst,
            "expert_variant": cfg.expert_variant, "expert_width": width, "image_size": cfg.image_size,
            "max_state_dim": cfg.max_state_dim, **({"path": path, "vocab": vocab} if path is not None else {})}
