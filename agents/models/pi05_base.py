"""The π0.5 resident base: OpenPI's PaliGemma prefix (LeRobot ``pi05``), frozen and shared.

One forward over a group's rows (every tenant's) computes the prefix as LeRobot's
``PI05Pytorch.embed_prefix`` lays it out (each camera's SigLIP tokens, then the
prompt ``Task: <instruction>, State: <256-bin state>;\\nAction: `` embedded and scaled
by sqrt(width)), runs the Gemma layers with bidirectional attention over each row's
real tokens (positions ``cumsum(real) - 1``), and returns each layer's keys (after
RoPE) and values: the cache an action expert attends to (``heads/pi05``). The last
layer's attention output and MLP are skipped: nothing reads them.

The cache leaves as ``TokenFeatures`` whose "hidden states" are the per-token keys
and values of every layer, ``[B, L, layers * 2 * kv_heads * head_dim]`` (``kv_layout``),
so the grouped split and packing of ``features`` apply unchanged; ``pooled_B_D`` is
their mean over real tokens (what a pooled head would read of this base).

The state in the prompt is each tenant's: its head maps the raw state into [-1, 1]
(``prefix_state``) before the shared forward, as LeRobot's normaliser does before its
tokenizer step. See docs/ARCHITECTURE.md, "Model families: the π0.5 base".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PaliGemmaForConditionalGeneration, PreTrainedTokenizerFast

from joynexus.agents.models.backbone_inputs import TokenCache, right_pad
from joynexus.agents.models.features import FeatureBatch, SharedBatch, TokenFeatures
from joynexus.agents.models.pi05_config import PI05_DTYPES, Pi05BaseConfig, build_paligemma_config
from joynexus.agents.models.prefix import cache_features, camera_images, prefix_rows
from joynexus.agents.models.seeding import seeded
from joynexus.agents.models.tokenizer import PAD_TOKEN, build_tokenizer, train_tokenizer
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = [
    "MASK_VALUE", "Pi05Base", "Pi05Inputs", "Pi05Prompt", "apply_rope", "cache_bytes", "discretize_state", "rope_cos_sin",
]

#: The additive attention mask value of OpenPI (``OPENPI_ATTENTION_MASK_VALUE``).
MASK_VALUE = -2.3819763e38
ROPE_THETA = 10_000.0


def discretize_state(state_B_S: np.ndarray) -> np.ndarray:
    """π0.5's state tokens: values in [-1, 1] into 256 bins (OpenPI's ``PaligemmaTokenizer``)."""
    return np.digitize(state_B_S, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1


def rope_cos_sin(pos_B_L: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's rotary tables ``[B, 1, L, head_dim]`` for integer positions (theta 10000)."""
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    ang = pos_B_L.float()[..., None] * inv.to(pos_B_L.device)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x_B_H_L_D: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_B_H_L_D.shape[-1] // 2
    rot = torch.cat((-x_B_H_L_D[..., half:], x_B_H_L_D[..., :half]), dim=-1)
    return x_B_H_L_D * cos + rot * sin


@dataclass(frozen=True)
class Pi05Inputs:
    """A prepared prefix: images in [-1, 1] per camera ``[K, B, 3, S, S]``, right-padded
    prompt ids ``[B, T]`` and their real lengths ``[B]``."""

    pixels_K_B_C_S_S: torch.Tensor
    ids_B_T: torch.Tensor
    lengths_B: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.ids_B_T.shape[0])


