"""What a stochastic policy executes: its mean action plus its std times noise,
clipped to the action bounds. Shared by RL rollouts (``producers/rl.py``) and
sampled evaluations (``evalrun.py``); numpy only, so the evaluator stays light
(no torch until it builds an env)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["sample_around"]


def sample_around(mean: np.ndarray, std: Any, rng: np.random.Generator) -> np.ndarray:
    """``mean`` plus ``std`` times standard normal noise, clipped to the action bounds
    [-1, 1]: the policy's own distribution, as RL rollouts and sampled evaluations act."""
    noise = rng.normal(0.0, 1.0, mean.shape).astype(np.float32) * std
    return np.clip(mean + noise, -1.0, 1.0)
