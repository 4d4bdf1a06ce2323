"""``rollout``: N envs for a horizon of steps with an async policy, as Training Queue fields.

The RL producer's env workers put what this returns straight on the
Training Queue (flat numeric arrays, env-major, named as its fields), so the
shapes and the open-loop chunk stepping are decided here once. See
docs/ARCHITECTURE.md, "Policies that learn" for how decisions and open-loop steps are trained.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from joynexus.agents.envs.maniskill.env import ManiSkillEnv
from joynexus.agents.envs.maniskill.spec import TASK, ActFn, EnvSpec, ObsBatch
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch
from joynexus.schemas.samples import (
    CHUNK_STEP_FIELD,
    DONES_FIELD,
    ENV_ID_FIELD,
    EPISODE_INDEX_FIELD,
    EPISODE_SEED_FIELD,
    EXECUTED_ACTION_FIELD,
    FRAME_INDEX_FIELD,
    OBS_STATE,
    REWARDS_FIELD,
    ROLLOUT_STEP_FIELDS,
    STEP_FIELD,
    SUCCESS_FIELD,
    TERMINATED_FIELD,
    TRUNCATED_FIELD,
    tq_field,
)


def episode_seed(seed: int, env_index: int, episode: int) -> int:
    """A distinct, reproducible reset seed for episode ``episode`` of env ``env_index``."""
    return int(np.random.SeedSequence([seed, env_index, episode]).generate_state(1)[0] & 0x7FFFFFFF)


def check_actions(actions: Any, spec: EnvSpec) -> np.ndarray:
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


def copy_obs(obs: ObsBatch) -> ObsBatch:
    return {k: (v.copy() if isinstance(v, np.ndarray) else list(v)) for k, v in obs.items()}


#: The per-step columns ``rollout`` returns besides the observations (the table:
#: schemas/samples.py's FIELDS; the executed action is ``action`` [M, A]).
STEP_FIELDS = ROLLOUT_STEP_FIELDS


def rollout_fields(spec: EnvSpec) -> tuple[str, ...]:
    """Every field ``rollout`` returns for an env of this spec."""
    return (*(tq_field(k) for k in (*spec.image_keys, OBS_STATE)), *STEP_FIELDS)


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
    Training Queue fields (lowercase, digits, "_"; the table is
    schemas/samples.py's FIELDS)
    and as the advantage agent reads them (env_id, step, rewards, dones):
        "obs_image_<cam>" uint8 [M, 3, H, W]  (obs="rgb"; one per camera slot)
        "obs_state"   float32 [M, S]   the observation the action was taken in
        "action"      float32 [M, A]   the action executed (LeRobot's key; the
                                       Training Queue's "actions" is the chunk
                                       [M, H, A] learned from it: chunk_targets)
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
    cols: dict[str, list[np.ndarray]] = {k: [] for k in (*obs_fields.values(), *STEP_FIELDS)}

    def _reset_done(done_N: np.ndarray, obs_next: ObsBatch) -> None:
        for i in np.flatnonzero(done_N):
            episode_N[i] += 1
            frame_N[i] = 0
            seeds_N[i] = episode_seed(seed, int(i), int(episode_N[i]))
            env.replace_obs(obs_next, int(i), env.reset_one(int(i), int(seeds_N[i])))

    t = 0
    while t < horizon:
        actions_N_H_A = check_actions(await act_fn(copy_obs(obs)), spec)
        steps = 1 if chunk == "first" else actions_N_H_A.shape[1]
        for h in range(min(steps, horizon - t)):
            a_N_A = actions_N_H_A[:, h]
            res = await asyncio.to_thread(env.step, a_N_A)
            done_N = res.terminated_N | res.truncated_N
            for key, fld in obs_fields.items():
                cols[fld].append(obs[key])
            cols[EXECUTED_ACTION_FIELD].append(a_N_A)
            cols[REWARDS_FIELD].append(res.reward_N)
            cols[DONES_FIELD].append(done_N)
            cols[TERMINATED_FIELD].append(res.terminated_N)
            cols[TRUNCATED_FIELD].append(res.truncated_N)
            cols[SUCCESS_FIELD].append(res.success_N)
            cols[ENV_ID_FIELD].append(np.arange(N, dtype=np.int64))
            cols[STEP_FIELD].append(np.full(N, t, dtype=np.int64))
            cols[EPISODE_INDEX_FIELD].append(episode_N.copy())
            cols[FRAME_INDEX_FIELD].append(frame_N.copy())
            cols[EPISODE_SEED_FIELD].append(seeds_N.copy())
            cols[CHUNK_STEP_FIELD].append(np.full(N, h, dtype=np.int64))
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

