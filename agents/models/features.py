"""Canonical VLA inputs, and the rules for sharing one backbone forward.

A tenant's request is canonicalised once at the edge into a ``FeatureBatch``
(uint8 images ``[B, C, H, W]`` per camera slot, instructions, state ``[B, S]``,
optional history ``[B, Hh, S]``); its ``FeatureSchema.signature()`` names a
policy's inputs on the wire. The sharing rule: batches of different tenants
go through ONE backbone forward when their ``backbone_key()`` matches (base,
camera slots in order, image channels and size); state, action dim and
horizon reach only the heads. Right padding under causal attention keeps a
sample's features independent of who shares its forward. Everything here is
pure: no model, no I/O (``wire_view`` never copies, nothing writes an input).

See docs/ARCHITECTURE.md, "Policies that learn" (``TokenFeatures``,
packed tokens) and "The Inference Queue" (where preparation is paid).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from joynexus.agents.featureschema import FeatureSchema
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = [
    "FeatureBatch",
    "FeatureSchema",
    "IncompatibleBatches",
    "SharedBatch",
    "TokenFeatures",
    "canonicalize_request",
    "check_compatible",
    "concat_batches",
    "pack_tokens",
    "pad_history",
    "split_rows",
    "unpack_tokens",
    "wire_view",
]


class IncompatibleBatches(InvalidSpec):
    """Batches that cannot share one backbone forward (wire code stays invalid_spec)."""


@dataclass(frozen=True)
class FeatureBatch:
    """One tenant's canonical batch. Tensors are on CPU; the backbone moves them."""

    schema: FeatureSchema
    images: Mapping[str, torch.Tensor]  # slot -> uint8 [B, C, H, W]
    instructions: tuple[str, ...]  # len B
    state_B_S: torch.Tensor  # float32
    history_B_H_S: torch.Tensor | None = None  # float32, H == schema.history_len
    #: The state as a base that reads it in its prompt takes it (π0.5: in [-1, 1], the
    #: tenant's head normalises it: ``ActionHead.prefix_state``); None for other bases.
    prefix_state_B_S: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.state_B_S.shape[0])


@dataclass(frozen=True)
class SharedBatch:
    """Several tenants' compatible batches laid end to end for one backbone forward."""

    backbone_key: str
    camera_slots: tuple[str, ...]
    images: Mapping[str, torch.Tensor]  # slot -> uint8 [N, C, H, W], N = sum of batch sizes
    instructions: tuple[str, ...]  # len N
    slices: tuple[slice, ...]  # rows of each input batch, in input order
    prefix_state_N_S: torch.Tensor | None = None  # each batch's ``prefix_state_B_S`` (all or none), zero-padded

    @property
    def batch_size(self) -> int:
        return len(self.instructions)


def wire_view(arr: np.ndarray) -> torch.Tensor:
    """A tensor over ``arr``'s memory, no copy, even when ``arr`` is a read-only view of
    wire bytes (``np.frombuffer``). Callers must not write to it; canonicalisation never does
    (a channels-last permute, a float conversion and the batch concat all make new tensors)."""
    global _readonly_warned
    arr = np.ascontiguousarray(arr)
    if arr.flags.writeable or _readonly_warned:
        return torch.from_numpy(arr)
    # torch warns once per process that it cannot mark the tensor read-only: that one
    # warning is swallowed here, and later calls skip catch_warnings (it costs more than
    # the view: it copies and resets the process's warning filters).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    _readonly_warned = True
    return t


_readonly_warned = False


