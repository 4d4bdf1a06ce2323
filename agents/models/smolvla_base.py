"""The SmolVLA resident base: SmolVLM's first layers (LeRobot ``smolvla``), frozen and shared.

One forward over a group's rows (every tenant's) computes the prefix as LeRobot's
``VLAFlowMatching.embed_prefix`` does (each camera's SigLIP tokens after the pixel-shuffle
connector, scaled by sqrt(width); the instruction with a trailing newline, embedded and
scaled by sqrt(width); the state as one token, ``state_proj`` of the state padded to
``max_state_dim``), runs the kept Llama layers as LeRobot's ``SmolVLMWithExpertModel``
does when it fills its cache (its RoPE, eager attention in float32: images and text attend
to each other but not to the state token, which attends to all; positions ``cumsum(real) - 1``)
and returns each layer's keys (after RoPE) and values: the cache a ``smolvla_expert`` reads
(``heads/smolvla``). The last layer's attention output and MLP are skipped: nothing reads them.

The state token is laid right after each row's real text tokens (LeRobot lays it after the
text's padding): the real tokens are then a prefix of each row, as the grouped split needs,
and nothing changes for any real token (same positions, same masks; an expert's attention
over the cache does not depend on the order of its keys). The cache leaves as
``TokenFeatures`` of width ``layers * 2 * kv_heads * head_dim`` (layer-major, keys then
values), as the π0.5 base's does. The state in the prefix is each tenant's, normalised by
its head (``SmolVLAExpertHead.prefix_state``, LeRobot's mean/std normaliser) before the
shared forward; ``state_proj`` belongs to the base (frozen, as the VLM).

See docs/ARCHITECTURE.md, "Model families: the SmolVLA base".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerFast, SmolVLMModel

from joynexus.agents.models.backbone_inputs import TokenCache, right_pad
from joynexus.agents.models.features import FeatureBatch, SharedBatch, TokenFeatures
from joynexus.agents.models.prefix import cache_features, camera_images, prefix_rows
from joynexus.agents.models.seeding import seeded
from joynexus.agents.models.smolvla_config import (
    SMOLVLA_DTYPES,
    SmolVLABaseConfig,
    build_smolvlm_config,
)
from joynexus.agents.models.tokenizer import PAD_TOKEN, train_tokenizer
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = ["SmolVLABase", "SmolVLAInputs", "eager_attention", "smolvla_rope"]


def smolvla_rope(x_B_L_H_D: torch.Tensor, pos_B_L: torch.Tensor, max_wavelength: float = 10_000.0) -> torch.Tensor:
    """LeRobot's SmolVLA ``apply_rope`` (float32, wavelength 10000 whatever the VLM's config says)."""
    d_half = x_B_L_H_D.shape[-1] // 2
    dtype = x_B_L_H_D.dtype
    x = x_B_L_H_D.to(torch.float32)
    freq = (2.0 / x.shape[-1]) * torch.arange(d_half, dtype=torch.float32, device=x.device)
    radians = pos_B_L[..., None].to(torch.float32) / (max_wavelength**freq)[None, None, :]
    sin, cos = torch.sin(radians[..., None, :]), torch.cos(radians[..., None, :])
    x1, x2 = x.split(d_half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def eager_attention(q_B_L_H_D: torch.Tensor, k_B_S_K_D: torch.Tensor, v_B_S_K_D: torch.Tensor,
                    keep_B_L_S: torch.Tensor) -> torch.Tensor:
    """LeRobot's ``eager_attention_forward``: grouped heads, scores in float32 scaled by
    head_dim ** -0.5, masked with float32's min; ``[B, L, H * D]``."""
    b, L, h, d = q_B_L_H_D.shape
    rep = h // k_B_S_K_D.shape[2]
    k = k_B_S_K_D.repeat_interleave(rep, 2).to(torch.float32).transpose(1, 2)
    v = v_B_S_K_D.repeat_interleave(rep, 2).transpose(1, 2)
    att = torch.matmul(q_B_L_H_D.to(torch.float32).transpose(1, 2), k.transpose(2, 3)) * d**-0.5
    att = torch.where(keep_B_L_S[:, None], att, torch.finfo(torch.float32).min)
    probs = torch.softmax(att, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(b, L, h * d)


@dataclass(frozen=True)
class SmolVLAInputs:
    """A prepared prefix: images in [-1, 1] per camera ``[K, B, 3, S, S]``, right-padded
    instruction ids ``[B, T]``, their real lengths ``[B]`` and the normalised state padded to
    ``max_state_dim`` ``[B, max_state_dim]``."""

    pixels_K_B_C_S_S: torch.Tensor
    ids_B_T: torch.Tensor
    lengths_B: torch.Tensor
    state_B_S: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.ids_B_T.shape[0])


