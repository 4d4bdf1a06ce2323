"""LeRobot's own π0.5 (``lerobot.policies.pi05.PI05Pytorch``) on a resident base's and a
tenant's ``pi05_expert`` weights: the reference the cache path is checked against.

LeRobot 0.4.4's ``pi05`` needs transformers' ``fix/lerobot_openpi`` branch (OpenPI's
``transformers_replace``: adaptive RMSNorm with a residual gate, no embedding
normaliser inside ``GemmaModel``, a read-only prefix cache when ``use_cache=False``, and
``transformers.models.siglip.check``). The installed transformers is the release, so
``openpi_transformers`` installs those four changes for the duration of a ``with``
block (and removes them after); LeRobot's own code (``embed_prefix``, ``embed_suffix``,
the masks and positions, ``sample_actions``'s loop, the time MLP) runs unchanged.
``lerobot_model`` builds the ``PI05Pytorch`` around the base's PaliGemma (shared, not
copied) without LeRobot's hard-coded so400m/257k-vocabulary construction.

See docs/ARCHITECTURE.md, "Model families: the π0.5 base".
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.gemma import modeling_gemma as mg

from joynexus.agents.models.heads.pi05 import Pi05ExpertHead, pi05_lerobot_keys
from joynexus.agents.models.pi05_base import Pi05Base

__all__ = ["LEROBOT_VOCAB", "lerobot_expert", "lerobot_model", "lerobot_tiny", "openpi_transformers"]


def _rms(self: Any, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    var = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
    normed = x * torch.rsqrt(var + self.eps)
    dense = getattr(self, "dense", None)
    if cond is None or dense is None:
        return (normed * (1.0 + self.weight.float())).to(x.dtype), None
    mod = dense(cond)
    if x.ndim == 3:
        mod = mod[:, None]
    scale, shift, gate = mod.chunk(3, dim=-1)
    return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def _gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


class _ReadOnlyCache:
    """The prefix's cache seen by a denoising step: its keys and values, then the step's (not stored)."""

    def __init__(self, cache: DynamicCache) -> None:
        self.cache = cache

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *a: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.cache.layers[layer_idx]
        assert layer.keys is not None and layer.values is not None
        return torch.cat([layer.keys, k], 2), torch.cat([layer.values, v], 2)


def _layer(self: Any, hidden_states: torch.Tensor, attention_mask: Any = None, position_ids: Any = None,
           past_key_values: Any = None, use_cache: Any = False, cache_position: Any = None,
           position_embeddings: Any = None, adarms_cond: Any = None, **kw: Any) -> torch.Tensor:
    residual = hidden_states
    h, gate = self.input_layernorm(hidden_states, cond=adarms_cond)
    h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, cache_position=cache_position,
                          position_embeddings=position_embeddings)
    h = _gated_residual(residual, h, gate)
    residual = h
    h, gate = self.post_attention_layernorm(h, cond=adarms_cond)
    return _gated_residual(residual, self.mlp(h), gate)


def _model(self: Any, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
           past_key_values: Any = None, inputs_embeds: Any = None, use_cache: Any = None,
           cache_position: Any = None, adarms_cond: Any = None, **kw: Any) -> BaseModelOutputWithPast:
    h = inputs_embeds  # OpenPI scales the language embeddings itself (embed_prefix): no normaliser here
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=self.config)
    cache = past_key_values if use_cache else (_ReadOnlyCache(past_key_values) if past_key_values is not None else None)
    pe = self.rotary_emb(h, position_ids)
    for layer in self.layers:
        h = layer(h, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                  use_cache=use_cache, position_embeddings=pe, adarms_cond=adarms_cond)
    h, _ = self.norm(h, cond=adarms_cond)
    return BaseModelOutputWithPast(last_hidden_state=h, past_key_values=past_key_values if use_cache else None)


@contextmanager
def openpi_transformers() -> Iterator[None]:
    """OpenPI's four transformers changes, installed for the block, removed after."""
    saved = (mg.GemmaRMSNorm.forward, mg.GemmaDecoderLayer.forward, mg.GemmaModel.forward,
             getattr(mg, "_gated_residual", None), sys.modules.get("transformers.models.siglip.check"))
    check = types.ModuleType("transformers.models.siglip.check")
    check.check_whether_transformers_replace_is_installed_correctly = lambda: True  # type: ignore[attr-defined]
    mg.GemmaRMSNorm.forward = _rms  # type: ignore[method-assign,assignment]
    mg.GemmaDecoderLayer.forward = _layer  # type: ignore[method-assign,assignment]
    mg.GemmaModel.forward = _model  # type: ignore[method-assign,assignment]
    mg._gated_residual = _gated_residual  # type: ignore[attr-defined]
    sys.modules["transformers.models.siglip.check"] = check
    try:
        yield
    finally:
        mg.GemmaRMSNorm.forward, mg.GemmaDecoderLayer.forward, mg.GemmaModel.forward = saved[:3]  # type: ignore[method-assign]
        if saved[3] is None:
            del mg._gated_residual  # type: ignore[attr-defined]
        else:
            mg._gated_residual = saved[3]  # type: ignore[attr-defined]
        if saved[4] is None:
            sys.modules.pop("transformers.models.siglip.check", None)
        else:
            sys.modules["transformers.models.siglip.check"] = saved[4]


def _adaptive(norm: nn.Module, width: int) -> None:
    """A Gemma norm made OpenPI's adaptive one (``dense`` instead of ``weight``)."""
    del norm.weight
    norm.dense = nn.Linear(width, 3 * width)  # type: ignore[assignment]


