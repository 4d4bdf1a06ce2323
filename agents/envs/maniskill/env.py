"""``make_env``: N single-instance ManiSkill envs (CPU physics and rendering) as one ``BatchedEnv``.

The CPU physics backend holds one env per ManiSkill instance, so a batch of
``num_envs`` is that many instances in this process, stepped one after the
other (blocking: async callers step through ``asyncio.to_thread``). See
docs/ARCHITECTURE.md, "Simulators by name: ManiSkill and LIBERO" (ManiSkill on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from joynexus.agents.envs.firstbuild import first_build_alone
from joynexus.agents.envs.maniskill.batched import BatchedEnv, StepResult, to_numpy
from joynexus.agents.envs.maniskill.privileged import privileged_state
from joynexus.agents.envs.maniskill.rendering import keep_renderer_alive, quiet_maniskill_logs
from joynexus.agents.envs.maniskill.spec import ObsBatch, ObsMode, task_spec
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch


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
            return to_numpy(raw).reshape(-1).astype(np.float32), {}
        parts = []
        for key in spec.state_keys:
            group, name = key.split("/")
            if group == "extra":  # read off the simulator: exists in every obs mode
                parts.append(privileged_state(spec.task, env.unwrapped, key))
            else:
                parts.append(to_numpy(raw[group][name]).reshape(-1).astype(np.float32))
        state_S = np.concatenate(parts)
        images: dict[str, np.ndarray] = {}
        for cam in spec.cameras:
            if cam == "render_camera":
                img_H_W_C = to_numpy(env.unwrapped.render_rgb_array())[0]
            else:
                img_H_W_C = to_numpy(raw["sensor_data"][cam]["rgb"])[0]
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
            rewards.append(float(to_numpy(r).reshape(-1)[0]))
            terms.append(bool(to_numpy(te).reshape(-1)[0]))
            truncs.append(bool(to_numpy(tr).reshape(-1)[0]))
            succ.append(bool(to_numpy(info.get("success", False)).reshape(-1)[0]))
            infos.append(info)
        return self._result(self._batch(per_env), rewards, terms, truncs, succ, infos)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for env in self._envs:
                env.close()



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
    with first_build_alone("maniskill"):
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401  (registers the tasks)

        quiet_maniskill_logs()
        return _build(task, spec, obs, num_envs, image_size, control_mode, reward_mode, seed, gym)


def _build(task: str, spec: Any, obs: str, num_envs: int, image_size: int, control_mode: str,
           reward_mode: str, seed: int | None, gym: Any) -> ManiSkillEnv:
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
        keep_renderer_alive()
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

