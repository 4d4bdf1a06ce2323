"""ManiSkill3 simulators for RL rollouts and evaluation, on CPU backends.

The RL producers and the evaluator run a tenant's task here: ``make_env``
builds a batch of ManiSkill envs (PickCube-v1, PushCube-v1, StackCube-v1:
the tasks whose assets ship inside the ``mani_skill`` wheel, so nothing is
downloaded), ``rollout`` steps them with an async policy (the Inference
Queue, in the service) and returns flat numeric arrays ready for a Training
Queue put, and ``evaluate`` measures a policy's success rate.

Observations handed to a policy use LeRobot's key names, so that a head
trained on a LeRobot dataset (see ``lerobot_data``) reads simulator
observations unchanged:

    "observation.images.<camera>"  uint8   [N, 3, H, W]   one per camera slot
    "observation.state"            float32 [N, S]
    "task"                         list[str] of length N (the instruction)

Rendering runs on the CPU through Mesa's lavapipe Vulkan driver (install it
with ``ops/system_setup.sh``); this module points the Vulkan loader at it
before SAPIEN is imported, unless the caller already set ``VK_ICD_FILENAMES``.
The CPU physics backend holds one env per ManiSkill instance, so a batch of
``num_envs`` is that many instances in this process, stepped one after the
other in a worker thread (``asyncio.to_thread``) so the event loop keeps
serving while the simulator runs.
"""

from __future__ import annotations

import abc
import asyncio
import glob
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self

import numpy as np

from joynexus.schemas.errors import InvalidSpec, ShapeMismatch
from joynexus.schemas.samples import ACTION, OBS_IMAGES, OBS_STATE, tq_field

# --- environment for the Vulkan loader, before sapien is imported anywhere ---


def configure_cpu_rendering() -> str | None:
    """Point the Vulkan loader at lavapipe (Mesa's CPU driver) if nothing is set.

    Returns the ICD file in use, or None when lavapipe is not installed or an
    NVIDIA driver is (then SAPIEN uses whatever Vulkan driver the machine has).
    Idempotent; the caller's own ``VK_ICD_FILENAMES`` always wins.
    """
    if os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES"):
        return os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
    # A machine with an NVIDIA driver renders on its GPU; leave the loader alone.
    # (Mesa's other ICDs, intel/radeon, come with lavapipe everywhere, so only
    # NVIDIA's says that a real device is there.)
    for icd_dir in ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d"):
        if glob.glob(f"{icd_dir}/nvidia_icd*.json"):
            return None
    # Mesa 25 names it lvp_icd.json, older packages lvp_icd.<arch>.json.
    for pattern in ("/usr/share/vulkan/icd.d/lvp_icd*.json", "/etc/vulkan/icd.d/lvp_icd*.json"):
        found = sorted(glob.glob(pattern))
        if found:
            os.environ["VK_ICD_FILENAMES"] = found[0]
            return found[0]
    return None


configure_cpu_rendering()

# Key names shared with LeRobot datasets (lerobot.utils.constants spells them the same;
# the observation and action keys live in joynexus.schemas.samples).
TASK = "task"

ObsMode = Literal["state", "rgb"]
ObsBatch = dict[str, Any]
"""A batch observation: image and state arrays keyed as above, plus ``TASK`` strings."""
ActFn = Callable[[ObsBatch], Awaitable[np.ndarray]]
"""An async policy: a batch observation in, actions [N, A] or a chunk [N, H, A] out."""


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

_WHY_ONLY_THESE = (
    "only tasks whose assets ship inside the mani_skill wheel are supported, "
    "because nothing may be downloaded at run time"
)

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


