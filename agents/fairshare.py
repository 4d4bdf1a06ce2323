"""Weighted fair shares of the trainer: which tenant is furthest behind (pure).

Each tenant is charged the trainer time its jobs took (a job's lease to its
completion, measured by the scheduler's clock), decayed with a half-life of
:data:`HALF_LIFE_S` so that a share means "over the last minutes". A tenant's
*lag key* is its charged time plus what its jobs already under way will cost
(``pending`` jobs times its mean cost per job), divided by its weight (the
operator's, from its quota's ``share_weight``): the lowest key is the furthest
behind its weighted share. The lease order (:func:`lease_key`) and the admission
queue (``SchedulerCore.admission_rank``) both serve the lowest key first.

How it combines with the paper's rules: priority stays strict (a higher class's
ready job is always leased first); among equal priority the tenant furthest
behind wins; RL before SFT then decides between equally placed tenants and,
above all, inside a tenant (its RL job before its SFT job: the one that goes
stale); ready order (FIFO) last. Nothing here reads a clock: ``now`` is passed.

See docs/ARCHITECTURE.md, "Fair shares of the trainer".
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Charged trainer time halves every this many seconds ("the last minutes").
HALF_LIFE_S = 60.0
#: Weight of one new measurement in a tenant's mean cost per job.
COST_ALPHA = 0.2
#: A job's cost before anything was measured (seconds; only ratios matter).
DEFAULT_COST_S = 1.0
#: A measured lease longer than this is counted as this (a stalled actor).
MAX_COST_S = 600.0


@dataclass
class Share:
    """One tenant's charged trainer time (decayed, as of ``t``) and mean cost per job."""

    served: float = 0.0
    t: float = 0.0
    cost: float = 0.0
    jobs: int = 0


@dataclass
class FairShare:
    """Every tenant's charged trainer time; pure (``now`` in seconds comes from the caller)."""

    half_life_s: float = HALF_LIFE_S
    shares: dict[str, Share] = field(default_factory=dict)
    #: Mean cost per job over every tenant (a new tenant's estimate).
    mean_cost: float = 0.0

    def served(self, tenant: str, now: float) -> float:
        """Trainer seconds charged to ``tenant``, decayed to ``now``."""
        s = self.shares.get(tenant)
        if s is None:
            return 0.0
        return s.served * decay(now - s.t, self.half_life_s)

    def charge(self, tenant: str, seconds: float, now: float) -> None:
        """Charge a completed job's trainer time (clamped to 0..MAX_COST_S)."""
        seconds = min(max(seconds, 0.0), MAX_COST_S)
        s = self.shares.setdefault(tenant, Share(t=now))
        s.served = self.served(tenant, now) + seconds
        s.t = now
        s.cost = seconds if not s.jobs else s.cost + COST_ALPHA * (seconds - s.cost)
        s.jobs += 1
        self.mean_cost = seconds if not self.mean_cost else (
            self.mean_cost + COST_ALPHA * (seconds - self.mean_cost)
        )

    def job_cost(self, tenant: str) -> float:
        s = self.shares.get(tenant)
        if s is not None and s.jobs:
            return s.cost
        return self.mean_cost or DEFAULT_COST_S

    def lag_key(self, tenant: str, weight: float, pending: int, now: float) -> float:
        """Charged time plus ``pending`` jobs' expected cost, per unit of weight
        (lower: further behind its weighted share)."""
        return (self.served(tenant, now) + pending * self.job_cost(tenant)) / max(weight, 1e-9)

    def report(self, weights: dict[str, float], now: float) -> dict[str, tuple[float, float]]:
        """Per tenant of ``weights`` (the tenants competing now): (its share of the
        charged trainer time, its weighted fair share), each in 0..1."""
        served = {t: self.served(t, now) for t in weights}
        total, wsum = sum(served.values()), sum(weights.values())
        return {
            t: (served[t] / total if total else 0.0, weights[t] / wsum if wsum else 0.0)
            for t in weights
        }


def decay(dt: float, half_life_s: float) -> float:
    """The factor a charge keeps after ``dt`` seconds."""
    if dt <= 0 or half_life_s <= 0:
        return 1.0
    return float(0.5 ** (dt / half_life_s))


def lease_key(
    priority: int, lag: float, task_type: str, ready_seq: int
) -> tuple[int, float, int, int]:
    """The actor's lease order, lowest first: priority (strict, higher first), then the
    tenant furthest behind its weighted share (``lag``), then RL before SFT, then
    ready order."""
    return (-priority, lag, 0 if task_type == "rl" else 1, ready_seq)


def admission_key(priority: int, lag: float, since: float) -> tuple[int, float, float]:
    """The admission queue's order, lowest first: priority, the tenant furthest behind
    (counting its jobs in flight as already served), then arrival."""
    return (-priority, lag, since)


def jain(xs: list[float]) -> float | None:
    """Jain's fairness index of ``xs`` (1: all equal; 1/n: one takes all)."""
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


__all__ = [
    "HALF_LIFE_S",
    "FairShare",
    "Share",
    "admission_key",
    "decay",
    "jain",
    "lease_key",
]
