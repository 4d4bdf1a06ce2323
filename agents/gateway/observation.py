"""openpi's observation keys mapped to a policy's inputs, and the metadata the
gateway sends first: pure, no I/O.

A policy here reads camera images (``FeatureSchema.camera_slots``, uint8, one
size), a state vector and an instruction. openpi's clients name them in a few
ways, all accepted (``<cam>`` one of the policy's cameras):

- images: ``images[<cam>]`` (a map, as openpi's ALOHA examples),
  ``observation/images/<cam>``, ``observation.images.<cam>`` (LeRobot's names),
  ``observation/<cam>``; and openpi's LIBERO names: ``observation/image`` (or
  ``image``) for the policy's main camera (its first camera that is not a wrist
  camera, or its only one), ``observation/wrist_image`` (or ``wrist_image``) for
  its wrist camera (the one camera named ``*wrist*`` or ``*eye_in_hand*``,
  LIBERO's). Height x width x 3 (openpi's layout) or 3 x height x width, uint8,
  at the policy's image size.
- state: ``state``, ``observation/state`` or ``observation.state``: the policy's
  state dimension, finite numbers.
- prompt: ``prompt`` (default: the workload's instruction).

Other keys are ignored (openpi's clients send extras). What does not fit raises
:class:`~joynexus.schemas.errors.ShapeMismatch` or ``InvalidMessage`` naming it.
See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from joynexus.schemas.errors import InvalidMessage, ShapeMismatch
from joynexus.schemas.inference import PolicyRecord

STATE_KEYS = ("state", "observation/state", "observation.state")
PROMPT_KEY = "prompt"
#: camera names openpi's ``wrist_image`` may stand for (LIBERO's wrist camera is ``eye_in_hand``)
WRIST_NAMES = ("wrist", "eye_in_hand")
MAX_PROMPT_BYTES = 4096


@dataclass(frozen=True)
class PolicyView:
    """What one connection serves: a tenant's workload, pinned or latest."""

    tenant: str
    workload: str
    record: PolicyRecord
    #: the version every request pins (None: the latest the engine has)
    pinned: int | None
    instruction: str = ""

    @property
    def cameras(self) -> list[str]:
        return list(self.record.feature_schema.camera_slots)

    @property
    def wrist_camera(self) -> str | None:
        """The one camera named like a wrist camera (openpi's ``wrist_image``), if exactly one."""
        wrists = [c for c in self.cameras if any(w in c.lower() for w in WRIST_NAMES)]
        return wrists[0] if len(wrists) == 1 else None

    @property
    def main_camera(self) -> str | None:
        """openpi's ``image``: the only camera, or the first that is not the wrist camera."""
        cams = self.cameras
        if len(cams) == 1:
            return cams[0]
        return next((c for c in cams if c != self.wrist_camera), None)

    def image_keys(self, cam: str) -> list[str]:
        keys = [f"observation/images/{cam}", f"observation.images.{cam}", f"observation/{cam}"]
        if cam == self.main_camera:
            keys += ["observation/image", "image"]
        elif cam == self.wrist_camera:
            keys += ["observation/wrist_image", "wrist_image"]
        return keys

    def metadata(self) -> dict[str, Any]:
        fs = self.record.feature_schema
        return {
            "server": "joynexus-gateway",
            "protocol": "openpi-websocket",
            "tenant": self.tenant,
            "workload": self.workload,
            "version": self.record.version,
            "pinned": self.pinned is not None,
            "head_type": self.record.head_type,
            "base_model": self.record.base_model,
            "action_horizon": fs.action_horizon,
            "action_dim": fs.action_dim,
            "cameras": list(fs.camera_slots),
            "image_size": list(fs.image_hw),
            "image_layout": "HWC or CHW, uint8",
            "image_keys": {c: ["images/" + c, *self.image_keys(c)] for c in fs.camera_slots},
            "state_keys": list(fs.state_keys),
            "state_dim": fs.state_dim,
            "state_key": list(STATE_KEYS),
            "prompt_key": PROMPT_KEY,
            "instruction": self.instruction,
        }

    def inputs(self, obs: dict[str, Any]) -> tuple[dict[str, np.ndarray], np.ndarray, str]:
        """``(images slot -> uint8 [1, 3, H, W], state float32 [1, S], prompt)``."""
        fs = self.record.feature_schema
        nested = obs.get("images")
        images = {}
        for cam in fs.camera_slots:
            x = nested.get(cam) if isinstance(nested, dict) else None
            for key in self.image_keys(cam):
                if x is None:
                    x = obs.get(key)
            if x is None:
                raise InvalidMessage(f"no image for camera {cam!r}: send one of "
                                     f"{['images/' + cam, *self.image_keys(cam)]}")
            images[cam] = _image(cam, x, tuple(fs.image_hw))
        state = next((obs[k] for k in STATE_KEYS if k in obs), None)
        if state is None:
            raise InvalidMessage(f"no state: send one of {list(STATE_KEYS)}")
        prompt = obs.get(PROMPT_KEY, self.instruction)
        if not isinstance(prompt, str) or len(prompt.encode()) > MAX_PROMPT_BYTES:
            raise InvalidMessage(f"prompt must be a string of at most {MAX_PROMPT_BYTES} bytes")
        return images, _state(state, fs.state_dim), prompt or self.instruction


def _image(cam: str, x: Any, hw: tuple[int, ...]) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
        raise InvalidMessage(f"image {cam!r} must be a uint8 array (openpi: "
                             "image_tools.convert_to_uint8)")
    h, w = int(hw[0]), int(hw[1])
    if x.shape == (h, w, 3):
        x = x.transpose(2, 0, 1)
    elif x.shape != (3, h, w):
        raise ShapeMismatch(f"image {cam!r}: expected [{h}, {w}, 3] (or [3, {h}, {w}]), "
                            f"got {list(x.shape)}; resize it to the policy's image size")
    return np.ascontiguousarray(x)[None]


def _state(x: Any, dim: int) -> np.ndarray:
    if isinstance(x, list):
        try:
            x = np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidMessage("state must be numbers") from None
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "fiu":
        raise InvalidMessage("state must be a numeric array")
    if x.shape not in ((dim,), (1, dim)):
        raise ShapeMismatch(f"state: expected [{dim}], got {list(x.shape)}")
    s = x.reshape(1, dim).astype(np.float32)
    if not np.isfinite(s).all():
        raise InvalidMessage("state contains NaN or inf: send finite numbers only")
    return s