def check_env_args(obs: str, num_envs: int, image_size: int, *, speed: str) -> None:
    """The arguments every simulator's env takes, checked alike (``speed``: a hint
    on what an image size costs there)."""
    if obs not in ("state", "rgb"):
        raise InvalidSpec(f"obs={obs!r}: choose 'state' (vector only) or 'rgb' (cameras + state)")
    if num_envs < 1:
        raise InvalidSpec(f"num_envs={num_envs}: must be at least 1")
    if not 16 <= image_size <= 512:
        raise InvalidSpec(f"image_size={image_size}: choose 16..512 pixels ({speed})")


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


def _sim_p(actor: Any) -> np.ndarray:
    return _to_numpy(actor.pose.p).reshape(-1)[:3].astype(np.float32)


def _sim_pose(actor: Any) -> np.ndarray:
    return _to_numpy(actor.pose.raw_pose).reshape(-1)[:7].astype(np.float32)


def _grasped(sim: Any, actor: Any) -> np.ndarray:
    return _to_numpy(sim.agent.is_grasping(actor)).reshape(-1)[:1].astype(np.float32)


def _privileged(task: str, sim: Any, key: str) -> np.ndarray:
    """One "extra/*" entry of one single-env scene, read off the simulator."""
    name = key.split("/", 1)[1]
    tcp = sim.agent.tcp
    if name == "tcp_pose":
        return _sim_pose(tcp)
    if task == "StackCube-v1":
        a, b = sim.cubeA, sim.cubeB
        table = {
            "is_grasped": lambda: _grasped(sim, a),
            "cubeA_pose": lambda: _sim_pose(a),
            "cubeB_pose": lambda: _sim_pose(b),
            "tcp_to_cubeA_pos": lambda: _sim_p(a) - _sim_p(tcp),
            "tcp_to_cubeB_pos": lambda: _sim_p(b) - _sim_p(tcp),
            "cubeA_to_cubeB_pos": lambda: _sim_p(b) - _sim_p(a),
        }
    else:
        obj = sim.cube if task == "PickCube-v1" else sim.obj
        goal = sim.goal_site if task == "PickCube-v1" else sim.goal_region
        table = {
            "is_grasped": lambda: _grasped(sim, obj),
            "goal_pos": lambda: _sim_p(goal),
            "obj_pose": lambda: _sim_pose(obj),
            "tcp_to_obj_pos": lambda: _sim_p(obj) - _sim_p(tcp),
            "obj_to_goal_pos": lambda: _sim_p(goal) - _sim_p(obj),
        }
    return np.asarray(table[name](), dtype=np.float32).reshape(-1)


_ACTION_DIMS: dict[str, int] = {
    "pd_ee_delta_pos": 4,
    "pd_ee_delta_pose": 7,
    "pd_joint_delta_pos": 8,
    "pd_joint_pos": 8,
}


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
    if control_mode not in _ACTION_DIMS:
        raise InvalidSpec(f"control_mode={control_mode!r}: choose one of {sorted(_ACTION_DIMS)}")
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
        action_dim=_ACTION_DIMS[control_mode],
        max_episode_steps=info.max_episode_steps,
        instruction=info.instruction,
        # The wrist camera comes with ManiSkill's "panda_wristcam" robot; it costs
        # ~4x the render time of the base camera on a CPU, so only when asked.
        robot="panda_wristcam" if "hand_camera" in cams else "panda",
    )


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _quiet_maniskill_logs() -> None:
    import logging

    # "panda_wristcam is not in the task's list of supported robots": it is the
    # same arm with a camera; the warning repeats per env.
    logging.getLogger("mani_skill").setLevel(logging.ERROR)


@dataclass
class StepResult:
    """One synchronous step of all N envs (numpy, leading dimension N)."""

    obs: ObsBatch
    reward_N: np.ndarray
    terminated_N: np.ndarray
    truncated_N: np.ndarray
    success_N: np.ndarray
    info: list[dict[str, Any]] = field(default_factory=list)


