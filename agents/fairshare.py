"""Weighted fair shares of the trainer: which tenant is furthest behind (pure).

Each tenant is charged the training work of its completed jobs: a job's rows
(``sample_count``; a step's time grows with its rows, and a count, unlike a
lease's wall time, is not inflated by the actor holding a job while it trains
another group). Its *virtual time* grows by rows / weight (the weight is the
operator's, from its quota's ``share_weight``), and a tenant that comes back
from idle starts at the least virtual time of the tenants under way (no credit
banked while idle: :meth:`FairShare.lift`). A tenant's *lag key* is its virtual
time plus what its jobs already under way will add (``pending`` jobs times its
mean rows per job, over its weight): the lowest is the furthest behind its
weighted share. For display only, the rows are also kept decayed with a
half-life of :data:`HALF_LIFE_S` ("over the last minutes"), and measured
lease-to-completion seconds per row (over every tenant) turn them into trainer
seconds. (Decay is not used for the order: with services minutes apart it biases
the ratio, e.g. weight 2 got 1.8x at a 300 s half-life in the planner.) The lease order (:func:`lease_key`) and the
admission queue (``agents.admission``) both serve the lowest key first.

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
HALF_LIFE_S = 120.0
#: Weight of one new job in a tenant's mean rows per job (and in seconds per row).
COST_ALPHA = 0.2
#: A job's rows before any job completed (only ratios matter).
DEFAULT_ROWS = 1.0
#: A measured lease longer than this is counted as this (a stalled actor).
MAX_COST_S = 600.0


@dataclass
class Share:
    """One tenant's charged rows (decayed, as of ``t``) and mean rows per job."""

    served: float = 0.0
    t: float = 0.0
    cost: float = 0.0
    jobs: int = 0
    #: Rows over weight, since the scheduler started (lifted when it comes back).
    vt: float = 0.0


@dataclass
class FairShare:
    """Every tenant's charged work; pure (``now`` in seconds comes from the caller)."""

    half_life_s: float = HALF_LIFE_S
    shares: dict[str, Share] = field(default_factory=dict)
    #: Mean rows per job over every tenant (a new tenant's estimate).
    mean_cost: float = 0.0
    #: Measured lease-to-completion seconds per row (over every tenant; display).
    seconds_per_row: float = 0.0

    def served(self, tenant: str, now: float) -> float:
        """Rows charged to ``tenant``, decayed to ``now``."""
        s = self.shares.get(tenant)
        if s is None:
            return 0.0
        return s.served * decay(now - s.t, self.half_life_s)

    def trainer_s(self, tenant: str, now: float) -> float:
        """The same as trainer seconds (at the measured seconds per row)."""
        return self.served(tenant, now) * self.seconds_per_row

    def charge(
        self, tenant: str, rows: float, now: float, seconds: float | None = None,
        weight: float = 1.0,
    ) -> None:
        """Charge a completed job's rows (at least 1) at the tenant's ``weight``;
        ``seconds``: its lease's measured length (clamped to 0..MAX_COST_S), for the
        seconds per row."""
        rows = max(float(rows), 1.0)
        s = self.shares.setdefault(tenant, Share(t=now))
        s.served = self.served(tenant, now) + rows
        s.vt += rows / max(weight, 1e-9)
        s.t = now
        s.cost = rows if not s.jobs else s.cost + COST_ALPHA * (rows - s.cost)
        s.jobs += 1
        self.mean_cost = rows if not self.mean_cost else (
            self.mean_cost + COST_ALPHA * (rows - self.mean_cost)
        )
        if seconds is not None:
            per_row = min(max(seconds, 0.0), MAX_COST_S) / rows
            self.seconds_per_row = per_row if not self.seconds_per_row else (
                self.seconds_per_row + COST_ALPHA * (per_row - self.seconds_per_row)
            )

    def job_cost(self, tenant: str) -> float:
        """The tenant's mean rows per job (a new tenant: everyone's)."""
        s = self.shares.get(tenant)
        if s is not None and s.jobs:
            return s.cost
        return self.mean_cost or DEFAULT_ROWS

    def vt(self, tenant: str) -> float:
        s = self.shares.get(tenant)
        return s.vt if s is not None else 0.0

    def lift(self, tenant: str, floor: float, now: float) -> None:
        """A tenant coming back from idle: its virtual time at least ``floor`` (the
        least of the tenants under way), so idle time banks no credit."""
        s = self.shares.setdefault(tenant, Share(t=now))
        s.vt = max(s.vt, floor)

    def lag_key(self, tenant: str, weight: float, pending: int, now: float) -> float:
        """Virtual time plus ``pending`` jobs' expected rows over the weight (lower:
        further behind its weighted share). ``now`` is not used by the order."""
        return self.vt(tenant) + pending * self.job_cost(tenant) / max(weight, 1e-9)

    def report(self, weights: dict[str, float], now: float) -> dict[str, tuple[float, float]]:
        """Per tenant of ``weights`` (the tenants competing now): (its share of the
        charged work, its weighted fair share), each in 0..1."""
        served = {t: self.served(t, now) for t in weights}
        total, wsum = sum(served.values()), sum(weights.values())
        return {
            t: (served[t] / total if total else 0.0, weights[t] / wsum if wsum else 0.0)
            for t in weights
        }


@dataclass(frozen=True)
class Past:
    """One job as the log holds it at a (re)start: its tenant, the log sequence of its
    admission and of its end (0: under way), its rows if it completed (None: it
    failed, was dropped, or is under way), its tenant's weight, and when it ended
    (``now``'s clock: the decayed display only)."""

    tenant: str
    admitted: int
    ended: int = 0
    rows: int | None = None
    weight: float = 1.0
    at: float = 0.0


def replay(past: list[Past], now: float, half_life_s: float = HALF_LIFE_S) -> FairShare:
    """The charges and virtual times the live scheduler made, rebuilt from the log
    (a restart, a standby's takeover): admissions and ends in log order; each
    completion charged as ``commit`` charged it, each tenant admitted while idle
    lifted as ``_admitted`` lifted it. Lease seconds are not in the log: the
    seconds per row (display) start again from the next completion."""
    fair = FairShare(half_life_s=half_life_s)
    steps: list[tuple[int, int, Past]] = []
    for p in past:
        steps.append((p.admitted, 0, p))
        if p.ended:
            steps.append((p.ended, 1, p))
    steps.sort(key=lambda s: (s[0], s[1]))
    under_way: dict[str, int] = {}
    for _seq, kind, p in steps:
        if kind == 0:
            under_way[p.tenant] = under_way.get(p.tenant, 0) + 1
            if under_way[p.tenant] == 1:
                floor = min((fair.vt(t) for t in under_way if t != p.tenant), default=None)
                if floor is not None:
                    fair.lift(p.tenant, floor, now)
            continue
        under_way[p.tenant] -= 1
        if not under_way[p.tenant]:
            del under_way[p.tenant]  # only tenants under way are scanned for a floor
        if p.rows is not None:
            fair.charge(p.tenant, p.rows, p.at, None, weight=p.weight)
    return fair


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
    "Past",
    "Share",
    "admission_key",
    "decay",
    "jain",
    "lease_key",
    "replay",
]
