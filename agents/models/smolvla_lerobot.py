"""LeRobot's own SmolVLA (``lerobot.policies.smolvla.VLAFlowMatching``) on a resident base's and
a tenant's ``smolvla_expert`` weights: the reference the cache path is checked against, and
the shapes a real-size base is checked against.

LeRobot's ``SmolVLMWithExpertModel`` asks a hub for its VLM's config and processor
(``AutoConfig``/``AutoProcessor.from_pretrained(vlm_model_name)``); ``offline_smolvlm``
hands it the project's config (``build_smolvlm_config``) and a processor stub carrying the
two image-token ids ``VLAFlowMatching`` reads (unused: ``add_image_special_tokens`` is off)
for the duration of a ``with`` block. LeRobot's own code (its constructor, truncation to
``num_vlm_layers``, expert layout, ``embed_prefix``, masks, positions, RoPE, attention,
``sample_actions``) then runs unchanged.

See docs/ARCHITECTURE.md, "Model families: the SmolVLA base".
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from transformers import SmolVLMConfig

from joynexus.agents.models.heads.smolvla import SmolVLAExpertHead, smolvla_lerobot_keys
from joynexus.agents.models.smolvla_base import SmolVLABase
from joynexus.agents.models.smolvla_config import SmolVLABaseConfig

__all__ = ["lerobot_smolvla", "lerobot_smolvla_config", "offline_smolvlm"]


@contextmanager
def offline_smolvlm(config: SmolVLMConfig) -> Iterator[None]:
    """LeRobot's hub reads of the VLM's config and processor answered locally, for the block."""
    import lerobot.policies.smolvla.smolvlm_with_expert as swe

    saved = swe.AutoConfig, swe.AutoProcessor
    tok = SimpleNamespace(fake_image_token_id=0, global_image_token_id=1)

    class _Config:
        @staticmethod
        def from_pretrained(*a: Any, **kw: Any) -> SmolVLMConfig:
            return copy.deepcopy(config)

    class _Processor:
        @staticmethod
        def from_pretrained(*a: Any, **kw: Any) -> Any:
            return SimpleNamespace(tokenizer=tok)

    swe.AutoConfig, swe.AutoProcessor = _Config, _Processor  # type: ignore[assignment]
    try:
        yield
    finally:
        swe.AutoConfig, swe.AutoProcessor = saved  # type: ignore[misc]


def lerobot_smolvla_config(cfg: SmolVLABaseConfig, expert_width: int, horizon: int, steps: int) -> Any:
    """LeRobot's ``SmolVLAConfig`` for a base of ``cfg`` and an expert ``expert_width`` wide."""
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig

    t = cfg.table
    hidden = int(t["text"]["hidden_size"])
    return SmolVLAConfig(chunk_size=horizon, n_action_steps=horizon, num_steps=steps, max_state_dim=cfg.max_state_dim,
                         num_vlm_layers=t["num_vlm_layers"], self_attn_every_n_layers=t["self_attn_every_n_layers"],
                         expert_width_multiplier=(expert_width + 0.5) / hidden,  # int() of it is the width
                         load_vlm_weights=False, device="cpu", tokenizer_max_length=cfg.max_text_tokens)


def lerobot_smolvla(base: SmolVLABase, head: SmolVLAExpertHead, steps: int) -> Any:
    """LeRobot's ``VLAFlowMatching`` holding ``base``'s VLM and ``state_proj`` and ``head``'s
    expert weights (copied, float32, eval)."""
    from lerobot.policies.smolvla.modeling_smolvla import VLAFlowMatching

    from joynexus.agents.models.smolvla_config import build_smolvlm_config

    scfg = build_smolvlm_config(base.config, len(base.tokenizer))
    lcfg = lerobot_smolvla_config(base.config, head.cfg.hidden, head.cfg.action_horizon, steps)
    with offline_smolvlm(scfg):
        model = VLAFlowMatching(lcfg)
    sd = {f"vlm_with_expert.vlm.model.{k}": v for k, v in base.model.state_dict().items()}
    sd.update({f"state_proj.{k}": v for k, v in base.state_proj.state_dict().items()})
    sd.update({k[len("model."):]: v for k, v in smolvla_lerobot_keys(head.state_dict()).items()})
    missing, unexpected = model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=False)
    left = [k for k in missing if not k.startswith(("vlm_with_expert.vlm.lm_head.", "vlm_with_expert.lm_expert.lm_head"))]
    if left or unexpected:
        raise RuntimeError(f"SmolVLA -> LeRobot names: missing {left}, unexpected {unexpected}")
    return model.eval()