class BatchedEnv(abc.ABC):
    """N single envs behind one batch API: what the rollout and evaluation loops use.

    Subclasses (one per simulator: ``ManiSkillEnv``, ``libero.LiberoEnv``) convert
    one env's raw observation into (state [S], {camera: image [3, H, W]}) and
    step/reset their envs; the batching, seeds, in-place row writes and closing
    checks are here, once.
    """

    def __init__(self, spec: EnvSpec, envs: list[Any]) -> None:
        self.spec = spec
        self._envs = envs
        self._closed = False

    @property
    def num_envs(self) -> int:
        return self.spec.num_envs

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidSpec("this env was closed; build a new one with make_env()")

    def _batch(self, per_env: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> ObsBatch:
        obs: ObsBatch = {}
        for cam in self.spec.cameras:
            obs[f"{OBS_IMAGES}.{cam}"] = np.stack([imgs[cam] for _, imgs in per_env])
        obs[OBS_STATE] = np.stack([s for s, _ in per_env]).astype(np.float32)
        obs[TASK] = [self.spec.instruction] * len(per_env)
        return obs

    def _seeds(self, seed: int | Sequence[int] | None) -> list[int | None]:
        """Env i gets seed[i] (or seed + i for an int seed; None: unseeded)."""
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, int | np.integer):
            return [int(seed) + i for i in range(self.num_envs)]
        seeds: list[int | None] = [int(s) for s in seed]
        if len(seeds) != self.num_envs:
            raise ShapeMismatch(f"reset got {len(seeds)} seeds for {self.num_envs} envs")
        return seeds

    @staticmethod
    def _result(
        batch: ObsBatch,
        rewards: list[float],
        terms: list[bool],
        truncs: list[bool],
        succ: list[bool],
        infos: list[dict[str, Any]],
    ) -> StepResult:
        return StepResult(
            obs=batch,
            reward_N=np.asarray(rewards, dtype=np.float32),
            terminated_N=np.asarray(terms, dtype=bool),
            truncated_N=np.asarray(truncs, dtype=bool),
            success_N=np.asarray(succ, dtype=bool),
            info=infos,
        )

    def replace_obs(
        self, obs: ObsBatch, index: int, row: tuple[np.ndarray, dict[str, np.ndarray]]
    ) -> None:
        """Write one env's converted observation into row ``index`` of a batch, in place."""
        state_S, images = row
        obs[OBS_STATE][index] = state_S
        for cam, img in images.items():
            obs[f"{OBS_IMAGES}.{cam}"][index] = img

    @abc.abstractmethod
    def close(self) -> None:
        """Close every env (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ManiSkillEnv(BatchedEnv):
    """N single-instance ManiSkill envs (CPU physics and rendering) behind one batch API.

    Blocking; async code calls ``reset``/``step`` through ``asyncio.to_thread``
    (``rollout`` and ``evaluate`` do). ``sims`` are the unwrapped ManiSkill
    envs, for scripted experts that read privileged state.
    """

    @property
    def sims(self) -> list[Any]:
        """The unwrapped ManiSkill envs (``mani_skill.envs.sapien_env.BaseEnv``)."""
        return [e.unwrapped for e in self._envs]

    def _convert_one(self, raw: Any, env: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        spec = self.spec
        if spec.obs == "state":
            return _to_numpy(raw).reshape(-1).astype(np.float32), {}
        parts = []
        for key in spec.state_keys:
            group, name = key.split("/")
            if group == "extra":  # read off the simulator: exists in every obs mode
                parts.append(_privileged(spec.task, env.unwrapped, key))
            else:
                parts.append(_to_numpy(raw[group][name]).reshape(-1).astype(np.float32))
        state_S = np.concatenate(parts)
        images: dict[str, np.ndarray] = {}
        for cam in spec.cameras:
            if cam == "render_camera":
                img_H_W_C = _to_numpy(env.unwrapped.render_rgb_array())[0]
            else:
                img_H_W_C = _to_numpy(raw["sensor_data"][cam]["rgb"])[0]
            images[cam] = np.ascontiguousarray(img_H_W_C.transpose(2, 0, 1)).astype(np.uint8)
        return state_S, images

    def reset_one(self, index: int, seed: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Reset env ``index``; returns its (state [S], {camera: image [3, H, W]})."""
        self._check_open()
        env = self._envs[index]
        raw, _ = env.reset(seed=seed)
        return self._convert_one(raw, env)

    def reset(self, seed: int | Sequence[int] | None = None) -> ObsBatch:
        """Reset all envs; env i gets seed[i] (or seed + i for an int seed)."""
        seeds = self._seeds(seed)
        return self._batch([self.reset_one(i, s) for i, s in enumerate(seeds)])

    def step(self, actions_N_A: np.ndarray) -> StepResult:
        """Step every env once with its row of ``actions_N_A`` (float32 [N, A]).

        Delta controllers take actions normalized to [-1, 1]; pd_joint_pos takes
        absolute joint angles (radians) and the gripper opening.
        """
        self._check_open()
        actions_N_A = np.asarray(actions_N_A, dtype=np.float32)
        want = (self.num_envs, self.spec.action_dim)
        if actions_N_A.shape != want:
            raise ShapeMismatch(
                f"actions of shape {actions_N_A.shape} for {self.spec.task} with "
                f"{self.spec.control_mode}: send float32 {list(want)} (num_envs, action_dim)"
            )
        per_env = []
        rewards, terms, truncs, succ, infos = [], [], [], [], []
        for env, a_A in zip(self._envs, actions_N_A, strict=True):
            raw, r, te, tr, info = env.step(a_A[None])
            per_env.append(self._convert_one(raw, env))
            rewards.append(float(_to_numpy(r).reshape(-1)[0]))
            terms.append(bool(_to_numpy(te).reshape(-1)[0]))
            truncs.append(bool(_to_numpy(tr).reshape(-1)[0]))
            succ.append(bool(_to_numpy(info.get("success", False)).reshape(-1)[0]))
            infos.append(info)
        return self._result(self._batch(per_env), rewards, terms, truncs, succ, infos)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for env in self._envs:
                env.close()


