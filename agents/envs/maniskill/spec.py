"""What a policy reads and writes in a ManiSkill env: ``EnvSpec``, checked by ``task_spec``.

``task_spec`` validates a tenant's request (task, obs mode, cameras, state
keys, control mode) and describes the env it would build, without building
it, so a bad spec fails at the door. Observations use LeRobot's key names,
so a head trained on a LeRobot dataset reads simulator observations
unchanged:

    "observation.images.<camera>"  uint8   [N, 3, H, W]   one per camera slot
    "observation.state"            float32 [N, S]
    "task"                         list[str] of length N (the instruction)

See docs/ARCHITECTURE.md, "Simulators by name: ManiSkill and LIBERO".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from joynexus.agents.envs.maniskill.tasks import TASKS, resolve_state_keys, state_key_dims
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.samples import ACTION, OBS_IMAGES, OBS_STATE

# Key names shared with LeRobot datasets (lerobot.utils.constants spells them the same;
# the observation and action keys live in joynexus.schemas.samples).
TASK = "task"

ObsMode = Literal["state", "rgb"]
ObsBatch = dict[str, Any]
"""A batch observation: image and state arrays keyed as above, plus ``TASK`` strings."""
ActFn = Callable[[ObsBatch], Awaitable[np.ndarray]]
"""An async policy: a batch observation in, actions [N, A] or a chunk [N, H, A] out."""


_WHY_ONLY_THESE = (
    "only tasks whose assets ship inside the mani_skill wheel are supported, "
    "because nothing may be downloaded at run time"
)


ACTION_DIMS: dict[str, int] = {
    "pd_ee_delta_pos": 4,
    "pd_ee_delta_pose": 7,
    "pd_joint_delta_pos": 8,
    "pd_joint_pos": 8,
}




def check_env_args(obs: str, num_envs: int, image_size: int, *, speed: str) -> None:
    """The arguments every simulator's env takes, checked alike (``speed``: a hint
    on what an image size costs there)."""
    if obs not in ("state", "rgb"):
        raise InvalidSpec(f"obs={obs!r}: choose 'state' (vector only) or 'rgb' (cameras + state)")
    if num_envs < 1:
        raise InvalidSpec(f"num_envs={num_envs}: must be at least 1")
    if not 16 <= image_size <= 512:
        raise InvalidSpec(f"image_size={image_size}: choose 16..512 pixels ({speed})")



@dataclass(frozen=True)
class EnvSpec:
    """The observation/action schema of a built env: what a policy must read and write."""

    task: str
    obs: ObsMode
    num_envs: int
    image_size: int
    control_mode: str
    #: Camera slots, each "observation.images.<camera>" uint8 [N, 3, H, W]; empty for obs="state".
    cameras: tuple[str, ...]
    #: What "observation.state" is made of (ManiSkill names), or ("flat_state",).
    state_keys: tuple[str, ...]
    state_dim: int
    action_dim: int
    max_episode_steps: int
    instruction: str
    robot: str = "panda"

    @property
    def image_keys(self) -> tuple[str, ...]:
        return tuple(f"{OBS_IMAGES}.{cam}" for cam in self.cameras)

    def describe(self) -> dict[str, Any]:
        """Plain-data description (feature name -> dtype/shape), e.g. for a workload manifest."""
        feats: dict[str, Any] = {
            key: {"dtype": "uint8", "shape": (3, self.image_size, self.image_size)}
            for key in self.image_keys
        }
        feats[OBS_STATE] = {"dtype": "float32", "shape": (self.state_dim,)}
        feats[ACTION] = {"dtype": "float32", "shape": (self.action_dim,)}
        return {
            "task": self.task,
            "obs": self.obs,
            "control_mode": self.control_mode,
            "instruction": self.instruction,
            "max_episode_steps": self.max_episode_steps,
            "features": feats,
        }



def task_spec(
    task: str,
    *,
    obs: ObsMode = "state",
    num_envs: int = 1,
    image_size: int = 64,
    control_mode: str = "pd_ee_delta_pos",
    cameras: Sequence[str] | None = None,
    state_keys: Sequence[str] | None = None,
) -> EnvSpec:
    """Validate a request and describe the env it builds, without building it."""
    info = TASKS.get(task)
    if info is None:
        raise InvalidSpec(
            f"unknown task {task!r}: choose one of {sorted(TASKS)} ({_WHY_ONLY_THESE})"
        )
    check_env_args(obs, num_envs, image_size, speed="64 renders ~15 steps/s on a CPU")
    if control_mode not in ACTION_DIMS:
        raise InvalidSpec(f"control_mode={control_mode!r}: choose one of {sorted(ACTION_DIMS)}")
    if obs == "state":
        if cameras:
            raise InvalidSpec(
                "cameras are only rendered with obs='rgb'; drop cameras= or set obs='rgb'"
            )
        if state_keys:
            raise InvalidSpec(
                "state_keys applies to obs='rgb'; obs='state' gives ManiSkill's full flat state"
            )
        cams: tuple[str, ...] = ()
        keys: tuple[str, ...] = ("flat_state",)
        state_dim = info.flat_state_dim
    else:
        cams = tuple(cameras) if cameras is not None else info.default_cameras
        bad = [c for c in cams if c not in info.cameras]
        if bad or not cams or len(set(cams)) != len(cams):
            raise InvalidSpec(
                f"cameras={list(cams)} for {task}: name one or more distinct cameras of {list(info.cameras)}"
            )
        keys = resolve_state_keys(
            task, tuple(state_keys) if state_keys else info.default_state_keys
        )
        dims = state_key_dims(task)
        state_dim = sum(dims[k] for k in keys)
    return EnvSpec(
        task=task,
        obs=obs,
        num_envs=num_envs,
        image_size=image_size,
        control_mode=control_mode,
        cameras=cams,
        state_keys=keys,
        state_dim=state_dim,
        action_dim=ACTION_DIMS[control_mode],
        max_episode_steps=info.max_episode_steps,
        instruction=info.instruction,
        # The wrist camera comes with ManiSkill's "panda_wristcam" robot; it costs
        # ~4x the render time of the base camera on a CPU, so only when asked.
        robot="panda_wristcam" if "hand_camera" in cams else "panda",
    )

