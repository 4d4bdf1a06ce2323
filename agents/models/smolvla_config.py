"""How a SmolVLA base (LeRobot ``smolvla``: SmolVLM's first layers and a per-tenant action
expert) is configured here: ``SmolVLABaseConfig``, the SmolVLM sizes, and the transformers
config made from them.

LeRobot's ``SmolVLMWithExpertModel`` reads its VLM's config and processor from a hub
(``vlm_model_name="HuggingFaceTB/SmolVLM2-500M-Video-Instruct"``); here every size is a
table entry the project writes: ``tiny`` for tests and ``smolvlm2_500m`` with the shapes of
SmolVLM2-500M (SigLIP base patch-16 at 512 px, a 4x pixel-shuffle connector, SmolLM2's
960-wide Llama layers with 15 query and 5 key/value heads of 64), of which the first
``num_vlm_layers`` are kept, as SmolVLA does (16). The tokenizer is the project's own.
The expert's layout is LeRobot's: as deep as the kept VLM, the VLM's heads and head size,
``expert_width_multiplier`` x the VLM's width; every ``self_attn_every_n_layers``-th
layer self-attends (over the prefix's keys and values and the action tokens), the others
cross-attend to the prefix's keys and values through their own ``k_proj``/``v_proj``.

See docs/ARCHITECTURE.md, "Model families: the SmolVLA base".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import SmolVLMConfig

from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "SMOLVLA_DTYPES",
    "SMOLVLM_SIZES",
    "SmolVLABaseConfig",
    "build_smolvlm_config",
    "cache_geometry",
    "expert_intermediate",
]

#: SmolVLM sizes: the Llama text model (``text``, all its layers), the SigLIP tower
#: (``vision``), the connector's pixel-shuffle ``scale_factor``, the layers SmolVLA keeps
#: (``num_vlm_layers``), how often the expert self-attends, and its width multiplier.
SMOLVLM_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=0),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    image_size=32, patch_size=8),
        scale_factor=2, num_vlm_layers=4, self_attn_every_n_layers=2, expert_width_multiplier=0.75,
    ),
    "smolvlm2_500m": dict(
        text=dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                  num_key_value_heads=5, head_dim=64, rms_norm_eps=1e-5, vocab_size=49_280,
                  rope_theta=100_000.0, max_position_embeddings=8192),
        vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=512, patch_size=16),
        scale_factor=4, num_vlm_layers=16, self_attn_every_n_layers=2, expert_width_multiplier=0.75,
    ),
}
SMOLVLA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def expert_intermediate(width: int) -> int:
    """LeRobot's ``get_intermediate_size``: the expert MLP's width for an expert ``width``."""
    h = int(4 * int(2 * width / 3))
    return 256 * ((h + 255) // 256)


@dataclass(frozen=True)
class SmolVLABaseConfig:
    """How to build the resident SmolVLA base. Validates itself.

    ``size``: ``tiny`` (tests) or ``smolvlm2_500m``. ``max_state_dim``: the state is padded to
    this many values and projected into the prefix's last token (``state_proj``); a longer
    state is refused. ``max_text_tokens``: the instruction's tokens kept (LeRobot's
    ``tokenizer_max_length``, 48).
    """

    size: Literal["tiny", "smolvlm2_500m"] = "tiny"
    max_state_dim: int = 32
    max_text_tokens: int = 48
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size not in SMOLVLM_SIZES:
            raise InvalidSpec(f"SmolVLABaseConfig.size={self.size!r}: choose one of {sorted(SMOLVLM_SIZES)}")
        for name in ("max_state_dim", "max_text_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 1 <= v <= 256:
                raise InvalidSpec(f"SmolVLABaseConfig.{name}={v!r}: an integer in [1, 256]")
        if self.dtype not in SMOLVLA_DTYPES:
            raise InvalidSpec(f"SmolVLABaseConfig.dtype={self.dtype!r}: choose one of {sorted(SMOLVLA_DTYPES)}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InvalidSpec(f"SmolVLABaseConfig.threads={self.threads!r}: an integer >= 1 or None")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise InvalidSpec(f"SmolVLABaseConfig.device={self.device!r}: not a torch device ({e})") from e

    @property
    def base_model(self) -> str:
        return f"smolvla-{self.size}"

    @property
    def table(self) -> dict[str, Any]:
        return SMOLVLM_SIZES[self.size]

    @property
    def image_size(self) -> int:
        return int(self.table["vision"]["image_size"])

    @property
    def image_tokens(self) -> int:
        """Tokens one camera image gives after the connector's pixel shuffle."""
        v = self.table["vision"]
        return (v["image_size"] // v["patch_size"]) ** 2 // self.table["scale_factor"] ** 2

    @property
    def num_vlm_layers(self) -> int:
        return int(self.table["num_vlm_layers"])

    @property
    def expert_width(self) -> int:
        """LeRobot's ``int(hidden_size * expert_width_multiplier)``."""
        return int(self.table["text"]["hidden_size"] * self.table["expert_width_multiplier"])


def build_smolvlm_config(cfg: SmolVLABaseConfig, vocab: int) -> SmolVLMConfig:
    """transformers' SmolVLM config of ``cfg`` (every text layer: LeRobot truncates after
    building). ``vocab``: the tokenizer's size, used where the table leaves it 0 (tiny)."""
    t = dict(cfg.table["text"])
    t["vocab_size"] = t["vocab_size"] or vocab
    if t["vocab_size"] < vocab:
        raise InvalidSpec(f"SmolVLM {cfg.size}: vocabulary {t['vocab_size']} < the tokenizer's {vocab}")
    text: dict[str, Any] = dict(t, model_type="llama", hidden_act="silu", tie_word_embeddings=False)
    # The image token id is never read: images go through the vision tower and connector
    # directly and are laid before the text, as LeRobot's ``embed_prefix`` does (no ``forward``
    # of the whole SmolVLM, which would look for it among the ids).
    return SmolVLMConfig(text_config=text, vision_config=dict(cfg.table["vision"]),
                         scale_factor=cfg.table["scale_factor"], image_token_id=t["vocab_size"] - 1,
                         vocab_size=t["vocab_size"], tie_word_embeddings=False)


def cache_geometry(feature_dim: int, kv_layers: int) -> dict[str, Any]:
    """The attention layout of the SmolVLA base whose prefix cache is ``feature_dim`` wide over
    ``kv_layers`` layers: query heads, key/value heads, head size, self-attention period and
    norm epsilon (what a ``smolvla_expert`` needs to attend to it)."""
    for s in SMOLVLM_SIZES.values():
        t = s["text"]
        if s["num_vlm_layers"] == kv_layers and kv_layers * 2 * t["num_key_value_heads"] * t["head_dim"] == feature_dim:
            return dict(heads=t["num_attention_heads"], kv_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                        every_n=s["self_attn_every_n_layers"], eps=float(t["rms_norm_eps"]))
    raise InvalidSpec(
        f"smolvla_expert: feature_dim={feature_dim} over kv_layers={kv_layers} is no SmolVLA base's cache "
        f"(sizes {sorted(SMOLVLM_SIZES)}); build the head from the base's describe()"
    )