def _as_tensor(x: Any, field: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        return wire_view(x)
    if isinstance(x, (list, tuple)):
        try:
            return torch.as_tensor(np.asarray(x))
        except (ValueError, TypeError) as e:
            raise InvalidSpec(f"{field}: cannot read as an array ({e}); send a rectangular numeric array") from e
    raise InvalidSpec(f"{field}: expected an array or tensor, got {type(x).__name__}")


def _check_finite(t: torch.Tensor, field: str) -> None:
    if not t.is_floating_point():
        return
    try:  # numpy on the tensor's memory: for a request's few floats a third of torch's
        # 15 us, 7 vs 24 us beside a busy forward thread (a torch op gives up the GIL)
        finite = bool(np.isfinite(t.numpy()).all())
    except (TypeError, RuntimeError):  # bfloat16, a tensor needing grad, not on the CPU
        finite = bool(torch.isfinite(t).all())
    if not finite:
        n_bad = int((~torch.isfinite(t)).sum())
        raise InvalidSpec(f"{field} contains {n_bad} NaN/inf value(s): send finite numbers only")


def _canon_image(x: Any, field: str, schema: FeatureSchema, batched: bool) -> torch.Tensor:
    img = _as_tensor(x, field)
    c = schema.channels
    h, w = schema.image_hw
    if not batched:
        img = img.unsqueeze(0)
    if img.ndim != 4:
        raise ShapeMismatch(f"{field}: expected [B, {c}, {h}, {w}] (or [B, {h}, {w}, {c}]), got {list(img.shape)}")
    if img.shape[1] != c and img.shape[-1] == c:
        img = img.permute(0, 3, 1, 2)  # channels-last -> channels-first
    if tuple(img.shape[1:]) != (c, h, w):
        raise ShapeMismatch(
            f"{field}: expected [B, {c}, {h}, {w}] per the schema, got {list(img.shape)}; "
            "resize the camera image or fix FeatureSchema.image_hw"
        )
    if img.dtype == torch.uint8:
        return img.contiguous()
    if img.is_floating_point():
        _check_finite(img, field)
        lo, hi = float(img.min()), float(img.max())
        if lo < 0.0 or hi > 1.0:
            raise InvalidSpec(
                f"{field}: float images must lie in [0, 1], got [{lo:.3g}, {hi:.3g}]; send uint8 0..255 instead"
            )
        return (img * 255.0).round().to(torch.uint8).contiguous()
    raise InvalidSpec(f"{field}: dtype {img.dtype} not supported; send uint8 (0..255) or float in [0, 1]")


def pad_history(history_B_H_S: torch.Tensor, history_len: int) -> torch.Tensor:
    """Left-pad (repeat the oldest frame) or keep the newest ``history_len`` frames."""
    h = history_B_H_S.shape[1]
    if h == history_len:
        return history_B_H_S
    if h > history_len:
        return history_B_H_S[:, h - history_len :]
    if h == 0:
        raise ShapeMismatch(f"history has 0 frames; send at least 1 (schema wants {history_len})")
    pad = history_B_H_S[:, :1].expand(-1, history_len - h, -1)
    return torch.cat([pad, history_B_H_S], dim=1)


def canonicalize_request(
    schema: FeatureSchema,
    images: Mapping[str, Any],
    instructions: str | Sequence[str],
    state: Any,
    history: Any | None = None,
) -> FeatureBatch:
    """Check and convert one request into a ``FeatureBatch``.

    ``state`` may be ``[B, S]`` or, for a single sample, ``[S]`` (then images may
    be unbatched ``[C, H, W]``/``[H, W, C]``). One instruction string is broadcast
    to the whole batch. Raises ``ShapeMismatch`` for wrong shapes and
    ``InvalidSpec`` for NaN/inf, wrong camera slots or bad dtypes, naming the field.
    """
    state_t = _as_tensor(state, "state")
    batched = state_t.ndim == 2
    if state_t.ndim == 1:
        state_t = state_t.unsqueeze(0)
    if state_t.ndim != 2 or state_t.shape[1] != schema.state_dim:
        raise ShapeMismatch(
            f"state: expected [B, {schema.state_dim}] (or [{schema.state_dim}] for one sample), "
            f"got {list(_as_tensor(state, 'state').shape)}"
        )
    if not state_t.is_floating_point():
        state_t = state_t.to(torch.float32)
    _check_finite(state_t, "state")
    state_t = state_t.to(torch.float32).contiguous()
    b = int(state_t.shape[0])
    if b < 1:
        raise ShapeMismatch("state: batch is empty; send at least one sample")

    missing = [s for s in schema.camera_slots if s not in images]
    extra = [s for s in images if s not in schema.camera_slots]
    if missing or extra:
        raise InvalidSpec(
            f"images: camera slots must be exactly {list(schema.camera_slots)}; "
            f"missing {missing}, unexpected {extra}"
        )
    imgs: dict[str, torch.Tensor] = {}
    for slot in schema.camera_slots:
        field = f"images[{slot!r}]"
        img = _canon_image(images[slot], field, schema, batched)
        if img.shape[0] != b:
            raise ShapeMismatch(f"{field}: batch size {img.shape[0]} but state has {b} rows")
        imgs[slot] = img

    if isinstance(instructions, str):
        instr = (instructions,) * b
    else:
        instr = tuple(instructions)
        if not all(isinstance(s, str) for s in instr):
            raise InvalidSpec("instructions: every instruction must be a str")
        if len(instr) != b:
            raise ShapeMismatch(f"instructions: {len(instr)} given but batch size is {b}; send one per sample or one str")

    hist: torch.Tensor | None = None
    if schema.history_len > 0:
        if history is None:
            hist = state_t.unsqueeze(1).expand(-1, schema.history_len, -1).contiguous()
        else:
            hist = _as_tensor(history, "history").to(torch.float32)
            if not batched and hist.ndim == 2:
                hist = hist.unsqueeze(0)
            if hist.ndim != 3 or hist.shape[0] != b or hist.shape[2] != schema.state_dim:
                raise ShapeMismatch(
                    f"history: expected [B={b}, frames, {schema.state_dim}], got {list(hist.shape)}"
                )
            _check_finite(hist, "history")
            hist = pad_history(hist, schema.history_len).contiguous()
    elif history is not None:
        raise InvalidSpec("history: schema.history_len is 0 so history is not accepted; drop it or raise history_len")

    return FeatureBatch(schema=schema, images=imgs, instructions=instr, state_B_S=state_t, history_B_H_S=hist)


def check_compatible(schemas: Sequence[FeatureSchema]) -> str:
    """Return the shared backbone key, or raise ``IncompatibleBatches`` naming the odd one out."""
    if not schemas:
        raise InvalidSpec("nothing to group: give at least one batch")
    key = schemas[0].backbone_key()
    for i, s in enumerate(schemas[1:], start=1):
        if s.backbone_key() != key:
            raise IncompatibleBatches(
                f"batch {i} cannot share a backbone forward with batch 0: "
                f"{s.backbone_key()!r} != {key!r} (base model, camera slots and image size must match); "
                "run it in its own group"
            )
    return key


def concat_batches(batches: Sequence[FeatureBatch]) -> SharedBatch:
    """Lay compatible batches end to end; ``slices[i]`` recovers batch i's rows."""
    key = check_compatible([b.schema for b in batches])
    slots = batches[0].schema.camera_slots
    slices: list[slice] = []
    start = 0
    for b in batches:
        slices.append(slice(start, start + b.batch_size))
        start += b.batch_size
    if len(batches) == 1:
        images: Mapping[str, torch.Tensor] = batches[0].images
    else:
        # numpy, single-threaded: a small byte copy, where torch's intra-op threads cost more.
        images = {
            s: torch.from_numpy(np.concatenate([b.images[s].numpy() for b in batches], axis=0)) for s in slots
        }
    instructions = tuple(s for b in batches for s in b.instructions)
    prefix = None
    if all(b.prefix_state_B_S is not None for b in batches):
        width = max(int(b.prefix_state_B_S.shape[1]) for b in batches if b.prefix_state_B_S is not None)
        prefix = torch.cat([torch.nn.functional.pad(b.prefix_state_B_S, (0, width - b.prefix_state_B_S.shape[1]))
                            for b in batches if b.prefix_state_B_S is not None])
    return SharedBatch(key, slots, images, instructions, tuple(slices), prefix)


def split_rows(x_N_rest: torch.Tensor, slices: Sequence[slice]) -> list[torch.Tensor]:
    """Split backbone output rows back into per-batch views by recorded slices."""
    total = slices[-1].stop if slices else 0
    if x_N_rest.shape[0] != total:
        raise ShapeMismatch(f"split_rows: tensor has {x_N_rest.shape[0]} rows but slices cover {total}")
    return [x_N_rest[s] for s in slices]


@dataclass(frozen=True)
class TokenFeatures:
    """One backbone forward's output for the heads of a group.

    ``pooled_B_D`` float32 is exactly ``Backbone.forward``'s (pooled once, from the
    same hidden states, for the whole batch). ``h_B_L_D``/``real_B_L`` are the last
    hidden states and the real-token mask (bool; real tokens are a prefix of each
    row), or None when no head of the group reads tokens (not kept). The hidden
    states may be inference tensors: read them, pack them (``tokens``), never
    save them for autograd as they are.
    """

    pooled_B_D: torch.Tensor
    h_B_L_D: torch.Tensor | None = None
    real_B_L: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.h_B_L_D is None) != (self.real_B_L is None):
            raise InvalidSpec("TokenFeatures: give the hidden states and the real-token mask together")
        b = int(self.pooled_B_D.shape[0])
        if self.h_B_L_D is not None and self.real_B_L is not None:
            h, m = self.h_B_L_D, self.real_B_L
            if h.ndim != 3 or m.shape != h.shape[:2] or h.shape[0] != b or m.dtype != torch.bool:
                raise ShapeMismatch(
                    f"TokenFeatures: hidden states {list(h.shape)} and mask {list(m.shape)} ({m.dtype}) "
                    f"must be [B={b}, L, D] and bool [B, L]"
                )

    @property
    def batch_size(self) -> int:
        return int(self.pooled_B_D.shape[0])

    @property
    def has_tokens(self) -> bool:
        return self.h_B_L_D is not None

    def pooled(self) -> torch.Tensor:
        """``feats_B_D`` float32: what a pooled head reads."""
        return self.pooled_B_D

    def tokens(self) -> torch.Tensor:
        """The packed token features ``[B, L, D + 1]`` float32 (see ``pack_tokens``)."""
        if self.h_B_L_D is None or self.real_B_L is None:
            raise InvalidSpec(
                "a head reads token features but this forward kept only pooled ones; "
                "compute them with tokens=True"
            )
        return pack_tokens(self.h_B_L_D, self.real_B_L)

    def split(self, slices: Sequence[slice]) -> list[TokenFeatures]:
        """Each batch's rows, by ``SharedBatch.slices``; a part's tokens are cut to its own
        longest row (the layout a forward of its own would give, pads of others dropped)."""
        pooled = split_rows(self.pooled_B_D, slices)
        if self.h_B_L_D is None or self.real_B_L is None:
            return [TokenFeatures(p) for p in pooled]
        hs, ms = split_rows(self.h_B_L_D, slices), split_rows(self.real_B_L, slices)
        out = []
        for p, h, m in zip(pooled, hs, ms, strict=True):
            keep = int(m.sum(1).max()) if m.shape[0] else 0
            out.append(TokenFeatures(p, h[:, :keep], m[:, :keep]))
        return out