class SmolVLABase:
    """The frozen SmolVLA VLM shared by all tenants. Build with ``SmolVLABase.build``."""

    family = "smolvla"
    #: The prefix carries each row's state: callers attach it (``grouped.for_base``).
    reads_state = True

    def __init__(self, model: SmolVLMModel, state_proj: nn.Linear, tokenizer: PreTrainedTokenizerFast,
                 config: SmolVLABaseConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = SMOLVLA_DTYPES[config.dtype]
        # LeRobot keeps the first ``num_vlm_layers`` text layers (and drops the rest).
        model.text_model.layers = model.text_model.layers[: config.num_vlm_layers]
        self.model = model
        self.state_proj = state_proj
        for m in (self.model, self.state_proj):
            m.to(device=self.device, dtype=self.dtype)  # type: ignore[call-arg]
            m.eval()
            m.requires_grad_(False)
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.convert_tokens_to_ids(PAD_TOKEN))  # type: ignore[arg-type]
        self._tok = TokenCache(lambda texts: tokenizer(list(texts), add_special_tokens=False)["input_ids"],
                               maxsize=4096)

    @classmethod
    def build(cls, config: SmolVLABaseConfig | None = None) -> SmolVLABase:
        """Random weights of ``config.size`` (nothing read from a hub)."""
        config = config or SmolVLABaseConfig()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        tokenizer = train_tokenizer()
        scfg = build_smolvlm_config(config, len(tokenizer))
        scfg.text_config._attn_implementation = "eager"
        scfg.vision_config._attn_implementation = "eager"
        with seeded(config.seed):
            model = SmolVLMModel(scfg)
            state_proj = nn.Linear(config.max_state_dim, scfg.text_config.hidden_size)
        return cls(model, state_proj, tokenizer, config)

    # -- facts ------------------------------------------------------------
    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the cache."""
        t = self.config.table["text"]
        return self.config.num_vlm_layers, int(t["num_key_value_heads"]), int(t["head_dim"])

    @property
    def feature_dim(self) -> int:
        """Width of a cache token: every layer's keys and values."""
        n, h, d = self.kv_layout
        return n * 2 * h * d

    def num_params(self) -> int:
        return sum(p.numel() for m in (self.model, self.state_proj) for p in m.parameters())

    def prefix_tokens(self, n_cameras: int, instruction: str = "pick up the cube") -> int:
        """Prefix length of one sample: image tokens, the instruction's tokens, the state token."""
        return n_cameras * self.config.image_tokens + int(self.tokenize([instruction])[1][0]) + 1

    def max_prefix_tokens(self, n_cameras: int = 4) -> int:
        """An upper bound on one sample's prefix (a spec names at most 4 cameras)."""
        return n_cameras * self.config.image_tokens + self.config.max_text_tokens + 1

    def kv_bytes_per_row(self, prefix_tokens: int) -> int:
        """Bytes of one row's cache as heads receive it (float32, plus its mask channel)."""
        return int(prefix_tokens) * (self.feature_dim + 1) * 4

    def describe(self, n_cameras: int = 1) -> dict[str, Any]:
        tokens = self.prefix_tokens(n_cameras)
        n, h, d = self.kv_layout
        return {
            "family": self.family, "base_model": self.config.base_model, "size": self.config.size,
            "params": {"base": self.num_params(), "vision": sum(p.numel() for p in self.model.vision_model.parameters())},
            "kv_layers": n, "kv_heads": h, "head_dim": d, "feature_dim": self.feature_dim,
            "expert_width": self.config.expert_width, "cameras": n_cameras, "image_size": self.config.image_size,
            "prefix_tokens_per_sample": tokens, "kv_bytes_per_row": self.kv_bytes_per_row(tokens),
        }

    # -- input preparation --------------------------------------------------
    def tokenize(self, instructions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and real lengths of ``<instruction>\\n`` (LeRobot's newline step),
        cut to ``max_text_tokens`` (its ``tokenizer_max_length``)."""
        texts = self._tok(tuple(t.strip().replace("\n", " ") + "\n" for t in instructions))
        rows = [list(t[: self.config.max_text_tokens]) or [self.pad_id] for t in texts]
        return right_pad(rows, self.pad_id)

    def images(self, images: Mapping[str, torch.Tensor], camera_slots: Sequence[str]) -> torch.Tensor:
        """Each camera's images as SigLIP takes them: [-1, 1], ``image_size`` square ``[K, B, 3, S, S]``
        (LeRobot's ``prepare_images``: resized keeping the aspect, padded with 0 at the left and top)."""
        return camera_images(images, camera_slots, self.config.image_size, _resize_with_pad)

    def state(self, prefix_state_B_S: torch.Tensor) -> torch.Tensor:
        """The normalised state padded to ``max_state_dim`` (LeRobot's ``prepare_state``)."""
        st = prefix_state_B_S.detach().to(torch.float32).cpu()
        if st.ndim != 2 or st.shape[1] > self.config.max_state_dim:
            raise ShapeMismatch(
                f"state {list(st.shape)}: this SmolVLA base takes [B, <= max_state_dim="
                f"{self.config.max_state_dim}]; build the base with a larger max_state_dim"
            )
        if not bool(torch.isfinite(st).all()):
            raise InvalidSpec("prefix state holds NaN/inf: send finite numbers only")
        return F.pad(st, (0, self.config.max_state_dim - st.shape[1]))

    def prepare(self, batch: FeatureBatch, prefix_state_B_S: torch.Tensor) -> SmolVLAInputs:
        ids, lengths = self.tokenize(batch.instructions)
        return SmolVLAInputs(self.images(batch.images, batch.schema.camera_slots), ids, lengths,
                             self.state(prefix_state_B_S))

    def encode_tokens(self, batch: FeatureBatch | SharedBatch, tokens: bool = True) -> TokenFeatures:
        """The resident-base interface (``Backbone.encode_tokens``): prepare and one frozen prefix
        forward. The batch must carry its rows' prefix state (``grouped.for_base`` attaches it)."""
        state, slots = prefix_rows(batch, "the SmolVLA base reads each row's state in its prefix")
        ids, lengths = self.tokenize(batch.instructions)
        feats = self.features(SmolVLAInputs(self.images(batch.images, slots), ids, lengths, self.state(state)))
        return feats if tokens else TokenFeatures(feats.pooled_B_D)

    # -- the forward ------------------------------------------------------------
    def embed_prefix(self, inputs: SmolVLAInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(embeddings ``[B, L, W]``, real-token mask ``[B, L]``, state-token mask ``[B, L]``):
        images, then each row's real text tokens, its state token, its text's padding."""
        dev, vm = self.device, self.model
        k, b = inputs.pixels_K_B_C_S_S.shape[:2]
        px = inputs.pixels_K_B_C_S_S.to(dev, self.dtype).flatten(0, 1)
        img = vm.connector(vm.vision_model(pixel_values=px).last_hidden_state)  # [K*B, T, W]
        img = img * torch.tensor(img.shape[-1] ** 0.5, dtype=img.dtype, device=dev)
        img_B_KT_W = img.view(k, b, img.shape[1], img.shape[2]).transpose(0, 1).reshape(b, -1, img.shape[2])
        ids = inputs.ids_B_T.to(dev)
        lang = vm.text_model.get_input_embeddings()(ids)
        lang = lang * math.sqrt(lang.shape[-1])
        st = self.state_proj(inputs.state_B_S.to(dev, self.dtype))[:, None, :]
        t = ids.shape[1]
        lengths = inputs.lengths_B.to(dev)[:, None]
        j = torch.arange(t + 1, device=dev)[None, :]
        perm = torch.where(j < lengths, j, torch.where(j == lengths, t, j - 1))  # real text, state, pads
        seq = torch.cat([lang, st.to(lang.dtype)], 1).gather(1, perm[..., None].expand(-1, -1, lang.shape[-1]))
        n_img = img_B_KT_W.shape[1]
        ones = torch.ones(b, n_img, dtype=torch.bool, device=dev)
        real = torch.cat([ones, j <= lengths], 1)
        is_state = torch.cat([~ones, j == lengths], 1)
        return torch.cat([img_B_KT_W.to(lang.dtype), seq], 1), real, is_state

    def prefix_kv(self, inputs: SmolVLAInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's keys and values over the prefix, ``[B, L, layers * 2 * kv_heads * head_dim]``
        (layer-major, keys then values), and the real-token mask ``[B, L]``."""
        x, real, is_state = self.embed_prefix(inputs)
        b, L, _ = x.shape
        pos = torch.cumsum(real.long(), 1) - 1
        # LeRobot's make_att_2d_masks: images and text (block 0) never see the state (block 1).
        blk = is_state.long()
        keep = (blk[:, None, :] <= blk[:, :, None]) & real[:, None, :] & real[:, :, None]
        n, kvh, hd = self.kv_layout
        kv: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.text_model.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            k = smolvla_rope(att.k_proj(h).view(b, L, kvh, hd), pos)
            v = att.v_proj(h).view(b, L, kvh, hd)
            kv += [k.reshape(b, L, kvh * hd), v.reshape(b, L, kvh * hd)]
            if i == n - 1:
                break  # the last layer's output is never read: only its keys and values
            q = smolvla_rope(att.q_proj(h).view(b, L, -1, hd), pos)
            o = eager_attention(q, k, v, keep)
            x = x + att.o_proj(o.to(att.o_proj.weight.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return torch.cat(kv, -1), real

    def features(self, inputs: SmolVLAInputs) -> TokenFeatures:
        """One frozen prefix forward -> ``TokenFeatures`` of the cache (see the module's doc)."""
        with torch.inference_mode():
            kv_B_L_C, real_B_L = self.prefix_kv(inputs)
        return cache_features(kv_B_L_C, real_B_L)


def _resize_with_pad(img_B_C_H_W: torch.Tensor, side: int) -> torch.Tensor:
    """LeRobot's SmolVLA ``resize_with_pad`` for float images in [0, 1]: the aspect kept, the
    pad (value 0) at the left and top."""
    h, w = img_B_C_H_W.shape[-2:]
    ratio = max(w / side, h / side)
    rh, rw = int(h / ratio), int(w / ratio)
    out = F.interpolate(img_B_C_H_W, size=(rh, rw), mode="bilinear", align_corners=False)
    return F.pad(out, (max(0, side - rw), 0, max(0, side - rh), 0), value=0.0)
