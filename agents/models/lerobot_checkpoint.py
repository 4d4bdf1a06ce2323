"""Reading a LeRobot policy checkpoint directory, family-neutral: ``config.json`` plus
``model.safetensors``, the layout LeRobot's ``PreTrainedPolicy.save_pretrained`` writes.

``read_checkpoint`` checks the directory without loading a weight: a bounded
``config.json`` that is a JSON object naming the policy ``type``, and a
``model.safetensors`` whose header is well-formed (known dtypes, each tensor's bytes
exactly its shape's, spans that tile the file). The tensors' names and shapes are then
what a family reads its sizes from (``pi05_checkpoint``: the PaliGemma variant), so a
size is never taken from a hub name. ``load_tensors`` reads only the tensors asked for
(memory-mapped by safetensors). ``FAMILY_OF`` dispatches on ``type``: a family that can
be loaded from a LeRobot checkpoint registers there (π0.5, SmolVLA); ``families.init_expert_head``
starts a tenant's expert from a checkpoint of its own family (``init_from_checkpoint``).

Every failure is an ``InvalidSpec`` naming the directory and what is wrong with it, raised
before a role builds anything. See docs/ARCHITECTURE.md, "Model families: the π0.5 base".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "CONFIG_FILE",
    "FAMILY_OF",
    "MAX_CONFIG_BYTES",
    "WEIGHTS_FILE",
    "LeRobotCheckpoint",
    "copy_tensors",
    "family_of",
    "load_expert",
    "load_tensors",
    "read_checkpoint",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: A LeRobot ``config.json`` is a few KiB; anything larger is not one.
MAX_CONFIG_BYTES = 1 << 20
#: A safetensors header bigger than this is not a policy's (π0.5 at gemma_2b: ~100 KiB).
MAX_HEADER_BYTES = 16 << 20
#: LeRobot's policy ``type`` -> the base family loaded from it here.
FAMILY_OF: dict[str, str] = {"pi05": "pi05", "smolvla": "smolvla"}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class LeRobotCheckpoint:
    """A checked checkpoint directory: its ``config.json`` and its tensors' dtypes and shapes."""

    path: str
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    @property
    def type(self) -> str:
        return str(self.config["type"])

    @property
    def weights(self) -> str:
        return os.path.join(self.path, WEIGHTS_FILE)

    def bad(self, reason: str) -> InvalidSpec:
        """The refusal of this checkpoint for ``reason``."""
        return bad_checkpoint(self.path, reason)


def bad_checkpoint(path: str, reason: str) -> InvalidSpec:
    shown = path if len(path) <= 200 else path[:200] + "..."
    return InvalidSpec(f"LeRobot checkpoint {shown!r}: {reason} (expected a directory holding config.json and "
                       "model.safetensors as LeRobot's save_pretrained writes them)")


def _header(path: str, weights: str) -> dict[str, Any]:
    """The safetensors header of ``weights``, checked against the file's size."""
    size = os.path.getsize(weights)
    with open(weights, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, MAX_HEADER_BYTES):
            raise bad_checkpoint(path, "model.safetensors is not safetensors (header length)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError:
        raise bad_checkpoint(path, "model.safetensors is not safetensors (header is not JSON)") from None
    if not isinstance(header, dict):
        raise bad_checkpoint(path, "model.safetensors is not safetensors (header)")
    body = size - 8 - n
    spans = []
    for key, t in header.items():
        if key == "__metadata__":
            continue
        what = f"model.safetensors is corrupt: tensor {str(key)[:80]!r}"
        if not isinstance(t, dict) or t.get("dtype") not in _DTYPE_BYTES:
            raise bad_checkpoint(path, f"{what} has an unknown dtype")
        shape, offsets = t.get("shape"), t.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise bad_checkpoint(path, f"{what} has no shape")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= body):
            raise bad_checkpoint(path, f"{what} lies outside the file (truncated?)")
        nbytes = _DTYPE_BYTES[t["dtype"]]
        for d in shape:
            nbytes *= d
        if offsets[1] - offsets[0] != nbytes:
            raise bad_checkpoint(path, f"{what} holds {offsets[1] - offsets[0]} bytes for a shape of {nbytes}")
        spans.append((offsets[0], offsets[1]))
    if not spans:
        raise bad_checkpoint(path, "model.safetensors holds no tensors")
    end = 0
    for a, b in sorted(spans):
        if a != end:
            raise bad_checkpoint(path, "model.safetensors is corrupt: tensors overlap or leave gaps")
        end = b
    if end != body:
        raise bad_checkpoint(path, "model.safetensors is corrupt: bytes after the last tensor")
    return header


