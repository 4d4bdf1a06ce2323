"""Names of a training sample: LeRobot observation keys and Training Queue fields.

One home for the keys simulators, datasets, producers, the actor, the
advantage stage and the control plane share. Training Queue fields become
subject tokens, so they carry no dots: an observation key maps onto one with
:func:`tq_field`. :data:`FIELDS` is the table of every field with its dtype and
shape; a name means one shape only (a rollout's executed action is ``action``
[M, A], the chunk learned from it ``actions`` [M, H, A]). tests/unit/test_names.py
fails on a field name written as a literal elsewhere.

See docs/ARCHITECTURE.md, "Layout and import root".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

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
#: A rollout step's executed action [M, A] (LeRobot's key): never ``actions``, the
#: chunk [M, H, A] learned from it.
EXECUTED_ACTION_FIELD = ACTION
ENV_ID_FIELD = "env_id"
STEP_FIELD = "step"
REWARDS_FIELD = "rewards"
DONES_FIELD = "dones"
TERMINATED_FIELD = "terminated"
TRUNCATED_FIELD = "truncated"
SUCCESS_FIELD = "success"
EPISODE_INDEX_FIELD = "episode_index"
FRAME_INDEX_FIELD = "frame_index"
EPISODE_SEED_FIELD = "episode_seed"
CHUNK_STEP_FIELD = "chunk_step"
OLD_LOGP_FIELD = "old_logp"
VALUES_FIELD = "values"
ADVANTAGES_FIELD = "advantages"
RETURNS_FIELD = "returns"
#: A training client's rows (schemas/training.py): a flow head's point and time of
#: ``forward``, and the gradients of a custom loss with respect to the outputs.
FLOW_XT_FIELD = "flow_xt"
FLOW_T_FIELD = "flow_t"
GRAD_MEAN_FIELD = "grad_mean"
GRAD_LOG_STD_FIELD = "grad_log_std"
GRAD_VALUE_FIELD = "grad_value"
GRAD_VELOCITY_FIELD = "grad_velocity"
#: The synthetic role's rows (agents/synthetic.py: load without a simulator) are
#: whole fake trajectories [B, T, ...], not the shapes above: names of their own.
SYN_OBS_FIELD = "syn_obs"
SYN_ACTIONS_FIELD = "syn_actions"
SYN_REWARDS_FIELD = "syn_rewards"
SYN_VALUES_FIELD = "syn_values"
SYN_ADVANTAGES_FIELD = "syn_advantages"


class Field(NamedTuple):
    """One Training Queue field: its dtype and its shape after the M rows, in the
    symbols of :data:`DIMS`, who writes it and what it holds."""

    name: str
    dtype: str
    dims: tuple[str, ...]
    by: str
    doc: str

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The per-row shape for concrete ``sizes`` of the symbols (``dims_of``)."""
        return tuple(sizes[d] for d in self.dims)


#: The shape symbols: H action horizon, A action dim, S state dim, C/IH/IW a
#: camera's channels, height and width (every field has M rows first); T and O
#: the synthetic role's trajectory length and observation size.
DIMS = ("H", "A", "S", "C", "IH", "IW", "T", "O")

#: Every Training Queue field, in one table: the SDK, the control plane's checks,
#: the env workers, the synthetic role and the advantage stage read it. ``by``:
#: "sample" (every job's producer: the service's or a tenant's), "rollout" (RL
#: rows; the SDK requires those a tenant's rollout needs, see REQUIRED),
#: "actor_forward" and "advantages" (the stages that add columns), "custom" (a
#: training client's calls, schemas/training.py), "synthetic"
#: (the synthetic role's own rows, read by nothing else).
FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        Field(IMAGE_FIELD_PREFIX + "<camera>", "uint8", ("C", "IH", "IW"), "sample",
              "one per camera slot of the workload's schema"),
        Field(STATE_FIELD, "float32", ("S",), "sample", "the observation the action was taken in"),
        Field(ACTIONS_FIELD, "float32", ("H", "A"), "sample",
              "the action chunk to learn: the executed actions from this row on"),
        Field(EXECUTED_ACTION_FIELD, "float32", ("A",), "rollout",
              "the action executed: a rollout column; the service's producer puts the "
              "actions chunk learned from it instead"),
        Field(ENV_ID_FIELD, "int64", (), "rollout", "env index"),
        Field(STEP_FIELD, "int64", (), "rollout", "rollout step, 0..horizon-1"),
        Field(REWARDS_FIELD, "float32", (), "rollout", "reward of the step"),
        Field(DONES_FIELD, "bool", (), "rollout", "the episode ended (terminated | truncated)"),
        Field(TERMINATED_FIELD, "bool", (), "rollout", "the episode ended in a terminal state"),
        Field(TRUNCATED_FIELD, "bool", (), "rollout", "the episode hit its step limit"),
        Field(SUCCESS_FIELD, "bool", (), "rollout", "the task was solved at this step"),
        Field(EPISODE_INDEX_FIELD, "int64", (), "rollout", "episode count of the env in this rollout"),
        Field(FRAME_INDEX_FIELD, "int64", (), "rollout", "step within the episode"),
        Field(EPISODE_SEED_FIELD, "int64", (), "rollout", "reset seed of the row's episode"),
        Field(CHUNK_STEP_FIELD, "int64", (), "rollout",
              "place in the chunk it came from: 0 where the policy was asked"),
        Field(DECISION_FIELD, "int64", (), "rollout",
              "steps of its chunk the decision at this row executed; 0 open loop"),
        Field(OLD_LOGP_FIELD, "float32", (), "actor_forward", "behaviour log-probability"),
        Field(VALUES_FIELD, "float32", (), "actor_forward", "critic value estimate"),
        Field(ADVANTAGES_FIELD, "float32", (), "advantages", "advantage of the row"),
        Field(RETURNS_FIELD, "float32", (), "advantages", "return of the row (GAE)"),
        Field(FLOW_XT_FIELD, "float32", ("H", "A"), "custom",
              "a flow head's point x_t (normalised action units) for forward"),
        Field(FLOW_T_FIELD, "float32", (), "custom", "a flow head's time t in [0, 1] for forward"),
        Field(GRAD_MEAN_FIELD, "float32", ("H", "A"), "custom", "d(loss)/d(mean chunk)"),
        Field(GRAD_LOG_STD_FIELD, "float32", ("A",), "custom", "d(loss)/d(log_std) per row"),
        Field(GRAD_VALUE_FIELD, "float32", (), "custom", "d(loss)/d(value)"),
        Field(GRAD_VELOCITY_FIELD, "float32", ("H", "A"), "custom", "d(loss)/d(velocity)"),
        Field(SYN_OBS_FIELD, "float32", ("T", "O"), "synthetic", "fake observations"),
        Field(SYN_ACTIONS_FIELD, "float32", ("T", "A"), "synthetic", "fake actions"),
        Field(SYN_REWARDS_FIELD, "float32", ("T",), "synthetic", "fake rewards"),
        Field(SYN_VALUES_FIELD, "float32", ("T",), "synthetic", "fake values"),
        Field(SYN_ADVANTAGES_FIELD, "float32", ("T",), "synthetic", "GAE of the fake rewards"),
    )
}

