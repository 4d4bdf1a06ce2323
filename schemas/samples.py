"""Names of a training sample: LeRobot observation keys and Training Queue fields.

One home for the keys simulators, datasets, producers, the actor, the
advantage stage and the control plane share. Training Queue fields become
subject tokens, so they carry no dots: an observation key maps onto one with
:func:`tq_field`.

See docs/ARCHITECTURE.md, "Layout and import root".
"""

from __future__ import annotations

from joynexus.schemas.errors import InvalidSpec

#: LeRobot keys of an observation (``observation.images.<camera>``) and of an action.
OBS_STATE = "observation.state"
OBS_IMAGES = "observation.images"
ACTION = "action"

#: Training Queue fields of a training sample besides the images.
STATE_FIELD = "obs_state"
ACTIONS_FIELD = "actions"  # the action chunk to learn [M, horizon, A]
#: RL rows: how many steps of its chunk the policy's decision at this row executed
#: (int64 [M], 1..horizon); 0 on rows executed open loop from an earlier decision.
DECISION_FIELD = "decision_len"
#: Prefix of a camera's Training Queue field (``obs_image_<camera>``).
IMAGE_FIELD_PREFIX = "obs_image_"


def tq_field(key: str) -> str:
    """The Training Queue field name of an observation key.

    "observation.state" -> "obs_state"; "observation.images.<cam>" -> "obs_image_<cam>".
    (Training Queue fields become subject tokens: no dots.)
    """
    if key == OBS_STATE:
        return STATE_FIELD
    prefix = OBS_IMAGES + "."
    if key.startswith(prefix):
        return IMAGE_FIELD_PREFIX + key[len(prefix) :].lower()
    raise InvalidSpec(f"{key!r} is not an observation key: use {OBS_STATE!r} or '{prefix}<camera>'")


def image_field(slot: str) -> str:
    """Training Queue field of a camera slot (the name rollouts use)."""
    return tq_field(f"{OBS_IMAGES}.{slot}")


__all__ = [
    "ACTION",
    "ACTIONS_FIELD",
    "DECISION_FIELD",
    "IMAGE_FIELD_PREFIX",
    "OBS_IMAGES",
    "OBS_STATE",
    "STATE_FIELD",
    "image_field",
    "tq_field",
]