def pack_tokens(h_B_L_D: torch.Tensor, real_B_L: torch.Tensor) -> torch.Tensor:
    """``[B, L, D + 1]`` float32: the hidden states (zero at pads) and the mask (1.0 real,
    0.0 pad) as the last channel; a new tensor (never an inference tensor)."""
    m_B_L_1 = real_B_L[..., None].to(torch.float32)
    return torch.cat([h_B_L_D.to(torch.float32) * m_B_L_1, m_B_L_1], dim=-1)


def unpack_tokens(x_B_L_C: torch.Tensor, feature_dim: int, who: str = "head") -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states ``[B, L, D]``, bool mask ``[B, L]``) of packed token features;
    ``ShapeMismatch`` unless the tensor is ``[B, L, feature_dim + 1]`` with a 0/1 mask
    channel and at least one real token per row."""
    if x_B_L_C.ndim != 3 or x_B_L_C.shape[2] != feature_dim + 1 or x_B_L_C.shape[1] < 1:
        raise ShapeMismatch(
            f"{who}: token features must be [B, L >= 1, {feature_dim} + 1] (hidden states and the mask), "
            f"got {list(x_B_L_C.shape)}"
        )
    m = x_B_L_C[..., feature_dim]
    real_B_L = m > 0.5
    if not bool(((m == 0.0) | (m == 1.0)).all()) or not bool(real_B_L.any(1).all()):
        raise ShapeMismatch(f"{who}: the token mask channel must be 0/1 with a real token in every row")
    return x_B_L_C[..., :feature_dim], real_B_L