#: What ``rollout`` (agents/envs/maniskill/rollout.py) returns besides the
#: observation fields, in this order: the executed action [M, A] (a rollout column,
#: not a Training Queue field: the env workers learn the ``actions`` chunk derived
#: from it and put that instead), then the rollout fields above.
ROLLOUT_STEP_FIELDS: tuple[str, ...] = (
    EXECUTED_ACTION_FIELD, REWARDS_FIELD, DONES_FIELD, TERMINATED_FIELD, TRUNCATED_FIELD,
    SUCCESS_FIELD, ENV_ID_FIELD, STEP_FIELD, EPISODE_INDEX_FIELD, FRAME_INDEX_FIELD,
    EPISODE_SEED_FIELD, CHUNK_STEP_FIELD,
)

#: Fields a job of each task type needs from its producer besides the images (the
#: SDK checks a tenant's batch against it; a tenant's rollout sends ``actions`` as
#: the chunk [M, H, A], as an SFT batch does: the control plane refuses [M, A]).
REQUIRED: dict[str, tuple[str, ...]] = {
    "sft": (STATE_FIELD, ACTIONS_FIELD),
    "rl": (STATE_FIELD, ACTIONS_FIELD, ENV_ID_FIELD, STEP_FIELD, REWARDS_FIELD, DONES_FIELD),
}

#: The fields whose per-row shape the workload's schema fixes (checked at the door).
SCHEMA_FIELDS: tuple[str, ...] = (STATE_FIELD, ACTIONS_FIELD)


def dims_of(action_horizon: int, action_dim: int, state_dim: int,
            channels: int = 3, image_hw: Sequence[int] = (0, 0)) -> dict[str, int]:
    """Concrete sizes of :data:`DIMS` (from a workload's feature schema)."""
    return {"H": action_horizon, "A": action_dim, "S": state_dim, "C": channels,
            "IH": image_hw[0], "IW": image_hw[1], "T": 0, "O": 0}


def image_shape(sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Per-row shape of a camera's field."""
    return FIELDS[IMAGE_FIELD_PREFIX + "<camera>"].shape(sizes)


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
    "ADVANTAGES_FIELD",
    "CHUNK_STEP_FIELD",
    "DECISION_FIELD",
    "DIMS",
    "DONES_FIELD",
    "ENV_ID_FIELD",
    "EPISODE_INDEX_FIELD",
    "EPISODE_SEED_FIELD",
    "EXECUTED_ACTION_FIELD",
    "FIELDS",
    "FLOW_T_FIELD",
    "FLOW_XT_FIELD",
    "FRAME_INDEX_FIELD",
    "GRAD_LOG_STD_FIELD",
    "GRAD_MEAN_FIELD",
    "GRAD_VALUE_FIELD",
    "GRAD_VELOCITY_FIELD",
    "IMAGE_FIELD_PREFIX",
    "OBS_IMAGES",
    "OBS_STATE",
    "OLD_LOGP_FIELD",
    "REQUIRED",
    "RETURNS_FIELD",
    "REWARDS_FIELD",
    "ROLLOUT_STEP_FIELDS",
    "SCHEMA_FIELDS",
    "STATE_FIELD",
    "STEP_FIELD",
    "SUCCESS_FIELD",
    "SYN_ACTIONS_FIELD",
    "SYN_ADVANTAGES_FIELD",
    "SYN_OBS_FIELD",
    "SYN_REWARDS_FIELD",
    "SYN_VALUES_FIELD",
    "TERMINATED_FIELD",
    "TRUNCATED_FIELD",
    "VALUES_FIELD",
    "Field",
    "dims_of",
    "image_field",
    "image_shape",
    "tq_field",
]