_RENDER_KEEPALIVE: list[Any] = []


def _keep_renderer_alive() -> None:
    """Hold one SAPIEN render system for the life of the process.

    SAPIEN tears its Vulkan renderer down when the last env that uses it is
    closed, and the first picture after a restart compiles every shader
    pipeline again: ~10 s on lavapipe (30 s on a busy 2-core machine). With
    this reference alive, later rgb envs start in < 1 s.
    """
    if not _RENDER_KEEPALIVE:
        import sapien

        _RENDER_KEEPALIVE.append(sapien.render.RenderSystem(sapien.Device("cpu")))


def make_env(
    task: str,
    *,
    obs: ObsMode = "state",
    num_envs: int = 1,
    image_size: int = 64,
    control_mode: str = "pd_ee_delta_pos",
    seed: int | None = None,
    cameras: Sequence[str] | None = None,
    state_keys: Sequence[str] | None = None,
    reward_mode: str = "normalized_dense",
) -> ManiSkillEnv:
    """Build ``num_envs`` CPU ManiSkill envs of ``task``; reset with ``seed`` if given.

    ``obs="state"``: "observation.state" is ManiSkill's flat privileged state.
    ``obs="rgb"``: one uint8 [N, 3, image_size, image_size] image per camera slot,
    and a state made of ``state_keys`` (default per task, see ``TASKS``).
    The first rgb env of a process takes ~10 s (renderer start); later ones < 1 s.
    """
    spec = task_spec(
        task,
        obs=obs,
        num_envs=num_envs,
        image_size=image_size,
        control_mode=control_mode,
        cameras=cameras,
        state_keys=state_keys,
    )
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401  (registers the tasks)

    _quiet_maniskill_logs()
    kwargs: dict[str, Any] = dict(
        obs_mode="state" if obs == "state" else "rgb",
        control_mode=control_mode,
        reward_mode=reward_mode,
        robot_uids=spec.robot,
        sim_backend="physx_cpu",
        render_backend="sapien_cpu",
        max_episode_steps=spec.max_episode_steps,
    )
    if obs == "rgb":
        kwargs["sensor_configs"] = dict(width=image_size, height=image_size)
        kwargs["human_render_camera_configs"] = dict(width=image_size, height=image_size)
    if obs == "rgb":
        _keep_renderer_alive()
    envs: list[Any] = []
    try:
        for _ in range(num_envs):
            envs.append(gym.make(task, **kwargs))
    except RuntimeError as exc:
        for env in envs:
            env.close()
        if "vulkan" in str(exc).lower() or "device" in str(exc).lower():
            raise InvalidSpec(
                f"ManiSkill could not start a Vulkan renderer ({exc}); on a machine without "
                "a GPU run `sudo bash ops/system_setup.sh` (installs Mesa's lavapipe)"
            ) from exc
        raise
    env = ManiSkillEnv(spec, envs)
    if seed is not None:
        env.reset(seed=seed)
    return env


