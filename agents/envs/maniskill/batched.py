"""N single envs behind one batch API, whatever the simulator (ManiSkill, LIBERO).

The rollout and episode loops step a ``BatchedEnv``; a simulator's subclass
only converts one env's raw observation and steps or resets its envs, so the
batching, seeds, in-place row writes and closing checks are written once.
See docs/ARCHITECTURE.md, "Simulators by name: ManiSkill and LIBERO" (Same
interface).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from joynexus.agents.envs.maniskill.spec import TASK, EnvSpec, ObsBatch
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch
from joynexus.schemas.samples import OBS_IMAGES, OBS_STATE


def to_numpy(x: Any) -> np.ndarray:
    """A simulator's tensor (torch, on any device) or array-like, as numpy."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


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

