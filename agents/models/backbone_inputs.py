"""A backbone forward's inputs, prepared once per batch (pure CPU work, no model).

``BackboneInputs`` holds the right-padded prompt ids and the images' patch rows;
``TokenCache`` tokenises each distinct instruction once, ``right_pad`` pads the
prompts, and ``patchify`` makes Qwen2-VL patch rows of still images in one
vectorised call (the image processor's numbers).

See docs/ARCHITECTURE.md, "Policies that learn" and "The Inference Queue"
(where preparation is paid).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

__all__ = ["BackboneInputs", "TokenCache", "channels", "patchify", "right_pad"]


@dataclass(frozen=True)
class BackboneInputs:
    """Tokenized and patchified inputs for one backbone forward (CPU tensors)."""

    input_ids_B_L: torch.Tensor  # int64, right-padded
    lengths_B: torch.Tensor  # int64, real tokens per row
    pixel_values_P_F: torch.Tensor  # float32, all images' patches, sample-major then camera
    image_grid_thw_N_3: torch.Tensor  # int64, N = B * cameras
    n_cameras: int

    @property
    def batch_size(self) -> int:
        return int(self.input_ids_B_L.shape[0])


def right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token rows to the longest: returns (ids_B_L int64, lengths_B int64)."""
    lengths = [len(r) for r in rows]
    L = max(lengths) if lengths else 0
    ids = np.full((len(rows), L), pad_id, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return torch.from_numpy(ids), torch.tensor(lengths, dtype=torch.int64)



class TokenCache:
    """Token ids of each distinct text, computed once: a bounded LRU keyed by the text.

    ``encode`` turns a list of texts into a list of id lists (a tokenizer's batch
    call); only the texts not cached go through it, in one call. Returned lists are
    shared with the cache: callers copy (``prefix + ids[:n]``), never mutate.
    """

    def __init__(self, encode: Callable[[list[str]], Sequence[Sequence[int]]], maxsize: int = 4096) -> None:
        if maxsize < 1:
            raise InvalidSpec(f"TokenCache maxsize={maxsize}: must be >= 1")
        self.encode = encode
        self.maxsize = maxsize
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._ids)

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        cache = self._ids
        todo = list(dict.fromkeys(t for t in texts if t not in cache))
        if todo:
            self.misses += len(todo)
            for t, ids in zip(todo, self.encode(todo), strict=True):
                cache[t] = list(ids)
        out = []
        for t in texts:
            cache.move_to_end(t)
            out.append(cache[t])
        self.hits += len(texts) - len(todo)
        while len(cache) > self.maxsize:
            cache.popitem(last=False)
        return out


def patchify(
    images_N_C_H_W: torch.Tensor | np.ndarray,
    *,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    rescale: float = 1.0 / 255.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL patch rows of N still images in one vectorised call (no resize).

    uint8 ``[N, C, H, W]`` -> ``(pixel_values [N * gh * gw, C * T * p * p] float32,
    grid_thw [N, 3] int64)``, the rows of image 0 first; each image is its own
    ``T``-frame clip of one repeated frame, values rescaled to [0, 1] and
    normalised, patches in the processor's merge order: the same numbers as
    ``Qwen2VLImageProcessor(do_resize=False)`` called per image.
    """
    n, c, h, w = (int(v) for v in images_N_C_H_W.shape)
    p, t, m = patch_size, temporal_patch_size, merge_size
    if h % (p * m) or w % (p * m):
        raise ShapeMismatch(f"patchify: image {h}x{w} is not a multiple of patch {p} x merge {m}")
    gh, gw = h // p, w // p
    # In numpy, single-threaded on purpose: torch's intra-op threads cost more than they
    # save on tensors this small, and far more on a loaded machine (measured: 50x).
    # Reorder the uint8 pixels first (a byte copy), into the processor's patch order
    # [n, gh/m, gw/m, m, m, C, p, p]; the T frames of a still image are the same frame.
    arr = images_N_C_H_W.detach().cpu().numpy() if isinstance(images_N_C_H_W, torch.Tensor) else images_N_C_H_W
    u = np.asarray(arr).reshape(n, c, gh // m, m, p, gw // m, m, p)
    u = np.ascontiguousarray(u.transpose(0, 2, 5, 3, 6, 1, 4, 7))
    # As the processor: rescale in float64 then float32, normalise in float32.
    x = (u.astype(np.float64) * rescale).astype(np.float32)
    x -= np.asarray(mean, dtype=np.float32).reshape(c, 1, 1)
    x /= np.asarray(std, dtype=np.float32).reshape(c, 1, 1)
    flat = np.broadcast_to(x[..., None, :, :], (*x.shape[:-2], t, p, p)).reshape(n * gh * gw, c * t * p * p)
    rows = torch.from_numpy(np.ascontiguousarray(flat))
    grid = torch.tensor([[1, gh, gw]], dtype=torch.int64).expand(n, 3).contiguous()
    return rows, grid


def channels(v: float | list[float]) -> list[float]:
    """A processor's per-channel mean/std (a scalar means the same for all three)."""
    return [float(v)] * 3 if isinstance(v, (int, float)) else [float(x) for x in v]
