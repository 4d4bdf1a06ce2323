"""Scripted experts: demonstrations for SFT datasets and a reference policy for evaluation.

ManiSkill's own motion-planning solutions need mplib 0.1.1, whose planner
crashes under numpy 2, so these experts steer the end effector directly
through the end-effector delta controllers ("pd_ee_delta_pos" or
"pd_ee_delta_pose": [dx, dy, dz, (rx, ry, rz,) gripper], positions scaled
so that 1.0 = 0.1 m; gripper 1 = open, -1 = closed) from the simulator's
privileged state (cube, goal and gripper-center poses).

Each expert is stateless: the phase (reach, descend, grasp, carry, push,
place, release) is read off the scene at every call, so one expert object
serves all N envs of a ``ManiSkillEnv`` and survives resets without hooks.
An expert is an ``ActFn``: ``await expert(obs)`` returns actions [N, A].

Measured success (CPU backends, 50 seeded episodes each, episode_seed(100, 0, k);
identical with pd_ee_delta_pos and pd_ee_delta_pose): PickCube-v1 100%
(mean 19 steps), PushCube-v1 100% (11 steps), StackCube-v1 96% (27 steps);
a uniform random policy: 0%, 5%, 0% (20 episodes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from joynexus.agents.envs.maniskill import ManiSkillEnv, ObsBatch
from joynexus.schemas.errors import InvalidSpec

_POS_SCALE = 0.1  # metres per unit of a normalized ee delta action
_HALF = 0.02  # cube half size in the three tasks
OPEN, CLOSED = 1.0, -1.0


def _p(actor: Any) -> np.ndarray:
    """Position [3] of a ManiSkill actor/link of a single-env scene."""
    return np.asarray(actor.pose.p.detach().cpu().numpy(), dtype=np.float64).reshape(-1)[:3]


def _grasping(sim: Any, actor: Any) -> bool:
    return bool(np.asarray(sim.agent.is_grasping(actor).detach().cpu().numpy()).reshape(-1)[0])


def _toward(tcp_3: np.ndarray, target_3: np.ndarray, gain: float) -> np.ndarray:
    return np.clip(gain * (target_3 - tcp_3) / _POS_SCALE, -1.0, 1.0)


def _pick_cube(sim: Any, gain: float) -> tuple[np.ndarray, float]:
    tcp, cube, goal = _p(sim.agent.tcp), _p(sim.cube), _p(sim.goal_site)
    if _grasping(sim, sim.cube):
        # carry: bring the cube (not the gripper centre) onto the goal and hold still
        return _toward(tcp, goal + (tcp - cube), gain), CLOSED
    return _reach_and_grasp(tcp, cube, gain)


def _reach_and_grasp(tcp: np.ndarray, cube: np.ndarray, gain: float) -> tuple[np.ndarray, float]:
    xy_err = float(np.linalg.norm(tcp[:2] - cube[:2]))
    if np.linalg.norm(tcp - cube) < 0.012 or (xy_err < 0.02 and tcp[2] - cube[2] < 0.008):
        return np.zeros(3), CLOSED  # at the cube: close
    if xy_err < 0.01:
        return _toward(tcp, cube, gain), OPEN  # above it: descend
    hover = np.array(
        [cube[0], cube[1], max(cube[2] + 0.05, tcp[2] if xy_err < 0.05 else cube[2] + 0.05)]
    )
    return _toward(tcp, hover, gain), OPEN  # reach above the cube


def _push_cube(sim: Any, gain: float) -> tuple[np.ndarray, float]:
    tcp, cube, goal = _p(sim.agent.tcp), _p(sim.obj), _p(sim.goal_region)
    to_goal = goal[:2] - cube[:2]
    dist = float(np.linalg.norm(to_goal))
    d = to_goal / dist if dist > 1e-6 else np.array([1.0, 0.0])
    rel = tcp[:2] - cube[:2]
    along = float(rel @ d)  # < 0: behind the cube (the side away from the goal)
    across = float(abs(rel[0] * d[1] - rel[1] * d[0]))
    push_z = _HALF
    if along < -(_HALF + 0.005) and across < 0.012:
        if tcp[2] < cube[2] + _HALF:
            # pushing: drive the gripper along the cube-goal line, a bit past the cube
            # (aiming at a point on the line through the cube's centre keeps it centred)
            aim_xy = cube[:2] + d * min(0.05, dist + 0.005)
            target = np.array([aim_xy[0], aim_xy[1], push_z])
            return _toward(tcp, target, gain), CLOSED
        behind = cube[:2] - d * (_HALF + 0.03)
        return _toward(tcp, np.array([behind[0], behind[1], push_z]), gain), CLOSED  # descend
    behind = cube[:2] - d * (_HALF + 0.03)
    z = cube[2] + 0.05 if np.linalg.norm(tcp[:2] - behind) > 0.012 else push_z
    return _toward(tcp, np.array([behind[0], behind[1], z]), gain), CLOSED  # go behind, above


def _stack_cube(sim: Any, gain: float) -> tuple[np.ndarray, float]:
    tcp, a, b = _p(sim.agent.tcp), _p(sim.cubeA), _p(sim.cubeB)
    place = b + np.array([0.0, 0.0, 2 * _HALF])
    on_top = np.linalg.norm(a[:2] - b[:2]) < 0.015 and abs(a[2] - place[2]) < 0.006
    if _grasping(sim, sim.cubeA):
        if on_top:
            return np.zeros(3), OPEN  # release
        xy_err = float(np.linalg.norm(a[:2] - b[:2]))
        offset = tcp - a
        if xy_err > 0.008:
            carry = np.array([b[0], b[1], place[2] + 0.04])
            if tcp[2] < place[2] + 0.02 + offset[2]:
                carry[:2] = a[:2]  # lift first, so cube A does not sweep cube B away
            return _toward(tcp, carry + offset, gain), CLOSED
        return _toward(tcp, place + offset + np.array([0, 0, 0.002]), gain), CLOSED  # lower
    if on_top:
        return _toward(tcp, np.array([tcp[0], tcp[1], a[2] + 0.08]), gain), OPEN  # retreat
    return _reach_and_grasp(tcp, a, gain)


_POLICIES: dict[str, Callable[[Any, float], tuple[np.ndarray, float]]] = {
    "PickCube-v1": _pick_cube,
    "PushCube-v1": _push_cube,
    "StackCube-v1": _stack_cube,
}


class ScriptedExpert:
    """Privileged-state expert for one ``ManiSkillEnv``; an ``ActFn`` for its N envs."""

    def __init__(self, env: ManiSkillEnv, *, gain: float = 1.0) -> None:
        spec = env.spec
        if spec.task not in _POLICIES:
            raise InvalidSpec(
                f"no scripted expert for {spec.task}; experts exist for {sorted(_POLICIES)}"
            )
        if spec.control_mode not in ("pd_ee_delta_pos", "pd_ee_delta_pose"):
            raise InvalidSpec(
                f"the scripted experts steer the end effector: build the env with "
                f"control_mode='pd_ee_delta_pos' or 'pd_ee_delta_pose', not {spec.control_mode!r}"
            )
        self.env = env
        self.gain = gain
        self._policy = _POLICIES[spec.task]

    def actions(self) -> np.ndarray:
        """Actions float32 [N, A] for the envs' current states (blocking, cheap)."""
        rows = []
        for sim in self.env.sims:
            delta_3, grip = self._policy(sim, self.gain)
            if self.env.spec.action_dim == 7:  # pd_ee_delta_pose: keep the orientation
                row = np.concatenate([delta_3, np.zeros(3), [grip]])
            else:
                row = np.concatenate([delta_3, [grip]])
            rows.append(row)
        return np.asarray(rows, dtype=np.float32)

    async def __call__(self, obs: ObsBatch) -> np.ndarray:
        return self.actions()


def expert_tasks() -> list[str]:
    return sorted(_POLICIES)


__all__ = ["ScriptedExpert", "expert_tasks"]
