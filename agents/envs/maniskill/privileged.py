"""The "extra/*" state entries, read off one ManiSkill scene (the simulator's ground truth).

Read off the simulator rather than ManiSkill's observation, so they exist in
the rgb obs mode too, where ManiSkill hides object poses; which actor is the
object and which the goal differs per task. See docs/ARCHITECTURE.md,
"Policies that learn".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from joynexus.agents.envs.maniskill.batched import to_numpy


def _sim_p(actor: Any) -> np.ndarray:
    return to_numpy(actor.pose.p).reshape(-1)[:3].astype(np.float32)


def _sim_pose(actor: Any) -> np.ndarray:
    return to_numpy(actor.pose.raw_pose).reshape(-1)[:7].astype(np.float32)


def _grasped(sim: Any, actor: Any) -> np.ndarray:
    return to_numpy(sim.agent.is_grasping(actor)).reshape(-1)[:1].astype(np.float32)


def privileged_state(task: str, sim: Any, key: str) -> np.ndarray:
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

