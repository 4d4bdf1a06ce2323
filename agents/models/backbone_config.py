"""How the resident backbone is built: ``BackboneConfig``, the model sizes, and the
Qwen2.5-VL model config and image processor made from them.

A base built from config (``size="tiny"``/``"bench"``) has random weights; one
loaded from a local directory keeps the settings saved beside its weights
(``META_FILE``, ``with_saved_settings``). Nothing is fetched from a hub.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2VLImageProcessor

from joynexus.agents.models.tokenizer import PAD_TOKEN, SPECIAL_TOKENS
from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "DTYPES",
    "META_FILE",
    "SAVED_SETTINGS",
    "SIZES",
    "BackboneConfig",
    "build_image_processor",
    "build_qwen_config",
    "with_saved_settings",
]

META_FILE = "joynexus_backbone.json"

# Model sizes built from config. "bench" is sized so a batch-4 forward takes
# ~30 ms on 2 CPU threads; the vision tower is kept small next to the LM so the
# shared language-model compute dominates, as it does for real VLA backbones.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, mrope_section=[2, 3, 3]),
        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2),
    ),
    "bench": dict(
        text=dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, mrope_section=[8, 12, 12]),
        vision=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2),
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BackboneConfig:
    """How to build the resident backbone. Validates itself.

    ``path``: a local directory to load with ``from_pretrained`` (then ``size``
    only names the model); None builds random weights of ``size``.
    ``image_size``: side (pixels, multiple of 28) the image processor resizes to.
    ``threads``: torch intra-op threads to set at build (None leaves it).
    A directory written by ``Backbone.save`` (or ``joynexus base pretrain``) also
    fixes ``size``, ``image_size``, ``max_text_tokens`` and ``tokenizer``: the
    base was made for them, so ``build`` takes them from its settings file.
    """

    size: Literal["tiny", "bench"] = "tiny"
    path: str | None = None
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    threads: int | None = None
    image_size: int = 56
    max_text_tokens: int = 48
    seed: int = 0
    #: Tokenizer of a base built from config: "bpe" (merges learned here from
    #: ``instruction_corpus()``, ~9 tokens per ManiSkill instruction) or "bytes"
    #: (one token per UTF-8 byte, ~40). A base loaded from ``path`` always uses
    #: the tokenizer saved with it.
    tokenizer: Literal["bpe", "bytes"] = "bpe"

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise InvalidSpec(f"BackboneConfig.size={self.size!r}: choose one of {sorted(SIZES)}")
        if self.dtype not in DTYPES:
            raise InvalidSpec(f"BackboneConfig.dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.image_size < 28 or self.image_size % 28:
            raise InvalidSpec(
                f"BackboneConfig.image_size={self.image_size}: must be a multiple of 28 (patch 14 x merge 2), >= 28"
            )
        if self.max_text_tokens < 1:
            raise InvalidSpec(f"BackboneConfig.max_text_tokens={self.max_text_tokens}: must be >= 1")
        if self.tokenizer not in ("bpe", "bytes"):
            raise InvalidSpec(f"BackboneConfig.tokenizer={self.tokenizer!r}: choose 'bpe' or 'bytes'")
        if self.threads is not None and self.threads < 1:
            raise InvalidSpec(f"BackboneConfig.threads={self.threads}: must be >= 1 or None")
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise InvalidSpec(f"BackboneConfig.device={self.device!r}: not a torch device ({e})") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InvalidSpec(f"BackboneConfig.device={self.device!r} but CUDA is not available; use 'cpu'")
        if self.path is not None and not Path(self.path).is_dir():
            raise InvalidSpec(f"BackboneConfig.path={self.path!r} is not a local directory; save a backbone there first")

    @property
    def base_model(self) -> str:
        return f"qwen2.5-vl-{self.size}"


def build_image_processor(image_size: int) -> Qwen2VLImageProcessor:
    """Qwen2-VL image processor pinned to ``image_size`` x ``image_size`` pixels."""
    px = image_size * image_size
    return Qwen2VLImageProcessor(min_pixels=px, max_pixels=px, patch_size=14, temporal_patch_size=2, merge_size=2)


def build_qwen_config(size: str, tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLConfig:
    spec = SIZES[size]
    t = dict(spec["text"])
    mrope = t.pop("mrope_section")
    head_dim = t["hidden_size"] // t["num_attention_heads"]
    if sum(mrope) * 2 != head_dim:
        raise InvalidSpec(f"size {size!r}: mrope_section {mrope} must sum to head_dim/2 = {head_dim // 2}")
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS}
    text_config = dict(
        t,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling={"type": "mrope", "mrope_section": mrope},
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=ids[PAD_TOKEN],
    )
    v = spec["vision"]
    vision_config = dict(
        v,
        out_hidden_size=t["hidden_size"],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=list(range(v["depth"])),
        in_channels=3,
    )
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=ids[PAD_TOKEN],
        tie_word_embeddings=False,
    )


#: Settings a saved base fixes (what it was built and trained for).
SAVED_SETTINGS = ("size", "image_size", "max_text_tokens", "tokenizer")


def with_saved_settings(config: BackboneConfig, p: Path) -> BackboneConfig:
    """``config`` with the settings saved beside the weights in ``p`` (if any)."""
    f = p / META_FILE
    if not f.is_file():
        return config
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise InvalidSpec(f"{f}: cannot read the base's settings ({e}); save the base again") from e
    if not isinstance(meta, dict):
        raise InvalidSpec(f"{f}: expected a JSON object of settings")
    fixed = {k: meta[k] for k in SAVED_SETTINGS if k in meta}
    return replace(config, **fixed) if fixed else config