# --- async rollout and evaluation ---


def episode_seed(seed: int, env_index: int, episode: int) -> int:
    """A distinct, reproducible reset seed for episode ``episode`` of env ``env_index``."""
    return int(np.random.SeedSequence([seed, env_index, episode]).generate_state(1)[0] & 0x7FFFFFFF)


def _check_actions(actions: Any, spec: EnvSpec) -> np.ndarray:
    """Actions as float32 [N, H, A] (H = 1 for a single step)."""
    arr = np.asarray(actions, dtype=np.float32)
    if arr.ndim == 2:
        arr = arr[:, None, :]
    if (
        arr.ndim != 3
        or arr.shape[0] != spec.num_envs
        or arr.shape[2] != spec.action_dim
        or arr.shape[1] < 1
    ):
        raise ShapeMismatch(
            f"act_fn returned shape {tuple(np.shape(actions))}; return float32 "
            f"[{spec.num_envs}, {spec.action_dim}] or a chunk [{spec.num_envs}, H, {spec.action_dim}]"
        )
    return arr


def _copy_obs(obs: ObsBatch) -> ObsBatch:
    return {k: (v.copy() if isinstance(v, np.ndarray) else list(v)) for k, v in obs.items()}


_STEP_FIELDS = (
    "actions",
    "rewards",
    "dones",
    "terminated",
    "truncated",
    "success",
    "env_id",
    "step",
    "episode_index",
    "frame_index",
    "episode_seed",
    "chunk_step",
)


def rollout_fields(spec: EnvSpec) -> tuple[str, ...]:
    """Every field ``rollout`` returns for an env of this spec."""
    return (*(tq_field(k) for k in (*spec.image_keys, OBS_STATE)), *_STEP_FIELDS)


def policy_obs(data: Mapping[str, np.ndarray], spec: EnvSpec) -> ObsBatch:
    """Rollout/Training Queue fields -> the ``ObsBatch`` a policy reads (LeRobot key names)."""
    obs: ObsBatch = {key: data[tq_field(key)] for key in (*spec.image_keys, OBS_STATE)}
    obs[TASK] = [spec.instruction] * len(obs[OBS_STATE])
    return obs


