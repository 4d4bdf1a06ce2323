"""How a π0.5 base (OpenPI's PaliGemma, as LeRobot's ``pi05`` builds it) is configured
here: ``Pi05BaseConfig``, the Gemma variants, and the transformers configs made from them.

LeRobot's ``PaliGemmaWithExpertModel`` hard-codes a SigLIP-so400m vision tower and
PaliGemma's 257k vocabulary and reads its tokenizer from a hub; here every size is a
table entry the project writes (``tiny`` for tests; ``gemma_300m``/``gemma_2b``, the
variant names LeRobot's ``paligemma_variant`` takes, at their real sizes with the
so400m tower) and the tokenizer is the project's own (``agents.models.tokenizer``),
so nothing is downloaded. The attention layout LeRobot's code assumes is kept: 8 query
heads and 1 key/value head per layer, the expert as deep as the base, and one head
size for both (the expert attends to the base's per-layer keys and values).

See docs/ARCHITECTURE.md, "Model families: the π0.5 base".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PaliGemmaConfig, PreTrainedTokenizerFast

from joynexus.agents.models.tokenizer import PAD_TOKEN
from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "GEMMA_VARIANTS",
    "MAX_ACTION_DIM",
    "PI05_DTYPES",
    "VISION_TOWERS",
    "Pi05BaseConfig",
    "build_paligemma_config",
    "expert_geometry",
]

#: Gemma widths as OpenPI's ``gemma.get_config`` (``gemma_300m``, ``gemma_2b``) plus
#: ``tiny`` for tests. LeRobot's attention code reshapes to 8 heads: every variant keeps 8.
GEMMA_VARIANTS: dict[str, dict[str, int]] = {
    "tiny": dict(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8),
    "tiny_expert": dict(width=32, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8),
    "gemma_300m": dict(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
    "gemma_2b": dict(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256),
}
#: The SigLIP tower of each base variant: so400m (what LeRobot builds) at real sizes.
VISION_TOWERS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14),
    "so400m": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                   patch_size=14),
}
#: The expert each base variant pairs with (LeRobot: ``action_expert_variant="gemma_300m"``).
EXPERT_OF = {"tiny": "tiny_expert", "gemma_300m": "gemma_300m", "gemma_2b": "gemma_300m"}
#: Actions are padded to this width inside the expert, as LeRobot's ``max_action_dim``.
MAX_ACTION_DIM = 32
PI05_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Pi05BaseConfig:
    """How to build the resident π0.5 base. Validates itself.

    ``paligemma_variant``: ``tiny`` (tests), ``gemma_300m`` or ``gemma_2b``.
    ``image_size``: side of the square image SigLIP sees (a multiple of 14; LeRobot 224).
    ``max_state_dim``: the state is padded to this many values and each is discretised
    into 256 bins in the prompt (π0.5's ``State: ...``); a longer state is refused.
    ``max_text_tokens``: the instruction's tokens kept (the prompt around it is fixed).
    """

    paligemma_variant: Literal["tiny", "gemma_300m", "gemma_2b"] = "tiny"
    image_size: int = 56
    max_state_dim: int = 32
    max_text_tokens: int = 48
    tokenizer: Literal["bpe", "bytes"] = "bpe"
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.paligemma_variant not in EXPERT_OF:
            raise InvalidSpec(
                f"Pi05BaseConfig.paligemma_variant={self.paligemma_variant!r}: choose one of {sorted(EXPERT_OF)}"
            )
        if not isinstance(self.image_size, int) or self.image_size < 14 or self.image_size % 14:
            raise InvalidSpec(f"Pi05BaseConfig.image_size={self.image_size!r}: a multiple of 14 (SigLIP's patch), >= 14")
        for name in ("max_state_dim", "max_text_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 1 <= v <= 256:
                raise InvalidSpec(f"Pi05BaseConfig.{name}={v!r}: an integer in [1, 256]")
        if self.tokenizer not in ("bpe", "bytes"):
            raise InvalidSpec(f"Pi05BaseConfig.tokenizer={self.tokenizer!r}: choose 'bpe' or 'bytes'")
        if self.dtype not in PI05_DTYPES:
            raise InvalidSpec(f"Pi05BaseConfig.dtype={self.dtype!r}: choose one of {sorted(PI05_DTYPES)}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InvalidSpec(f"Pi05BaseConfig.threads={self.threads!r}: an integer >= 1 or None")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise InvalidSpec(f"Pi05BaseConfig.device={self.device!r}: not a torch device ({e})") from e

    @property
    def base_model(self) -> str:
        return f"pi05-{self.paligemma_variant}"

    @property
    def gemma(self) -> dict[str, int]:
        return GEMMA_VARIANTS[self.paligemma_variant]

    @property
    def expert_variant(self) -> str:
        return EXPERT_OF[self.paligemma_variant]

    @property
    def vision(self) -> dict[str, int]:
        return VISION_TOWERS["tiny" if self.paligemma_variant == "tiny" else "so400m"]

    @property
    def image_tokens(self) -> int:
        """Tokens SigLIP gives per camera image."""
        return (self.image_size // self.vision["patch_size"]) ** 2


def expert_geometry(variant: str) -> dict[str, int]:
    """The expert's sizes (``GEMMA_VARIANTS`` entry), checked to attend to a base's cache."""
    if variant not in GEMMA_VARIANTS:
        raise InvalidSpec(f"expert variant {variant!r}: choose one of {sorted(GEMMA_VARIANTS)}")
    return dict(GEMMA_VARIANTS[variant])


def build_paligemma_config(cfg: Pi05BaseConfig, tokenizer: PreTrainedTokenizerFast) -> PaliGemmaConfig:
    """transformers' PaliGemma config of ``cfg``: the Gemma variant as the text model (GELU-tanh
    MLP, as LeRobot sets it), the SigLIP tower, the project's tokenizer's vocabulary."""
    g = cfg.gemma
    vocab = len(tokenizer)
    pad = int(tokenizer.convert_tokens_to_ids(PAD_TOKEN))  # type: ignore[arg-type]
    text: dict[str, Any] = dict(
        hidden_size=g["width"], intermediate_size=g["mlp_dim"], num_hidden_layers=g["depth"],
        num_attention_heads=g["num_heads"], num_key_value_heads=g["num_kv_heads"], head_dim=g["head_dim"],
        vocab_size=vocab, hidden_activation="gelu_pytorch_tanh", pad_token_id=pad,
        max_position_embeddings=8192,
    )
    vision: dict[str, Any] = dict(cfg.vision, image_size=cfg.image_size, projection_dim=g["width"])
    # The image token is never in the ids: images are embedded and laid before the text,
    # as LeRobot's ``embed_prefix`` does. One past the vocabulary keeps it out of range.
    return PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=vocab,
                           vocab_size=vocab, projection_dim=g["width"], pad_token_id=pad)
