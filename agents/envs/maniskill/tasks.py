"""The ManiSkill tasks JoyNexus supports, and the state entries each can give.

Plain data and pure functions (no simulator is imported): the schema
derivation, the CLI's listings and the backbone read these tables without
building an env. Only tasks whose assets ship inside the ``mani_skill`` wheel
are here (nothing may be downloaded); state keys and presets are described in
docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from joynexus.schemas.errors import InvalidSpec


@dataclass(frozen=True)
class TaskInfo:
    """What JoyNexus supports of one ManiSkill task."""

    instruction: str
    max_episode_steps: int
    #: Camera slots the task can render: its sensor cameras plus "render_camera"
    #: (the third-person view ManiSkill uses for videos; shows the goal marker).
    cameras: tuple[str, ...]
    default_cameras: tuple[str, ...]
    #: (group, key) pairs of ManiSkill's dict observation concatenated into the
    #: state vector when obs="rgb"; group is "agent" or "extra".
    default_state_keys: tuple[str, ...]
    #: State vector length when obs="state" (ManiSkill's flattened state).
    flat_state_dim: int


TASKS: dict[str, TaskInfo] = {
    "PickCube-v1": TaskInfo(
        instruction="pick up the cube and move it to the goal position",
        max_episode_steps=50,
        cameras=("base_camera", "hand_camera", "render_camera"),
        default_cameras=("base_camera",),
        # The goal marker is hidden from the sensor cameras, so the goal is in the state.
        default_state_keys=("agent/qpos", "extra/goal_pos"),
        flat_state_dim=42,
    ),
    "PushCube-v1": TaskInfo(
        instruction="push the cube to the red and white target",
        max_episode_steps=50,
        cameras=("base_camera", "hand_camera", "render_camera"),
        default_cameras=("base_camera",),
        default_state_keys=("agent/qpos",),
        flat_state_dim=35,
    ),
    "StackCube-v1": TaskInfo(
        instruction="stack the red cube on top of the green cube",
        max_episode_steps=50,
        cameras=("base_camera", "hand_camera", "render_camera"),
        default_cameras=("base_camera",),
        default_state_keys=("agent/qpos",),
        flat_state_dim=48,
    ),
}


#: Sizes of the (group, key) entries that may be named in ``state_keys`` in every task.
#: "agent/*" come from ManiSkill's observation; "extra/*" are read off the simulator
#: (privileged state where it is the scene's ground truth), so they exist whatever
#: the obs mode (ManiSkill itself hides object poses from its rgb observations).
_STATE_KEY_DIMS: dict[str, int] = {
    "agent/qpos": 9,
    "agent/qvel": 9,
    "extra/tcp_pose": 7,
}

#: Per task, the privileged entries and their sizes (ManiSkill's own names from
#: its "state" obs mode; obj = the cube to move, goal = where it goes).
_TASK_STATE_KEY_DIMS: dict[str, dict[str, int]] = {
    "PickCube-v1": {
        "extra/goal_pos": 3,
        "extra/is_grasped": 1,
        "extra/obj_pose": 7,
        "extra/tcp_to_obj_pos": 3,
        "extra/obj_to_goal_pos": 3,
    },
    "PushCube-v1": {
        "extra/goal_pos": 3,
        "extra/obj_pose": 7,
        "extra/tcp_to_obj_pos": 3,
        "extra/obj_to_goal_pos": 3,
    },
    "StackCube-v1": {
        "extra/is_grasped": 1,
        "extra/cubeA_pose": 7,
        "extra/cubeB_pose": 7,
        "extra/tcp_to_cubeA_pos": 3,
        "extra/tcp_to_cubeB_pos": 3,
        "extra/cubeA_to_cubeB_pos": 3,
    },
}

#: Named choices a spec may give instead of (or among) keys: "proprio" is the
#: task's default (what a real robot senses, plus PickCube's goal), "privileged"
#: adds the simulator's object and goal state (what the scripted experts read).
STATE_PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "proprio": {},  # filled below from TASKS
    "privileged": {
        "PickCube-v1": ("agent/qpos", "extra/tcp_pose", "extra/obj_pose", "extra/goal_pos",
                        "extra/tcp_to_obj_pos", "extra/obj_to_goal_pos", "extra/is_grasped"),
        "PushCube-v1": ("agent/qpos", "extra/tcp_pose", "extra/obj_pose", "extra/goal_pos",
                        "extra/tcp_to_obj_pos", "extra/obj_to_goal_pos"),
        "StackCube-v1": ("agent/qpos", "extra/tcp_pose", "extra/cubeA_pose", "extra/cubeB_pose",
                         "extra/tcp_to_cubeA_pos", "extra/tcp_to_cubeB_pos",
                         "extra/cubeA_to_cubeB_pos", "extra/is_grasped"),
    },
}
STATE_PRESETS["proprio"] = {t: info.default_state_keys for t, info in TASKS.items()}



def state_key_dims(task: str) -> dict[str, int]:
    """Every state entry ``task`` can give, with its size."""
    return {**_STATE_KEY_DIMS, **_TASK_STATE_KEY_DIMS.get(task, {})}



def resolve_state_keys(task: str, keys: Sequence[str]) -> tuple[str, ...]:
    """Expand presets ("proprio", "privileged") into keys, in order, without repeats;
    a clear error for a key the task does not have."""
    return expand_state_keys(
        task,
        keys,
        state_key_dims(task),
        lambda k: STATE_PRESETS[k][task] if k in STATE_PRESETS else None,
        presets=sorted(STATE_PRESETS),
    )


def expand_state_keys(
    env: str,
    keys: Sequence[str],
    dims: Mapping[str, int],
    preset: Callable[[str], Sequence[str] | None],
    *,
    presets: Sequence[str],
) -> tuple[str, ...]:
    """Keys with presets expanded (``preset(k)``: its keys, or None for a plain key),
    in order, without repeats; a clear error for a key ``env`` does not have.
    Shared by every simulator's state description."""
    out: list[str] = []
    for k in keys:
        for e in preset(k) or (k,):
            if e not in dims:
                raise InvalidSpec(
                    f"state key {e!r:.80} does not exist in {env}: choose from {sorted(dims)} "
                    f"or a preset {list(presets)}"
                )
            if e not in out:
                out.append(e)
    return tuple(out)