async def rollout(
    env: ManiSkillEnv,
    act_fn: ActFn,
    *,
    horizon: int,
    seed: int,
    chunk: Literal["first", "open_loop"] = "open_loop",
) -> dict[str, np.ndarray]:
    """Run ``horizon`` steps of every env with ``act_fn``; returns N x horizon samples.

    Envs are reset at the start (with seeds derived from ``seed``) and again
    whenever an episode ends, so every env contributes exactly ``horizon``
    steps. ``act_fn`` gets the batch observation of all N envs and returns
    float32 [N, A], or an action chunk [N, H, A]: with ``chunk="open_loop"``
    the chunk's steps are executed one after the other without asking the
    policy again, until the chunk is used up, the horizon is reached, or any
    env's episode ends (then the policy is asked afresh); with ``chunk="first"``
    only its first step is executed.

    Returned arrays: numeric only, leading dimension M = N * horizon, env-major
    (sample m is env m // horizon at rollout step m % horizon), named as
    Training Queue fields (lowercase, digits, "_"; see ``ROLLOUT_FIELDS``)
    and as the advantage agent reads them (env_id, step, rewards, dones):
        "obs_image_<cam>" uint8 [M, 3, H, W]  (obs="rgb"; one per camera slot)
        "obs_state"   float32 [M, S]   the observation the action was taken in
        "actions"     float32 [M, A]   the action executed
        "rewards"     float32 [M]      reward of that step
        "dones", "terminated", "truncated", "success"  bool [M]   outcome of that
                                       step (dones = terminated | truncated)
        "env_id", "step"  int64 [M]    env index and rollout step (0..horizon-1)
        "episode_index", "frame_index"  int64 [M]  episode count of that env within
                                       this rollout, step within the episode
        "episode_seed" int64 [M]       reset seed of the sample's episode
        "chunk_step"  int64 [M]        the step's place in the chunk it came from: 0 where
                                       the policy was asked (a decision), h for the
                                       chunk's h-th step executed open loop after it
    ``policy_obs(data)`` turns the obs fields back into an ``ObsBatch``.
    """
    if horizon < 1:
        raise InvalidSpec(f"horizon={horizon}: must be at least 1")
    spec = env.spec
    N = spec.num_envs
    episode_N = np.zeros(N, dtype=np.int64)
    frame_N = np.zeros(N, dtype=np.int64)
    seeds_N = np.array([episode_seed(seed, i, 0) for i in range(N)], dtype=np.int64)
    obs = await asyncio.to_thread(env.reset, [int(s) for s in seeds_N])

    obs_fields = {key: tq_field(key) for key in (*spec.image_keys, OBS_STATE)}
    cols: dict[str, list[np.ndarray]] = {k: [] for k in (*obs_fields.values(), *_STEP_FIELDS)}

    def _reset_done(done_N: np.ndarray, obs_next: ObsBatch) -> None:
        for i in np.flatnonzero(done_N):
            episode_N[i] += 1
            frame_N[i] = 0
            seeds_N[i] = episode_seed(seed, int(i), int(episode_N[i]))
            env.replace_obs(obs_next, int(i), env.reset_one(int(i), int(seeds_N[i])))

    t = 0
    while t < horizon:
        actions_N_H_A = _check_actions(await act_fn(_copy_obs(obs)), spec)
        steps = 1 if chunk == "first" else actions_N_H_A.shape[1]
        for h in range(min(steps, horizon - t)):
            a_N_A = actions_N_H_A[:, h]
            res = await asyncio.to_thread(env.step, a_N_A)
            done_N = res.terminated_N | res.truncated_N
            for key, fld in obs_fields.items():
                cols[fld].append(obs[key])
            cols["actions"].append(a_N_A)
            cols["rewards"].append(res.reward_N)
            cols["dones"].append(done_N)
            cols["terminated"].append(res.terminated_N)
            cols["truncated"].append(res.truncated_N)
            cols["success"].append(res.success_N)
            cols["env_id"].append(np.arange(N, dtype=np.int64))
            cols["step"].append(np.full(N, t, dtype=np.int64))
            cols["episode_index"].append(episode_N.copy())
            cols["frame_index"].append(frame_N.copy())
            cols["episode_seed"].append(seeds_N.copy())
            cols["chunk_step"].append(np.full(N, h, dtype=np.int64))
            frame_N += 1
            obs = res.obs
            t += 1
            if done_N.any():
                await asyncio.to_thread(_reset_done, done_N, obs)
                break
    out: dict[str, np.ndarray] = {}
    for key, steps_T in cols.items():
        arr_T_N = np.stack(steps_T)  # [T, N, ...]
        arr_N_T = np.swapaxes(arr_T_N, 0, 1)
        out[key] = np.ascontiguousarray(arr_N_T.reshape(N * horizon, *arr_T_N.shape[2:]))
    return out


