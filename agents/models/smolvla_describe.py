"""``joynexus base describe --base smolvla``: a SmolVLA base's and its expert's costs, counted
on the meta device (no weights allocated, so the real size is described in a second).

See docs/ARCHITECTURE.md, "Model families: the SmolVLA base".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from joynexus.schemas.errors import InvalidSpec

__all__ = ["describe_smolvla", "meta_base"]


def meta_base(size: str, max_state_dim: int = 32, max_text_tokens: int = 48) -> Any:
    """A ``SmolVLABase`` of ``size`` on the meta device (shapes and counts only, no memory)."""
    from transformers import SmolVLMModel

    from joynexus.agents.models.smolvla_base import SmolVLABase
    from joynexus.agents.models.smolvla_config import SmolVLABaseConfig, build_smolvlm_config
    from joynexus.agents.models.tokenizer import train_tokenizer

    cfg = SmolVLABaseConfig(size=size, max_state_dim=max_state_dim, max_text_tokens=max_text_tokens,  # type: ignore[arg-type]
                            device="meta")
    tok = train_tokenizer()
    scfg = build_smolvlm_config(cfg, len(tok))
    with torch.device("meta"):
        model = SmolVLMModel(scfg)
        state_proj = nn.Linear(cfg.max_state_dim, scfg.text_config.hidden_size)
    return SmolVLABase(model, state_proj, tok, cfg)


def describe_smolvla(size: str, cameras: int, state_dim: int, action_dim: int, action_horizon: int,
                     budget_bytes: int, path: str | None = None) -> dict[str, Any]:
    """Family, parameters of the base (the kept layers, ``state_proj``) and of one tenant's
    default expert (LeRobot's width), prefix tokens per sample, bytes per row of its cache.
    ``path``: a LeRobot policy directory, whose config and shapes fix the size (``size`` unused)."""
    from joynexus.agents.models.heads.base import HeadConfig, build_head
    from joynexus.agents.models.smolvla_checkpoint import checkpoint_config

    state_max, text_max = 32, 48
    if path is not None:
        cfg = checkpoint_config(path)
        size, state_max, text_max = cfg.size, cfg.max_state_dim, cfg.max_text_tokens
    if state_dim > state_max:
        raise InvalidSpec(f"state_dim={state_dim}: this SmolVLA base takes at most max_state_dim={state_max} values")
    base = meta_base(size, state_max, text_max)
    d = base.describe(n_cameras=cameras)
    n = base.kv_layout[0]
    hcfg = HeadConfig(base.feature_dim, state_dim, action_dim, action_horizon, hidden=base.config.expert_width,
                      kv_layers=n)
    with torch.device("meta"):
        head_params = sum(p.numel() for p in build_head("smolvla_expert", hcfg).parameters())
    worst = base.kv_bytes_per_row(base.max_prefix_tokens())
    return {
        "family": "smolvla", "size": size, "base_model": base.config.base_model,
        "params": {"base": d["params"]["base"], "vision": d["params"]["vision"], "head": head_params},
        "head": "smolvla_expert", "cameras": cameras, "state_dim": state_dim,
        "prefix_tokens_per_sample": d["prefix_tokens_per_sample"], "kv_bytes_per_row": d["kv_bytes_per_row"],
        "feature": "per-layer prefix keys and values", "feature_dim": base.feature_dim, "kv_layers": n,
        "kv_heads": d["kv_heads"], "head_dim": d["head_dim"], "expert_width": base.config.expert_width,
        "self_attn_every_n_layers": base.config.table["self_attn_every_n_layers"],
        "max_kv_bytes_per_row": worst, "rows_within_kv_budget": budget_bytes // worst,
        "image_size": base.config.image_size, "image_tokens": base.config.image_tokens,
        "max_state_dim": base.config.max_state_dim, **({"path": path} if path is not None else {}),
    }