def lerobot_expert(width: int, head_dim: int, depth: int, vocab: int = 1) -> Any:
    """LeRobot's expert (``GemmaForCausalLM`` without embeddings, adaptive norms) of these sizes."""
    from transformers import GemmaConfig, GemmaForCausalLM

    ecfg = GemmaConfig(head_dim=head_dim, hidden_size=width, intermediate_size=4 * width, num_attention_heads=8,
                       num_hidden_layers=depth, num_key_value_heads=1, vocab_size=vocab,
                       hidden_activation="gelu_pytorch_tanh", use_adarms=True, adarms_cond_dim=width)
    ecfg._attn_implementation = "eager"
    expert = GemmaForCausalLM(ecfg)
    expert.model.embed_tokens = None
    for layer in expert.model.layers:
        _adaptive(layer.input_layernorm, width)
        _adaptive(layer.post_attention_layernorm, width)
    _adaptive(expert.model.norm, width)
    return expert


def lerobot_model(base: Pi05Base, head: Pi05ExpertHead, steps: int) -> Any:
    """LeRobot's ``PI05Pytorch`` with ``base``'s PaliGemma and ``head``'s expert weights
    (float32, eval). Call it inside ``openpi_transformers()``."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PaliGemmaWithExpertModel, PI05Pytorch

    c = head.cfg
    side = base.config.image_size
    cfg = PI05Config(chunk_size=c.action_horizon, n_action_steps=c.action_horizon, num_inference_steps=steps,
                     max_state_dim=base.config.max_state_dim, image_resolution=(side, side), device="cpu")
    expert = lerobot_expert(c.hidden, head.head_dim, c.kv_layers)
    pwe = PaliGemmaWithExpertModel.__new__(PaliGemmaWithExpertModel)
    nn.Module.__init__(pwe)
    pwe.freeze_vision_encoder, pwe.train_expert_only = False, True
    pwe.paligemma = base.model  # shared: LeRobot reads the very weights the service serves
    pwe.gemma_expert = expert
    model = PI05Pytorch.__new__(PI05Pytorch)
    nn.Module.__init__(model)
    model.config, model.rtc_processor, model.gradient_checkpointing_enabled = cfg, None, False
    model.paligemma_with_expert = pwe
    w = c.hidden
    model.action_in_proj = nn.Linear(32, w)
    model.action_out_proj = nn.Linear(w, 32)
    model.time_mlp_in = nn.Linear(w, w)
    model.time_mlp_out = nn.Linear(w, w)
    sd = {k[len("model."):]: v for k, v in pi05_lerobot_keys(head.state_dict()).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    unused = ("paligemma_with_expert.paligemma.", "paligemma_with_expert.gemma_expert.lm_head.")  # base; never read
    left = [k for k in missing if not k.startswith(unused)]
    if left or unexpected:
        raise RuntimeError(f"pi05_expert -> LeRobot names: missing {left}, unexpected {unexpected}")
    return model.eval()


#: The vocabulary LeRobot's ``PaliGemmaWithExpertModel`` hard-codes (PaliGemma's tokenizer);
#: an export pads the embeddings to it so LeRobot's strict load sees its own shapes.
LEROBOT_VOCAB = 257_152


@contextmanager
def lerobot_tiny() -> Iterator[None]:
    """LeRobot's ``PI05Policy`` at the project's ``tiny`` size, for tests: its
    ``paligemma_variant="gemma_2b"`` builds the tiny PaliGemma (SigLIP tiny tower, vocabulary
    ``LEROBOT_VOCAB``) and ``action_expert_variant="gemma_300m"`` the tiny expert, where LeRobot
    hard-codes the real sizes. Only the construction is replaced; ``save_pretrained``,
    ``from_pretrained``, the processors and ``sample_actions`` are LeRobot's. Nest inside
    ``openpi_transformers()`` (LeRobot's adaptive norms)."""
    from lerobot.policies.pi05 import modeling_pi05 as lm

    from joynexus.agents.models.pi05_config import (
        GEMMA_VARIANTS,
        Pi05BaseConfig,
        build_paligemma_config,
    )
    from joynexus.agents.models.tokenizer import train_tokenizer

    sizes = {"gemma_2b": GEMMA_VARIANTS["tiny"], "gemma_300m": GEMMA_VARIANTS["tiny_expert"]}

    def gemma_config(variant: str) -> Any:
        return lm.GemmaConfig(**{k: sizes[variant][k] for k in ("width", "depth", "mlp_dim", "num_heads",
                                                                  "num_kv_heads", "head_dim")})

    def build(self: Any, vlm_config: Any, action_expert_config: Any, use_adarms: Any = None,
              precision: str = "float32", image_size: int = 224, freeze_vision_encoder: bool = False,
              train_expert_only: bool = False) -> None:
        nn.Module.__init__(self)
        self.freeze_vision_encoder, self.train_expert_only = freeze_vision_encoder, train_expert_only
        pcfg = build_paligemma_config(Pi05BaseConfig(image_size=image_size), train_tokenizer())
        pcfg.text_config.vocab_size = pcfg.vocab_size = pcfg.image_token_index = LEROBOT_VOCAB
        pcfg.text_config._attn_implementation = pcfg.vision_config._attn_implementation = "eager"
        self.paligemma = lm.PaliGemmaForConditionalGeneration(pcfg)
        e = action_expert_config
        self.gemma_expert = lerobot_expert(e.width, e.head_dim, e.depth, vocab=LEROBOT_VOCAB)
        self.to_bfloat16_for_selected_params(precision)

    saved = (lm.get_gemma_config, lm.PaliGemmaWithExpertModel.__init__)
    lm.get_gemma_config = gemma_config
    lm.PaliGemmaWithExpertModel.__init__ = build  # type: ignore[method-assign]
    try:
        yield
    finally:
        lm.get_gemma_config, lm.PaliGemmaWithExpertModel.__init__ = saved  # type: ignore[method-assign]