class EpisodeControl(Protocol):
    """What a stoppable episode loop consults (the evaluator's ``EvalControl`` is one).

    ``begin_round`` is awaited before every round (N episodes side by side): False
    stops the loop there (a cancel, a stopping evaluator, no turn given);
    ``end_round`` follows every round that began, however it ended; ``halted`` is
    asked before every policy query, and True drops the round under way.
    """

    async def begin_round(self) -> bool: ...

    def end_round(self) -> None: ...

    def halted(self) -> bool: ...


class FrameRecorder(Protocol):
    """Gets every observation of an episode loop (e.g. ``video.EpisodeVideos``).

    ``observe(episode_ids, obs, live_N)``: ``obs`` is the batch after a reset or a
    step; row i is episode ``episode_ids[i]`` (rows past ``len(episode_ids)`` are
    idle padding), live where ``live_N[i]`` (the frame belongs to the episode: its
    first, or the outcome of a step it took).
    """

    def observe(self, episode_ids: Sequence[int], obs: ObsBatch, live_N: np.ndarray) -> None: ...


def _summary(
    successes: list[bool], at_end: list[bool], returns: list[float], lengths: list[int]
) -> dict[str, float | int]:
    def mean(xs: Sequence[Any]) -> float:
        return float(np.mean(xs)) if len(xs) else 0.0

    return {
        "success_rate": mean(successes),
        "success_at_end_rate": mean(at_end),
        "mean_return": mean(returns),
        "mean_length": mean(lengths),
        "episodes": len(successes),
    }


