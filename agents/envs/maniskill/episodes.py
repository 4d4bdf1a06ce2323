"""Episode loops without training: ``run_episodes`` (stoppable, for the evaluator), ``evaluate``.

Success is counted as ManiSkill's "success_once" and episode e resets with
the same seed for every policy, so two policies evaluated with one seed see
the same initial states. The evaluator's stop control and video recorder
plug in through the two Protocols here. See docs/ARCHITECTURE.md,
"Workloads, from the SDK to a new policy version" (evaluations).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from joynexus.agents.envs.maniskill.env import ManiSkillEnv
from joynexus.agents.envs.maniskill.rollout import check_actions, copy_obs, episode_seed
from joynexus.agents.envs.maniskill.spec import ActFn, EnvSpec, ObsBatch
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.samples import OBS_STATE


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
                    actions_N_H_A = check_actions(await act_fn(copy_obs(obs)), spec)
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
