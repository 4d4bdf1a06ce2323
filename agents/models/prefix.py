"""What the prefix-cache bases (π0.5, SmolVLA) share around their own forwards.

Both take each camera's uint8 images to SigLIP's [-1, 1] square (``camera_images``: the
resize is each family's own, as LeRobot pads differently for each), read a batch's rows'
prefix state and camera slots the same way (``prefix_rows``: a batch without the state
is refused; ``grouped.for_base`` attaches it), and return their cache as ``TokenFeatures``
pooled over real tokens (``cache_features``).

See docs/ARCHITECTURE.md, "Model families: the π0.5 base" and
"Model families: the SmolVLA base".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from joynexus.agents.models.features import FeatureBatch, SharedBatch, TokenFeatures
from joynexus.schemas.errors import InvalidSpec

__all__ = ["cache_features", "camera_images", "prefix_rows"]


def camera_images(images: Mapping[str, torch.Tensor], camera_slots: Sequence[str], side: int,
                  resize: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """Each camera's images in [-1, 1], ``side`` square, ``[K, B, 3, S, S]``: grey made RGB,
    other sizes through ``resize`` (float images in [0, 1] -> ``side`` square)."""
    out = []
    for slot in camera_slots:
        img = images[slot].to(torch.float32) / 255.0
        if img.shape[1] == 1:
            img = img.expand(-1, 3, -1, -1)
        if tuple(img.shape[-2:]) != (side, side):
            img = resize(img, side)
        out.append(img * 2.0 - 1.0)
    return torch.stack(out, 0)


def prefix_rows(batch: FeatureBatch | SharedBatch, refusal: str) -> tuple[torch.Tensor, Sequence[str]]:
    """(the rows' prefix state, the camera slots) of a batch; ``InvalidSpec(refusal + ...)``
    when no state is attached."""
    if isinstance(batch, FeatureBatch):
        state, slots = batch.prefix_state_B_S, batch.schema.camera_slots
    else:
        state, slots = batch.prefix_state_N_S, batch.camera_slots
    if state is None:
        raise InvalidSpec(f"{refusal}: attach the tenant's prefix state (agents.models.grouped.for_base) before its forward")
    return state, slots


def cache_features(kv_B_L_C: torch.Tensor, real_B_L: torch.Tensor) -> TokenFeatures:
    """A prefix cache as ``TokenFeatures``: its tokens, and their mean over real tokens as the
    pooled view (a normal tensor, cloned out of inference mode: a pooled head trains on it)."""
    with torch.inference_mode():
        w = real_B_L[..., None].to(torch.float32)
        pooled = (kv_B_L_C.float() * w).sum(1) / w.sum(1)
    return TokenFeatures(pooled.clone(), kv_B_L_C, real_B_L)
