"""The resident base model: a frozen Qwen2.5-VL backbone shared by all tenants.

One ``Backbone`` per process (the transformers ``Qwen2_5_VLModel`` without an
LM head, a tokenizer, the Qwen2-VL image processor) is frozen: tenants only
read its features, so one forward can serve many tenants. It is built from a
config (``size="tiny"``/``"bench"``, random weights) or loaded from a local
directory with ``from_pretrained``; nothing is fetched from a hub.

Things to keep true: prompts are right-padded and attention is causal, so
padding never changes a real token's features; positions are the 3-D M-RoPE
ids from ``get_rope_index``, passed explicitly (never the 1-D fallback);
``feats_B_D`` is the mean of the last hidden states over real tokens.

How it is configured and built is ``backbone_config``, its tokenizer
``tokenizer``, and its inputs' preparation ``backbone_inputs``; this module is
the forward: ``prepare`` (tokenise, patchify), the batched vision tower, the
language model with explicit positions, pooling.

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLModel, Qwen2VLImageProcessor

from joynexus.agents.models.backbone_config import (
    DTYPES,
    META_FILE,
    BackboneConfig,
    build_image_processor,
    build_qwen_config,
    with_saved_settings,
)
from joynexus.agents.models.backbone_inputs import (
    BackboneInputs,
    TokenCache,
    channels,
    patchify,
    right_pad,
)
from joynexus.agents.models.features import FeatureBatch, SharedBatch, TokenFeatures
from joynexus.agents.models.seeding import seeded
from joynexus.agents.models.tokenizer import (
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_tokenizer,
    train_tokenizer,
)
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = ["Backbone"]


def _patch_embed(pe: Any, pixel_values_P_F: torch.Tensor) -> torch.Tensor:
    """``Qwen2_5_VisionPatchEmbed`` as the matrix product it is: its Conv3d's kernel is its
    stride and the whole patch (C x T x p x p), so each patch row meets the weight once.
    Same numbers (to float rounding, ~3e-6) in a third of the time on CPU (0.27 vs 0.82 ms
    for 16 samples x 2 cameras of the tiny backbone); the same weight, so training is unchanged."""
    proj = pe.proj
    if tuple(proj.kernel_size) != tuple(proj.stride) or proj.padding not in ((0, 0, 0), 0, "valid"):
        return pe(pixel_values_P_F)
    w = proj.weight
    x = pixel_values_P_F.reshape(-1, w[0].numel()).to(w.dtype)
    return torch.nn.functional.linear(x, w.reshape(w.shape[0], -1), proj.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Backbone:
    """The frozen, shared vision-language backbone. Build with ``Backbone.build``."""

    #: The base family (``agents.models.families``); its prompt carries no state.
    family = "qwen2_5_vl"
    reads_state = False

    def __init__(
        self,
        model: Qwen2_5_VLModel,
        tokenizer: PreTrainedTokenizerFast,
        image_processor: Qwen2VLImageProcessor,
        config: BackboneConfig,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.model.to(device=self.device, dtype=self.dtype)  # type: ignore[call-arg]
        self.model.eval()
        self.model.requires_grad_(False)
        missing = [s for s in SPECIAL_TOKENS if s not in tokenizer.get_vocab()]
        if missing:
            raise InvalidSpec(f"tokenizer lacks special tokens {missing}; save the backbone with this module's tokenizer")
        self._ids = {s: int(tokenizer.convert_tokens_to_ids(s)) for s in SPECIAL_TOKENS}  # type: ignore[arg-type]
        self.tokens_per_image = (config.image_size // 28) ** 2
        self._prefix_cache: dict[int, list[int]] = {}
        self._pos_cache: dict[tuple[int, int], torch.Tensor] = {}
        self._rot_cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        # Each distinct instruction is tokenised once (a rollout repeats it every step).
        self._token_cache = TokenCache(
            lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"], maxsize=4096
        )

    # -- construction ---------------------------------------------------
    @classmethod
    def build(cls, config: BackboneConfig | None = None) -> Backbone:
        """Build from config: random weights of ``config.size``, or ``from_pretrained(config.path)``."""
        config = config or BackboneConfig()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if config.path is not None:
            p = Path(config.path)
            config = with_saved_settings(config, p)
            model = Qwen2_5_VLModel.from_pretrained(p, local_files_only=True, attn_implementation="sdpa",
                                                    dtype=DTYPES[config.dtype])
            tokenizer = PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
            image_processor = build_image_processor(config.image_size)
        else:
            tokenizer = train_tokenizer() if config.tokenizer == "bpe" else build_tokenizer()
            image_processor = build_image_processor(config.image_size)
            qcfg = build_qwen_config(config.size, tokenizer)
            qcfg._attn_implementation = "sdpa"
            with seeded(config.seed):
                model = Qwen2_5_VLModel(qcfg)
        return cls(model, tokenizer, image_processor, config)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> Backbone:
        """Load a directory written by ``save`` (or any local Qwen2.5-VL checkpoint + tokenizer)."""
        p = Path(path)
        meta: dict[str, Any] = {}
        if (p / META_FILE).is_file():
            meta = json.loads((p / META_FILE).read_text())
        fields = set(BackboneConfig.__dataclass_fields__)
        meta = {k: v for k, v in meta.items() if k in fields}
        meta.update(overrides)
        meta["path"] = str(p)
        return cls.build(BackboneConfig(**meta))

    def save(self, path: str | Path) -> None:
        """save_pretrained for model, tokenizer and image processor, plus our settings."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(p)
        self.tokenizer.save_pretrained(p)
        self.image_processor.save_pretrained(p)
        meta = {k: v for k, v in asdict(self.config).items() if k not in ("path", "device", "threads")}
        (p / META_FILE).write_text(json.dumps(meta, indent=2))

    # -- facts ----------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    @property
    def feature_dim(self) -> int:
        return self.hidden_size

    @property
    def num_layers(self) -> int:
        return int(self.model.config.text_config.num_hidden_layers)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(self._ids)

    # -- input preparation (once per batch; pure CPU work) ----------------
    def _prefix(self, n_cameras: int) -> list[int]:
        if n_cameras not in self._prefix_cache:
            ids = self._ids
            cam = [ids["<|vision_start|>"], *([ids["<|image_pad|>"]] * self.tokens_per_image), ids["<|vision_end|>"]]
            self._prefix_cache[n_cameras] = [ids["<|im_start|>"], *(cam * n_cameras)]
        return self._prefix_cache[n_cameras]

    def tokenize(self, instructions: tuple[str, ...] | list[str], n_cameras: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt ids (right-padded) and real lengths for a batch of instructions."""
        text_ids = self._token_cache(instructions)
        prefix = self._prefix(n_cameras)
        end = self._ids["<|im_end|>"]
        rows = [prefix + t[: self.config.max_text_tokens] + [end] for t in text_ids]
        return right_pad(rows, self._ids[PAD_TOKEN])

    def process_images(self, images: dict[str, torch.Tensor] | Any, camera_slots: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the Qwen2-VL image processor over all images, sample-major then camera."""
        # numpy, single-threaded: torch's intra-op threads on a tensor this small cost
        # more than the copy (measured 15 ms for batch 4 on a loaded 2-core machine).
        per_slot = [np.asarray(images[s]) for s in camera_slots]
        b = int(per_slot[0].shape[0])
        c = int(per_slot[0].shape[1])
        if c == 1:
            per_slot = [np.broadcast_to(x, (x.shape[0], 3, *x.shape[2:])) for x in per_slot]
        stacked_B_K_C_H_W = np.stack(per_slot, axis=1)
        flat = stacked_B_K_C_H_W.reshape(b * len(camera_slots), *stacked_B_K_C_H_W.shape[2:])
        side = self.config.image_size
        ip = self.image_processor
        if flat.shape[-2:] == (side, side) and ip.do_rescale and ip.do_normalize:
            # Already at size: every image of the batch in one vectorised call (same numbers).
            return patchify(
                flat,
                patch_size=ip.patch_size,
                temporal_patch_size=ip.temporal_patch_size,
                merge_size=ip.merge_size,
                mean=channels(ip.image_mean),
                std=channels(ip.image_std),
                rescale=ip.rescale_factor,
            )
        same = flat.shape[-2:] == (side, side)
        out = self.image_processor(
            images=list(flat),
            do_resize=not same,
            input_data_format="channels_first",
            return_tensors="pt",
        )
        return out["pixel_values"], out["image_grid_thw"]

    def prepare(self, batch: FeatureBatch | SharedBatch) -> BackboneInputs:
        """Tokenize instructions and patchify images (no model call)."""
        slots = batch.schema.camera_slots if isinstance(batch, FeatureBatch) else batch.camera_slots
        ids, lengths = self.tokenize(batch.instructions, len(slots))
        pv, thw = self.process_images(dict(batch.images), slots)
        return BackboneInputs(ids, lengths, pv, thw, len(slots))

    def concat_inputs(self, parts: list[BackboneInputs]) -> BackboneInputs:
        """Join prepared inputs of compatible batches (rows in order) without re-processing."""
        if len(parts) == 1:
            return parts[0]
        k = parts[0].n_cameras
        if any(p.n_cameras != k for p in parts):
            raise ShapeMismatch("concat_inputs: parts have different camera counts; group only compatible batches")
        L = max(int(p.input_ids_B_L.shape[1]) for p in parts)
        pad_id = self._ids[PAD_TOKEN]
        ids = [
            torch.nn.functional.pad(p.input_ids_B_L, (0, L - p.input_ids_B_L.shape[1]), value=pad_id)
            if p.input_ids_B_L.shape[1] < L
            else p.input_ids_B_L
            for p in parts
        ]
        return BackboneInputs(
            torch.cat(ids, 0),
            torch.cat([p.lengths_B for p in parts], 0),
            torch.cat([p.pixel_values_P_F for p in parts], 0),
            torch.cat([p.image_grid_thw_N_3 for p in parts], 0),
            k,
        )

    # -- the forward ------------------------------------------------------
    def rope_positions(self, inputs: BackboneInputs) -> torch.Tensor:
        """3-D M-RoPE position ids ``[3, B, L]`` from the model's ``get_rope_index``.

        All rows share the prefix layout, so one row is computed and broadcast;
        right-padded tails just continue the text positions (never attended).
        """
        b, L = inputs.input_ids_B_L.shape
        key = (inputs.n_cameras, int(L))
        if key not in self._pos_cache:
            row_1_L = inputs.input_ids_B_L[:1]
            pos_3_1_L, _ = self.model.get_rope_index(row_1_L, inputs.image_grid_thw_N_3[: inputs.n_cameras])  # type: ignore[arg-type]
            self._pos_cache[key] = pos_3_1_L.to(self.device)
        return self._pos_cache[key].expand(3, b, L)

    def _fast_vision_ok(self, grid_thw_N_3: torch.Tensor) -> bool:
        """Batched vision path is exact when all images share one grid and no block
        uses windowed attention over more than one window per image."""
        vc = self.model.config.vision_config
        full = set(vc.fullatt_block_indexes) >= set(range(vc.depth))
        one_window = int(grid_thw_N_3[0, 1:].max()) * vc.patch_size <= vc.window_size
        return bool((grid_thw_N_3 == grid_thw_N_3[:1]).all()) and int(grid_thw_N_3[0, 0]) == 1 and (full or one_window)

    def _vision_embeds(
        self, pixel_values_P_F: torch.Tensor, grid_thw_N_3: torch.Tensor, grad: bool = False
    ) -> torch.Tensor:
        """The Qwen2.5-VL vision tower, batched over equal-size images.

        Same modules and weights as ``model.visual``, but attention runs as one
        ``[images, heads, patches, head_dim]`` call instead of a Python loop per
        image, and the rotary table is computed once per grid. Returns
        ``[images * tokens_per_image, text_hidden]`` in image order.
        """
        vis = self.model.visual
        if not self._fast_vision_ok(grid_thw_N_3):
            return vis(pixel_values_P_F, grid_thw=grid_thw_N_3)
        n = int(grid_thw_N_3.shape[0])
        key = tuple(int(v) for v in grid_thw_N_3[0])
        if key not in self._rot_cache:
            rot = vis.rot_pos_emb(grid_thw_N_3[:1]).to(self.device)
            emb = torch.cat([rot, rot], dim=-1).float()
            self._rot_cache[key] = (emb.cos(), emb.sin())
        cos_P_H, sin_P_H = self._rot_cache[key]
        if grad:  # cached under inference_mode: copies autograd may save
            cos_P_H, sin_P_H = cos_P_H.clone(), sin_P_H.clone()
        x_P_C = _patch_embed(vis.patch_embed, pixel_values_P_F)
        p1 = x_P_C.shape[0] // n
        c = x_P_C.shape[1]
        x_N_P_C = x_P_C.view(n, p1, c)
        for blk in vis.blocks:
            attn = blk.attn
            qkv = attn.qkv(blk.norm1(x_N_P_C)).view(n, p1, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)  # [N, heads, P, hd]
            q = (q.float() * cos_P_H + _rotate_half(q.float()) * sin_P_H).to(v.dtype)
            k = (k.float() * cos_P_H + _rotate_half(k.float()) * sin_P_H).to(v.dtype)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=attn.scaling)
            x_N_P_C = x_N_P_C + attn.proj(o.transpose(1, 2).reshape(n, p1, c))
            x_N_P_C = x_N_P_C + blk.mlp(blk.norm2(x_N_P_C))
        return vis.merger(x_N_P_C.reshape(n * p1, c))

    def hidden_states(self, inputs: BackboneInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The last hidden states ``[B, L, D]`` and the real-token mask ``[B, L]`` (bool).

        Runs the model's own modules: embeddings, vision tower (batched over
        images), image-token scatter, then the language model with explicit
        3-D M-RoPE positions. Gradients flow when the caller is outside
        ``inference_mode`` and the weights require grad (``ops/admin/pretrain_base``
        trains the base through this same path); ``forward`` wraps it frozen.
        """
        dev = self.device
        ids = inputs.input_ids_B_L.to(dev, non_blocking=True)
        grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        pos = self.rope_positions(inputs)
        if grad:
            pos = pos.clone()  # the cache may hold inference tensors
        embeds_B_L_D = self.model.get_input_embeddings()(ids)
        img_V_D = self._vision_embeds(
            inputs.pixel_values_P_F.to(dev, self.dtype, non_blocking=True), inputs.image_grid_thw_N_3.to(dev),
            grad=grad,
        )
        mask_B_L = ids == self._ids["<|image_pad|>"]
        if int(mask_B_L.sum()) != img_V_D.shape[0]:
            raise ShapeMismatch(
                f"{int(mask_B_L.sum())} image tokens but {img_V_D.shape[0]} image embeddings; "
                "prepare inputs with this backbone's prepare()"
            )
        embeds_B_L_D = embeds_B_L_D.masked_scatter(mask_B_L[..., None], img_V_D.to(embeds_B_L_D.dtype))
        out = self.model.language_model(
            inputs_embeds=embeds_B_L_D, position_ids=pos, use_cache=False, return_dict=True
        )
        h_B_L_D = out.last_hidden_state
        lengths = inputs.lengths_B.to(dev)
        real_B_L = torch.arange(h_B_L_D.shape[1], device=dev)[None, :] < lengths[:, None]
        return h_B_L_D, real_B_L

    @staticmethod
    def pool(h_B_L_D: torch.Tensor, real_B_L: torch.Tensor) -> torch.Tensor:
        """``feats_B_D`` float32: the mean of the hidden states over each row's real tokens."""
        summed_B_D = (h_B_L_D * real_B_L[..., None].to(h_B_L_D.dtype)).sum(1, dtype=torch.float32)
        return summed_B_D / real_B_L.sum(1, keepdim=True).to(torch.float32)

    def forward(self, inputs: BackboneInputs) -> torch.Tensor:
        """One frozen backbone forward over prepared inputs -> ``feats_B_D`` float32
        (mean of the last hidden states over real tokens; see ``hidden_states``)."""
        return self.features(inputs, tokens=False).pooled_B_D

    def features(self, inputs: BackboneInputs, tokens: bool = True) -> TokenFeatures:
        """One frozen forward -> ``TokenFeatures``: the pooled ``feats_B_D`` (the same
        numbers as ``forward``) and, if ``tokens``, the last hidden states and the
        real-token mask of that same forward (inference tensors; ``tokens()`` packs
        a copy heads may use in autograd)."""
        with torch.inference_mode():
            h_B_L_D, real_B_L = self.hidden_states(inputs)
            feats_B_D = self.pool(h_B_L_D, real_B_L)
        # Clone outside inference mode so heads may use the features in autograd.
        if not tokens:
            return TokenFeatures(feats_B_D.clone())
        return TokenFeatures(feats_B_D.clone(), h_B_L_D, real_B_L)

    def reference_forward(self, inputs: BackboneInputs) -> torch.Tensor:
        """The plain ``Qwen2_5_VLModel.forward`` path (per-image vision loop); for checking ``forward``."""
        dev = self.device
        with torch.inference_mode():
            out = self.model(
                input_ids=inputs.input_ids_B_L.to(dev),
                pixel_values=inputs.pixel_values_P_F.to(dev, self.dtype),
                image_grid_thw=inputs.image_grid_thw_N_3.to(dev),
                position_ids=self.rope_positions(inputs),
                use_cache=False,
                return_dict=True,
            )
            h_B_L_D = out.last_hidden_state
            lengths = inputs.lengths_B.to(dev)
            real_B_L = torch.arange(h_B_L_D.shape[1], device=dev)[None, :] < lengths[:, None]
            feats_B_D = (h_B_L_D * real_B_L[..., None].to(h_B_L_D.dtype)).sum(1, dtype=torch.float32)
            feats_B_D = feats_B_D / lengths[:, None].to(torch.float32)
        return feats_B_D.clone()

    def encode(self, batch: FeatureBatch | SharedBatch) -> torch.Tensor:
        """prepare + forward: ``feats_B_D`` for a canonical batch."""
        return self.forward(self.prepare(batch))

    def encode_tokens(self, batch: FeatureBatch | SharedBatch, tokens: bool = True) -> TokenFeatures:
        """prepare + features: ``TokenFeatures`` for a canonical batch."""
        return self.features(self.prepare(batch), tokens)
