"""What a tenant's RL run reports on the metrics subjects, gathered per 10 updates for the
learning benchmark's ``rl_curve`` (``ops/bench/learning.py``).

See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

from typing import Any

__all__ = ["RLCurve"]


class RLCurve:
    """What the tenant's RL run reports on the metrics subjects, every 10 updates: the
    success of the episodes its rollouts ended (behaviour policy, with exploration) and the actor's PPO
    statistics (losses, clip fraction, KL, the adaptive step's learning rate)."""

    KEYS = ("policy_loss", "value_loss", "clip_frac", "approx_kl", "kl_after", "lr")

    def __init__(self, workload: str, every: int = 10) -> None:
        self.workload, self.every = workload, every
        self.rows: list[dict[str, Any]] = []
        self._ended = self._succeeded = 0
        self._stats: dict[str, list[float]] = {k: [] for k in self.KEYS}
        self._updates = 0

    def take(self, m: dict[str, Any]) -> dict[str, Any] | None:
        if m.get("workload") != self.workload:
            return None
        if "episodes_ended" in m:
            self._ended += int(m["episodes_ended"])
            self._succeeded += int(m.get("episodes_succeeded", 0))
        if "loss" in m and "version" in m:
            self._updates += 1
            for k in self.KEYS:
                if k in m:
                    self._stats[k].append(float(m[k]))
            if self._updates % self.every == 0:
                return self._flush(int(m["version"]))
        return None

    def _flush(self, version: int) -> dict[str, Any]:
        def mean(xs: list[float]) -> float | None:
            return round(sum(xs) / len(xs), 6) if xs else None

        # success of the episodes the rollouts ended (behaviour policy, with exploration)
        rate = round(self._succeeded / self._ended, 4) if self._ended else None
        row = {"version": version, "rollout_success": rate, "rollout_episodes": self._ended,
               **{k: mean(v) for k, v in self._stats.items()}}
        self.rows.append(row)
        self._ended = self._succeeded = 0
        self._stats = {k: [] for k in self.KEYS}
        return row