async def run_episodes(
    env_factory: Callable[[], Any],
    act_fn: ActFn,
    *,
    episodes: int,
    max_steps: int | None = None,
    seed: int = 0,
    chunk: Literal["first", "open_loop"] = "open_loop",
    control: EpisodeControl | None = None,
    recorder: FrameRecorder | None = None,
) -> tuple[dict[str, float | int], bool]:
    """The episode loop of ``evaluate``, stoppable: (statistics, finished).

    Builds one env with ``env_factory()`` when the first round begins (closed
    at the end) and runs its N envs in lockstep, ceil(episodes / N) rounds,
    each episode until it ends or ``max_steps`` (default: the task's limit).
    An episode counts as a success if the task reported success at any step
    (ManiSkill's "success_once"). Episode e resets with
    ``episode_seed(seed, 0, e)``, so two policies evaluated with the same seed
    see the same initial states. With a chunk of actions, its steps run open
    loop until one of the episodes ends (then the policy is asked afresh).

    ``control`` (see ``EpisodeControl``) can stop it before a round or within
    a step; an interrupted round is dropped, the statistics cover the episodes
    finished and ``finished`` is False. ``recorder`` sees every observation.
    """
    if episodes < 1:
        raise InvalidSpec(f"episodes={episodes}: must be at least 1")
    successes: list[bool] = []
    at_end: list[bool] = []
    returns: list[float] = []
    lengths: list[int] = []
    env: Any = None
    next_episode = 0
    try:
        while next_episode < episodes:
            if control is not None and not await control.begin_round():
                return _summary(successes, at_end, returns, lengths), False
            try:
                if env is None:
                    env = await asyncio.to_thread(env_factory)
                spec = env.spec
                N = spec.num_envs
                limit = max_steps if max_steps is not None else spec.max_episode_steps
                ids = list(range(next_episode, min(next_episode + N, episodes)))
                seeds = [episode_seed(seed, 0, e) for e in ids]
                seeds += [episode_seed(seed, 1, e) for e in range(N - len(ids))]  # idle padding
                obs = await asyncio.to_thread(env.reset, seeds)
                active_N = np.zeros(N, dtype=bool)
                active_N[: len(ids)] = True
                if recorder is not None:
                    recorder.observe(ids, obs, active_N.copy())
                ret_N = np.zeros(N, dtype=np.float64)
                len_N = np.zeros(N, dtype=np.int64)
                ever_N = np.zeros(N, dtype=bool)
                last_N = np.zeros(N, dtype=bool)
                steps = 0
                while active_N.any() and steps < limit:
                    if control is not None and control.halted():
                        return _summary(successes, at_end, returns, lengths), False
                    actions_N_H_A = _check_actions(await act_fn(_copy_obs(obs)), spec)
                    n_exec = 1 if chunk == "first" else actions_N_H_A.shape[1]
                    for h in range(min(n_exec, limit - steps)):
                        res = await asyncio.to_thread(env.step, actions_N_H_A[:, h])
                        steps += 1
                        live_N = active_N.copy()
                        ret_N += np.where(active_N, res.reward_N, 0.0)
                        len_N += active_N
                        ever_N |= active_N & res.success_N
                        last_N[active_N] = res.success_N[active_N]
                        ended_N = active_N & (res.terminated_N | res.truncated_N)
                        active_N &= ~ended_N
                        obs = res.obs
                        if recorder is not None:
                            recorder.observe(ids, obs, live_N)
                        if ended_N.any():  # ask the policy afresh rather than finish the chunk
                            break
            finally:
                if control is not None:
                    control.end_round()
            k = len(ids)
            next_episode += k
            successes += ever_N[:k].tolist()
            at_end += last_N[:k].tolist()
            returns += ret_N[:k].tolist()
            lengths += len_N[:k].tolist()
    finally:
        if env is not None:
            await asyncio.to_thread(env.close)
    return _summary(successes, at_end, returns, lengths), True


async def evaluate(
    env_factory: Callable[[], ManiSkillEnv],
    act_fn: ActFn,
    *,
    episodes: int,
    max_steps: int | None = None,
    seed: int = 0,
    chunk: Literal["first", "open_loop"] = "open_loop",
    recorder: FrameRecorder | None = None,
) -> dict[str, float | int]:
    """Run ``episodes`` episodes (no training) and report how well ``act_fn`` does.

    ``run_episodes`` without a stop control (see there for episodes, seeds and
    chunks). Returns success_rate, success_at_end_rate, mean_return,
    mean_length, episodes.
    """
    result, _ = await run_episodes(
        env_factory, act_fn, episodes=episodes, max_steps=max_steps, seed=seed, chunk=chunk,
        recorder=recorder,
    )
    return result


def random_policy(spec: EnvSpec, seed: int = 0) -> ActFn:
    """A uniform random policy over [-1, 1]^A, as a baseline act_fn."""
    rng = np.random.default_rng(seed)

    async def act(obs: Mapping[str, Any]) -> np.ndarray:
        n = len(obs[OBS_STATE])
        return rng.uniform(-1.0, 1.0, size=(n, spec.action_dim)).astype(np.float32)

    return act


__all__ = [
    "ACTION",
    "OBS_IMAGES",
    "OBS_STATE",
    "STATE_PRESETS",
    "TASK",
    "TASKS",
    "ActFn",
    "EnvSpec",
    "EpisodeControl",
    "FrameRecorder",
    "ManiSkillEnv",
    "ObsBatch",
    "StepResult",
    "TaskInfo",
    "configure_cpu_rendering",
    "episode_seed",
    "evaluate",
    "make_env",
    "policy_obs",
    "random_policy",
    "resolve_state_keys",
    "rollout",
    "rollout_fields",
    "run_episodes",
    "state_key_dims",
    "task_spec",
    "tq_field",
]
