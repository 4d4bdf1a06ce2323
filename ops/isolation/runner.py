"""One attack, measured: a baseline window of the victim, then the attack with the victim probed.

The victim is fine when its calls all succeeded, its training advanced, no
security event was filed under it, and its p99 during the attack was within
:data:`P99_RATIO_BOUND` times its baseline's or under :data:`P99_ABS_BOUND_S`
(generous: a 2-core machine is noisy). :func:`prepare` issues the tenants and
trains the victim once. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from joynexus.ops.isolation.deployment import (
    ATTACKER,
    ATTACKER_TQ_BYTES,
    SecuredDeployment,
)
from joynexus.ops.isolation.kit import (
    Attack,
    AttackResult,
)
from joynexus.ops.isolation.victim import Stats, Victim

log = logging.getLogger(__name__)


#: The victim is within bound when its p99 during an attack is at most this many
#: times its baseline p99, or at most this many seconds.
P99_RATIO_BOUND = 5.0
P99_ABS_BOUND_S = 1.5
#: The targets an attack within quota is judged by (issue 24): the victim's p50
#: within 2x of its baseline, its p99 within 3x, its training rate at least 0.7x.
#: Reported per attack (``within_target``), not asserted by the suite: a 2-core
#: machine running the attacker, the victim and every agent is too noisy for that.
P50_TARGET = 2.0
P99_TARGET = 3.0
TRAIN_RATE_TARGET = 0.7


@dataclass
class Outcome:
    name: str
    klass: str
    held: bool
    detail: str
    baseline: Stats
    during: Stats
    progressed: bool
    seconds: float
    victim_events: int = 0

    @property
    def p50_ratio(self) -> float:
        return round(self.during.p50 / self.baseline.p50, 2) if self.baseline.p50 else 0.0

    @property
    def p99_ratio(self) -> float:
        return round(self.during.p99 / self.baseline.p99, 2) if self.baseline.p99 else 0.0

    @property
    def train_rate_ratio(self) -> float | None:
        b, d = self.baseline.train_rate, self.during.train_rate
        return round(d / b, 2) if b and d is not None else None

    @property
    def within_target(self) -> bool:
        rate = self.train_rate_ratio
        return (self.p50_ratio <= P50_TARGET and self.p99_ratio <= P99_TARGET
                and (rate is None or rate >= TRAIN_RATE_TARGET))

    @property
    def within_bound(self) -> bool:
        return self.during.p99 <= max(P99_RATIO_BOUND * self.baseline.p99, P99_ABS_BOUND_S)

    @property
    def victim_ok(self) -> bool:
        return (self.progressed and self.within_bound and not self.during.errors
                and not self.victim_events)

    def victim_detail(self) -> str:
        return (f"victim: baseline {self.baseline.brief()}, during {self.during.brief()}, "
                f"p99 ratio {self.p99_ratio} (bound {P99_RATIO_BOUND}x or "
                f"{P99_ABS_BOUND_S}s), progressed={self.progressed}, "
                f"security events under it {self.victim_events}, "
                f"errors {self.during.errors[:3]}")

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name, "class": self.klass, "held": self.held,
            "victim_ok": self.victim_ok,
            "victim_p50_ratio": self.p50_ratio, "victim_p99_ratio": self.p99_ratio,
            "victim_train_rate_ratio": self.train_rate_ratio,
            "within_target": self.within_target,
            "victim_p50_ms": round(self.during.p50 * 1000, 1),
            "baseline_p50_ms": round(self.baseline.p50 * 1000, 1),
            "victim_p99_ms": round(self.during.p99 * 1000, 1),
            "baseline_p99_ms": round(self.baseline.p99 * 1000, 1),
            "victim_slowest": [{"call": c, "ms": round(x * 1000, 1), "at_s": round(at, 2)}
                               for c, x, at in self.during.slowest],
            "victim_errors": len(self.during.errors),
            "victim_error_sample": self.during.errors[:3],
            "victim_progressed": self.progressed, "seconds": self.seconds,
            "detail": self.detail,
        }


async def run_attack(
    dep: SecuredDeployment, victim: Victim, attack: Attack, *, attacker: str = ATTACKER,
    baseline_s: float = 2.0,
) -> Outcome:
    """A baseline window of the victim, then the attack with the victim probed."""
    base = await victim.baseline(baseline_s)
    seq0 = await dep.metrics_seq()

    async def go() -> AttackResult:
        try:
            return await asyncio.wait_for(attack.run(dep, attacker, victim.tenant),
                                          attack.timeout_s)
        except TimeoutError:
            return AttackResult(False, f"the attack did not finish within {attack.timeout_s}s")
        except Exception as e:
            log.exception("attack %s raised", attack.name)
            return AttackResult(False, f"the attack raised {type(e).__name__}: {str(e)[:300]}")

    result, during, progressed, took = await victim.during(go())
    victim_events = len(await dep.security_events(victim.tenant, seq0))
    return Outcome(attack.name, attack.klass, result.held, result.detail, base, during,
                   progressed, took, victim_events)


async def prepare(dep: SecuredDeployment) -> Victim:
    """The tenants (the attacker with an operator-set Training Queue quota) and the
    victim's workload trained once."""
    await dep.issue(ATTACKER, tq_bytes=ATTACKER_TQ_BYTES)
    victim = Victim(dep)
    await victim.start()
    return victim
