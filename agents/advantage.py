"""Advantages for RL jobs: the pure math and the stage agent that applies it.

GAE (with the critic's ``values`` when the job went through actor_forward,
else 0) or GRPO are pure functions of one job's rows, tested without a server;
:class:`AdvantageAgent` is only a stage worker around them that writes
``advantages`` and ``returns`` against the same Training Queue rows and marks
the job ready.

See docs/ARCHITECTURE.md, "Workloads, from the SDK to a new policy version"
and "Policies that learn".
"""

from __future__ import annotations

import numpy as np

from joynexus.agents.jobextra import extra_number, uses_actor_forward, uses_decisions
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.agents.stage import StageWorker
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.errors import ShapeMismatch
from joynexus.schemas.jobs import TrainingJob
from joynexus.schemas.samples import (
    ADVANTAGES_FIELD,
    DONES_FIELD,
    ENV_ID_FIELD,
    RETURNS_FIELD,
    REWARDS_FIELD,
    STEP_FIELD,
    SUCCESS_FIELD,
    TERMINATED_FIELD,
    VALUES_FIELD,
)

#: The stage's name (its task on the Training Queue rows), not the field it writes.
TASK = "advantages"


def gae(
    rewards_B_T: np.ndarray,
    values_B_T: np.ndarray,
    dones_B_T: np.ndarray | None = None,
    *,
    gamma: float = 0.99,
    lam: float = 0.95,
    bootstrap_B: np.ndarray | None = None,
    done_value_B_T: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over fixed-length rollouts.

    A done at step t ends the episode there: nothing flows back across it, and
    the value after it is ``done_value_B_T[:, t]`` (0 when None: a terminal
    state); the last step of a cut rollout bootstraps from ``bootstrap_B`` (the
    value after it; 0 when None, e.g. without a critic). Returns
    (advantages_B_T, returns_B_T).
    """
    if rewards_B_T.shape != values_B_T.shape:
        raise ShapeMismatch(f"rewards {rewards_B_T.shape} and values {values_B_T.shape} differ")
    if bootstrap_B is not None and bootstrap_B.shape != rewards_B_T.shape[:1]:
        raise ShapeMismatch(f"bootstrap values {bootstrap_B.shape} do not match {rewards_B_T.shape[:1]}")
    t_len = rewards_B_T.shape[1]
    not_done_B_T = (
        1.0 - dones_B_T.astype(np.float32) if dones_B_T is not None else np.ones_like(rewards_B_T)
    )
    adv_B_T = np.zeros_like(rewards_B_T, dtype=np.float32)
    last_B = np.zeros(rewards_B_T.shape[0], dtype=np.float32)
    end_B = np.zeros_like(last_B) if bootstrap_B is None else bootstrap_B.astype(np.float32)
    for t in range(t_len - 1, -1, -1):
        next_v_B = values_B_T[:, t + 1] if t + 1 < t_len else end_B
        nd_B = not_done_B_T[:, t]
        after_B = next_v_B * nd_B
        if done_value_B_T is not None:
            after_B = after_B + done_value_B_T[:, t] * (1.0 - nd_B)
        delta_B = rewards_B_T[:, t] + gamma * after_B - values_B_T[:, t]
        last_B = delta_B + gamma * lam * nd_B * last_B
        adv_B_T[:, t] = last_B
    return adv_B_T, adv_B_T + values_B_T


def done_values(
    rewards_B_T: np.ndarray,
    values_B_T: np.ndarray,
    success_B_T: np.ndarray,
    terminated_B_T: np.ndarray,
    *,
    gamma: float,
) -> np.ndarray:
    """The value after each step that ended an episode (pure).

    A success is an absorbing goal state that keeps paying the reward it paid,
    r / (1 - gamma): without that a dense reward pays more for hovering near the
    goal than for reaching it (the episode ends at success). A time limit
    (truncated, not terminated) cuts an episode that would go on: its step
    bootstraps from the critic (the value of the state it was in, as the next
    observation is not kept). A failure (terminated without success) is worth 0.
    """
    succ = success_B_T.astype(bool)
    cut = ~terminated_B_T.astype(bool) & ~succ
    goal = rewards_B_T / max(1.0 - gamma, 1e-3)
    return np.where(succ, goal, np.where(cut, values_B_T, 0.0)).astype(np.float32)


def group_relative(returns_G: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: each trajectory's return relative to its group's mean, in std units."""
    return ((returns_G - returns_G.mean()) / (returns_G.std() + eps)).astype(np.float32)


def awr_weights(adv_N: np.ndarray, *, beta: float = 1.0, max_weight: float = 20.0) -> np.ndarray:
    """Advantage-weighted regression weights exp(A / beta), normalised advantages, clipped."""
    a = (adv_N - adv_N.mean()) / (adv_N.std() + 1e-6)
    return np.minimum(np.exp(a / beta), max_weight).astype(np.float32)


def to_trajectories(
    env_id_N: np.ndarray, step_N: np.ndarray, *fields_N: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Rows (env, step) -> [envs, steps] arrays, plus the row order to map back."""
    envs = np.unique(env_id_N)
    steps = int(step_N.max()) + 1
    if len(env_id_N) != len(envs) * steps:
        raise ShapeMismatch(
            f"rollout rows do not form whole trajectories: {len(env_id_N)} rows, "
            f"{len(envs)} envs x {steps} steps"
        )
    e_idx = np.searchsorted(envs, env_id_N)
    out = []
    for f in fields_N:
        grid = np.zeros((len(envs), steps), dtype=np.float32)
        grid[e_idx, step_N] = f
        out.append(grid)
    return (e_idx, *out)


class AdvantageAgent:
    """The ``advantages`` stage: GAE per trajectory with the critic's values the
    ``actor_forward`` stage wrote (the last value of a cut rollout bootstraps its
    tail), values 0 for jobs that did not pass through it; or GRPO."""

    def __init__(
        self,
        broker: Broker,
        *,
        instance: str,
        gamma: float = 0.99,
        lam: float = 0.95,
        ack_wait_s: float = 30.0,
    ) -> None:
        self.tq = TrainingQueue(broker)
        self.gamma, self.lam = gamma, lam
        self.worker = StageWorker(
            broker,
            SchedulerClient(broker, by=instance),
            TASK,
            self.work,
            ack_wait_s=ack_wait_s,
        )

    async def work(self, job: TrainingJob) -> int | None:
        critic = uses_actor_forward(job)
        ends = uses_decisions(job)  # the service's rollouts: success and truncation known
        gamma = extra_number(job, "gamma", 1e-3, 1.0, self.gamma)
        lam = extra_number(job, "gae_lambda", 0.0, 1.0, self.lam)
        fields = [ENV_ID_FIELD, STEP_FIELD, REWARDS_FIELD, DONES_FIELD,
                  *([VALUES_FIELD] if critic else []),
                  *([SUCCESS_FIELD, TERMINATED_FIELD] if critic and ends else [])]
        meta = await self.tq.async_get_meta(
            fields,
            job.sample_count or 1 << 30,
            tenant_id=job.tenant_id,
            partition_id=job.partition_id,
            task_name=TASK,
        )
        if not meta.rows:
            return None  # a redelivery after a crash: this task already claimed the rows
        data = await self.tq.async_get_data(meta)
        e_idx, rewards, dones = to_trajectories(
            data[ENV_ID_FIELD], data[STEP_FIELD], data[REWARDS_FIELD], data[DONES_FIELD]
        )
        if job.metadata.extra.get("advantage") == "grpo":
            # Each env's trajectory is one sample of the group; its return, relative
            # to the group, is the advantage of every step in it.
            ret = np.repeat(rewards.sum(axis=1, keepdims=True), rewards.shape[1], axis=1)
            adv = np.repeat(group_relative(rewards.sum(axis=1))[:, None], rewards.shape[1], axis=1)
        elif critic:
            (values,) = to_trajectories(data[ENV_ID_FIELD], data[STEP_FIELD], data[VALUES_FIELD])[1:]
            done_v = None
            if ends:
                success, terminated = to_trajectories(
                    data[ENV_ID_FIELD], data[STEP_FIELD], data[SUCCESS_FIELD], data[TERMINATED_FIELD]
                )[1:]
                done_v = done_values(rewards, values, success, terminated, gamma=gamma)
            adv, ret = gae(
                rewards, values, dones, gamma=gamma, lam=lam, bootstrap_B=values[:, -1],
                done_value_B_T=done_v,
            )
        else:
            adv, ret = gae(rewards, np.zeros_like(rewards), dones, gamma=gamma, lam=lam)
        step = data[STEP_FIELD].astype(np.int64)
        await self.tq.async_put(
            {ADVANTAGES_FIELD: adv[e_idx, step], RETURNS_FIELD: ret[e_idx, step]},
            tenant_id=job.tenant_id,
            metadata=meta,
        )
        return len(meta.rows)