def read_checkpoint(path: str) -> LeRobotCheckpoint:
    """``path`` checked as a LeRobot checkpoint (see the module's doc); no weight is read."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise bad_checkpoint(str(path)[:200], "not a path")
    cfg_file, weights = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    try:
        if not os.path.isdir(path) or not os.path.isfile(cfg_file) or not os.path.isfile(weights):
            raise bad_checkpoint(path, "config.json or model.safetensors is missing")
        if os.path.getsize(cfg_file) > MAX_CONFIG_BYTES:
            raise bad_checkpoint(path, "config.json is too large")
        with open(cfg_file, "rb") as f:
            config = json.loads(f.read())
        header = _header(path, weights)
    except InvalidSpec:
        raise
    except OSError as e:
        raise bad_checkpoint(path, f"cannot be read ({type(e).__name__})") from None
    except ValueError:
        raise bad_checkpoint(path, "config.json is not JSON") from None
    if not isinstance(config, dict) or not isinstance(config.get("type"), str):
        raise bad_checkpoint(path, "config.json names no policy type")
    shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    dtypes = {k: str(v["dtype"]) for k, v in header.items() if k != "__metadata__"}
    return LeRobotCheckpoint(path, config, shapes, dtypes)


def family_of(ckpt: LeRobotCheckpoint, family: str) -> None:
    """``InvalidSpec`` unless ``ckpt``'s policy ``type`` is one the base ``family`` loads."""
    if FAMILY_OF.get(ckpt.type) != family:
        wanted = [t for t, f in FAMILY_OF.items() if f == family]
        raise ckpt.bad(f"its policy type is {ckpt.type[:40]!r}; a {family} base loads type {wanted}")


def load_tensors(ckpt: LeRobotCheckpoint, prefixes: tuple[str, ...], strip: str = "",
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors whose names start with one of ``prefixes`` (only those are read), named
    without the leading ``strip``."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(ckpt.weights, framework="pt") as f:  # type: ignore[no-untyped-call]
            for k in f.keys():
                if k.startswith(prefixes):
                    t = f.get_tensor(k)
                    out[k[len(strip):] if k.startswith(strip) else k] = t if dtype is None else t.to(dtype)
    except (OSError, RuntimeError, ValueError) as e:
        raise ckpt.bad(f"model.safetensors cannot be read ({type(e).__name__})") from None
    return out


def copy_tensors(ckpt: LeRobotCheckpoint, targets: list[tuple[str, torch.Tensor]]) -> None:
    """Each (checkpoint tensor name, target) of ``targets``: the tensor copied into the target (shapes checked by the
    caller), read one at a time so loading a base needs little memory beyond the base;
    ``InvalidSpec`` if one holds NaN or inf."""
    from safetensors import safe_open

    try:
        with safe_open(ckpt.weights, framework="pt") as f, torch.no_grad():  # type: ignore[no-untyped-call]
            for name, dst in targets:
                t = f.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ckpt.bad(f"tensor {name!r} holds NaN or inf")
                dst.copy_(t)
    except (OSError, RuntimeError) as e:
        raise ckpt.bad(f"model.safetensors cannot be read ({type(e).__name__})") from None


#: A head's own buffers a checkpoint's expert never holds (its data's normalisation).
_HEAD_OWN = ("state_mean", "state_std", "action_mean", "action_std")


def load_expert(ckpt: LeRobotCheckpoint, head: torch.nn.Module, sd: dict[str, torch.Tensor], kind: str) -> None:
    """A checkpoint's expert weights ``sd`` (under the head's names) into ``head``: every tensor
    finite (checked before any is loaded), cast to the head's dtypes, every weight of the head
    but its normalisation buffers present, none left over, shapes equal; else ``InvalidSpec``."""
    for k, t in sd.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ckpt.bad(f"expert tensor {k!r} holds NaN or inf")
    own = head.state_dict()
    sd = {k: t.to(own[k].dtype) if k in own else t for k, t in sd.items()}
    try:
        missing, unexpected = head.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        raise ckpt.bad(f"its action expert's shapes differ from this workload's head ({str(e)[:300]})") from None
    left = [k for k in missing if k not in _HEAD_OWN]
    if left or unexpected:
        raise ckpt.bad(f"its action expert does not match a {kind}: missing {left[:4]}, unexpected {unexpected[:4]}")