class Pi05Prompt:
    """π0.5's prompt with the project's tokenizer (what OpenPI's ``PaligemmaTokenizer`` and
    LeRobot's ``Pi05PrepareStateTokenizerProcessorStep`` write), without a model."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, config: Pi05BaseConfig) -> None:
        self.config = config
        self.pad_id = int(tokenizer.convert_tokens_to_ids(PAD_TOKEN))  # type: ignore[arg-type]
        self._bos = int(tokenizer.convert_tokens_to_ids("<|im_start|>"))  # type: ignore[arg-type]
        enc = lambda texts: tokenizer(list(texts), add_special_tokens=False)["input_ids"]  # noqa: E731
        self._tok = TokenCache(enc, maxsize=4096)
        self._task, self._state, self._action = (enc([s])[0] for s in ("Task: ", ", State: ", ";\nAction: "))

    @property
    def max_tokens(self) -> int:
        """An upper bound on a prompt's tokens: the fixed parts, the instruction's cut, and at
        most 4 bytes (so 4 byte-level tokens) per state value ("255 ")."""
        fixed = 1 + len(self._task) + len(self._state) + len(self._action)
        return fixed + self.config.max_text_tokens + 4 * self.config.max_state_dim

    def tokenize(self, instructions: Sequence[str], prefix_state_B_S: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """π0.5 prompts (right-padded ids, real lengths): ``<bos>Task: <text>, State: <bins>;\\nAction: ``."""
        st = np.asarray(prefix_state_B_S, dtype=np.float32)
        b = len(instructions)
        if st.ndim != 2 or st.shape[0] != b:
            raise ShapeMismatch(f"prefix state must be [B={b}, S], got {list(st.shape)}")
        if st.shape[1] > self.config.max_state_dim:
            raise ShapeMismatch(
                f"state has {st.shape[1]} values but this π0.5 base takes at most max_state_dim="
                f"{self.config.max_state_dim}; build the base with a larger max_state_dim"
            )
        if not np.isfinite(st).all():
            raise InvalidSpec("prefix state holds NaN/inf: send finite numbers only")
        st = np.pad(np.clip(st, -1.0, 1.0), ((0, 0), (0, self.config.max_state_dim - st.shape[1])))
        bins = discretize_state(st)
        cleaned = [t.strip().replace("_", " ").replace("\n", " ") for t in instructions]
        texts = self._tok(tuple(cleaned))
        states = self._tok(tuple(" ".join(map(str, row)) for row in bins))
        m = self.config.max_text_tokens
        rows = [[self._bos, *self._task, *t[:m], *self._state, *s, *self._action]
                for t, s in zip(texts, states, strict=True)]
        return right_pad(rows, self.pad_id)


class Pi05Base:
    """The frozen π0.5 PaliGemma shared by all tenants. Build with ``Pi05Base.build``."""

    family = "pi05"
    #: The prompt carries each row's state: callers attach it (``grouped.for_base``).
    reads_state = True

    def __init__(self, model: PaliGemmaForConditionalGeneration, tokenizer: PreTrainedTokenizerFast,
                 config: Pi05BaseConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = PI05_DTYPES[config.dtype]
        self.model.to(device=self.device, dtype=self.dtype)  # type: ignore[call-arg]
        self.model.eval()
        self.model.requires_grad_(False)
        self.lm = model.model.language_model
        self.prompt = Pi05Prompt(tokenizer, config)
        self._pad = self.prompt.pad_id

    @classmethod
    def build(cls, config: Pi05BaseConfig | None = None) -> Pi05Base:
        """Random weights of ``config.paligemma_variant`` (nothing read from a hub)."""
        config = config or Pi05BaseConfig()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        tokenizer = train_tokenizer() if config.tokenizer == "bpe" else build_tokenizer()
        pcfg = build_paligemma_config(config, tokenizer)
        pcfg.text_config._attn_implementation = "eager"
        pcfg.vision_config._attn_implementation = "eager"
        with seeded(config.seed):
            model = PaliGemmaForConditionalGeneration(pcfg)
        return cls(model, tokenizer, config)

    # -- facts ------------------------------------------------------------
    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the cache."""
        g = self.config.gemma
        return g["depth"], g["num_kv_heads"], g["head_dim"]

    @property
    def feature_dim(self) -> int:
        """Width of a cache token: every layer's keys and values."""
        n, h, d = self.kv_layout
        return n * 2 * h * d

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def prefix_tokens(self, n_cameras: int, instruction: str = "pick up the cube", state_dim: int | None = None) -> int:
        """Prefix length of one sample: image tokens plus its prompt's tokens."""
        s = np.zeros((1, state_dim or self.config.max_state_dim), dtype=np.float32)
        return n_cameras * self.config.image_tokens + int(self.tokenize([instruction], s)[1][0])

    def max_prefix_tokens(self, n_cameras: int = 4) -> int:
        """An upper bound on one sample's prefix (a spec names at most 4 cameras)."""
        return n_cameras * self.config.image_tokens + self.prompt.max_tokens

    def kv_bytes_per_row(self, prefix_tokens: int) -> int:
        """Bytes of one row's cache as heads receive it (float32, plus its mask channel)."""
        return int(prefix_tokens) * (self.feature_dim + 1) * 4

    def describe(self, n_cameras: int = 1, state_dim: int | None = None) -> dict[str, Any]:
        tokens = self.prefix_tokens(n_cameras, state_dim=state_dim)
        n, h, d = self.kv_layout
        return {
            "family": self.family, "base_model": self.config.base_model,
            "paligemma_variant": self.config.paligemma_variant, "expert_variant": self.config.expert_variant,
            "params": {"base": self.num_params(), "vision": sum(p.numel() for p in self.model.model.vision_tower.parameters())},
            "kv_layers": n, "kv_heads": h, "head_dim": d, "feature_dim": self.feature_dim,
            "cameras": n_cameras, "image_size": self.config.image_size,
            "prefix_tokens_per_sample": tokens, "kv_bytes_per_row": self.kv_bytes_per_row(tokens),
        }

    # -- input preparation --------------------------------------------------
    def tokenize(self, instructions: Sequence[str], prefix_state_B_S: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The π0.5 prompts of a batch (``Pi05Prompt.tokenize``)."""
        return self.prompt.tokenize(instructions, prefix_state_B_S)

    def images(self, images: Mapping[str, torch.Tensor], camera_slots: Sequence[str]) -> torch.Tensor:
        """Each camera's images as SigLIP takes them: [-1, 1], ``image_size`` square ``[K, B, 3, S, S]``
        (LeRobot's ``_preprocess_images``, its resize-with-pad included)."""
        return camera_images(images, camera_slots, self.config.image_size, _resize_with_pad)

    def prepare(self, batch: FeatureBatch, prefix_state_B_S: torch.Tensor) -> Pi05Inputs:
        ids, lengths = self.tokenize(batch.instructions, prefix_state_B_S.detach().cpu().numpy())
        return Pi05Inputs(self.images(batch.images, batch.schema.camera_slots), ids, lengths)

    def encode_tokens(self, batch: FeatureBatch | SharedBatch, tokens: bool = True) -> TokenFeatures:
        """The resident-base interface (``Backbone.encode_tokens``): prepare and one frozen prefix
        forward. The batch must carry its rows' prompt state (``grouped.for_base`` attaches it)."""
        state, slots = prefix_rows(batch, "the π0.5 base reads each row's state in its prompt")
        ids, lengths = self.tokenize(batch.instructions, state.detach().cpu().numpy())
        feats = self.features(Pi05Inputs(self.images(batch.images, slots), ids, lengths))
        return feats if tokens else TokenFeatures(feats.pooled_B_D)

    def concat_inputs(self, parts: Sequence[Pi05Inputs]) -> Pi05Inputs:
        """Rows of several prepared prefixes end to end (same cameras), prompts re-padded."""
        if len(parts) == 1:
            return parts[0]
        if len({p.pixels_K_B_C_S_S.shape[0] for p in parts}) != 1:
            raise ShapeMismatch("π0.5 concat_inputs: parts have different camera counts; group only compatible batches")
        t = max(int(p.ids_B_T.shape[1]) for p in parts)
        ids = [F.pad(p.ids_B_T, (0, t - p.ids_B_T.shape[1]), value=self._pad) for p in parts]
        return Pi05Inputs(torch.cat([p.pixels_K_B_C_S_S for p in parts], 1), torch.cat(ids, 0),
                          torch.cat([p.lengths_B for p in parts], 0))

    # -- the forward ------------------------------------------------------------
    def embed_prefix(self, inputs: Pi05Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings ``[B, L, W]``, real-token mask ``[B, L]``): images then the scaled prompt."""
        dev = self.device
        k, b = inputs.pixels_K_B_C_S_S.shape[:2]
        px = inputs.pixels_K_B_C_S_S.to(dev, self.dtype).flatten(0, 1)
        img = self.model.model.get_image_features(px)  # [K*B, T, W]
        img_B_KT_W = img.view(k, b, img.shape[1], img.shape[2]).transpose(0, 1).reshape(b, -1, img.shape[2])
        ids = inputs.ids_B_T.to(dev)
        lang = self.lm.embed_tokens(ids)
        lang = lang * math.sqrt(lang.shape[-1])
        real_T = torch.arange(ids.shape[1], device=dev)[None, :] < inputs.lengths_B.to(dev)[:, None]
        real = torch.cat([torch.ones(b, img_B_KT_W.shape[1], dtype=torch.bool, device=dev), real_T], 1)
        return torch.cat([img_B_KT_W.to(lang.dtype), lang], 1), real

    def prefix_kv(self, inputs: Pi05Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's keys and values over the prefix, ``[B, L, layers * 2 * kv_heads * head_dim]``
        (layer-major, keys then values), and the real-token mask ``[B, L]``."""
        x, real = self.embed_prefix(inputs)
        b, L, _ = x.shape
        pos = torch.cumsum(real.long(), 1) - 1
        mask = torch.where(real[:, None, None, :] & real[:, None, :, None], 0.0, MASK_VALUE).to(x.dtype)
        n, kvh, hd = self.kv_layout
        cos, sin = rope_cos_sin(pos, hd)
        kv: list[torch.Tensor] = []
        for i, layer in enumerate(self.lm.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            k = apply_rope(att.k_proj(h).view(b, L, kvh, hd).transpose(1, 2), cos, sin)
            v = att.v_proj(h).view(b, L, kvh, hd).transpose(1, 2)
            kv += [k.transpose(1, 2).reshape(b, L, kvh * hd), v.transpose(1, 2).reshape(b, L, kvh * hd)]
            if i == n - 1:
                break  # the last layer's output is never read: only its keys and values
            q = apply_rope(att.q_proj(h).view(b, L, -1, hd).transpose(1, 2), cos, sin)
            rep = q.shape[1] // kvh
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               attn_mask=mask, scale=att.scaling)
            x = x + att.o_proj(o.transpose(1, 2).reshape(b, L, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return torch.cat(kv, -1), real

    def features(self, inputs: Pi05Inputs) -> TokenFeatures:
        """One frozen prefix forward -> ``TokenFeatures`` of the cache (see the module's doc)."""
        with torch.inference_mode():
            kv_B_L_C, real_B_L = self.prefix_kv(inputs)
        return cache_features(kv_B_L_C, real_B_L)


def cache_bytes(feats: TokenFeatures) -> int:
    """Bytes of a part's cache as its head receives it (float32 keys, values and mask)."""
    if feats.h_B_L_D is None:
        return 0
    b, L, c = feats.h_B_L_D.shape
    return int(b * L * (c + 1) * 4)


def _resize_with_pad(img_B_C_H_W: torch.Tensor, side: int) -> torch.Tensor:
    """LeRobot's ``resize_with_pad_torch`` for float images in [0, 1], quirk kept: the pad
    value is -1 before the [-1, 1] mapping, as LeRobot's ``_preprocess_images`` pads."""
    h, w = img_B_C_H_W.shape[-2:]
    ratio = max(w / side, h / side)
    rh, rw = int(h / ratio), int(w / ratio)
    out = F.interpolate(img_B_C_H_W, size=(rh, rw), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
    ph, pw = side - rh, side - rw
    return F.pad(out, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=-1.0)
