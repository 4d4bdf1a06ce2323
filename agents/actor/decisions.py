"""The actor's decisions, pure (no connection, no torch): which leased jobs form a
group, which Training Queue fields a job's step reads, what a job whose data
does not load becomes, and what each tenant's outcome of a shared step does.

The loop in :mod:`joynexus.agents.actor.agent` runs these between its named steps;
``tests/unit/test_actor_decisions.py`` tables them alone. A group's step is
all-or-nothing per tenant: one tenant's failed item fails that tenant's job
only, and every other tenant of the group commits, publishes and completes.
See docs/ARCHITECTURE.md ("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import nats.errors

from joynexus.schemas.errors import InvalidSpec, JoyNexusError
from joynexus.schemas.samples import ACTIONS_FIELD, DECISION_FIELD, STATE_FIELD, image_field

#: Training Queue fields an RL job's step reads besides state, actions and images.
ADVANTAGES_FIELD = "advantages"
RETURNS_FIELD = "returns"

#: Job ids a tenant's checkpoint remembers as applied (the oldest are forgotten).
KEEP_APPLIED = 4096

J = TypeVar("J")


def form_group(pending: Sequence[J], key: Callable[[J], Hashable]) -> tuple[list[J], list[J]]:
    """One job per tenant policy (``key``) per step, in lease order: the group,
    and the jobs that stay pending for a later step (a tenant's second job waits
    for its first: its step starts from the version the first one makes)."""
    group: list[J] = []
    rest: list[J] = []
    seen: set[Hashable] = set()
    for job in pending:
        k = key(job)
        if k in seen:
            rest.append(job)
        else:
            seen.add(k)
            group.append(job)
    return group, rest


def is_ppo(task_type: str, *, gaussian: bool, actor_forward: bool) -> bool:
    """PPO needs a tractable likelihood (a Gaussian head) and the behaviour
    log-probabilities the ``actor_forward`` stage wrote; other RL jobs are AWR."""
    return task_type == "rl" and gaussian and actor_forward


def fields_to_read(
    task_type: str,
    camera_slots: Iterable[str],
    *,
    ppo: bool,
    decisions: bool,
    old_logp_field: str,
) -> list[str]:
    """The Training Queue fields one job's step reads, in a fixed order."""
    fields = [STATE_FIELD, ACTIONS_FIELD, *[image_field(s) for s in camera_slots]]
    if task_type == "rl":
        fields.append(ADVANTAGES_FIELD)
    if ppo:
        fields += [RETURNS_FIELD, old_logp_field]
        if decisions:
            fields.append(DECISION_FIELD)
    return fields


def infrastructure(e: BaseException) -> bool:
    """Errors of the connection or the machine, not of a job's data: the actor
    cannot do its work and should stop (and be restarted) rather than fail jobs."""
    return isinstance(e, (nats.errors.Error, OSError, MemoryError))


def load_failure(e: Exception) -> JoyNexusError | None:
    """What a job whose state or data did not load becomes: its own typed error,
    or an ``InvalidSpec`` naming what went wrong; None where the actor itself
    cannot work (``infrastructure``): it raises, and the job is retried elsewhere."""
    if isinstance(e, JoyNexusError):
        return e
    if infrastructure(e):
        return None
    return InvalidSpec(f"its data could not be loaded: {type(e).__name__}: {e}")


@dataclass(frozen=True)
class StepOutcome:
    """What one tenant's item of a group step leads to."""

    action: Literal["commit", "fail"]
    loss: float | None = None
    error: JoyNexusError | None = None


def step_outcomes(losses: Sequence[float | JoyNexusError]) -> list[StepOutcome]:
    """Each item on its own: a loss commits that tenant's step (checkpoint,
    publish, complete); an error means its module did not step, so there is
    nothing to save or publish and that job alone fails."""
    return [
        StepOutcome("fail", error=x) if isinstance(x, JoyNexusError) else StepOutcome("commit", loss=float(x))
        for x in losses
    ]


def tenant_rows(rows: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Rows per tenant in a step (usage metering splits the step's time by them)."""
    out: dict[str, int] = {}
    for tenant, n in rows:
        out[tenant] = out.get(tenant, 0) + int(n)
    return out


def remember_applied(applied: dict[str, int], job_id: str, version: int, keep: int = KEEP_APPLIED) -> None:
    """Record that ``job_id`` made ``version``; forget the oldest beyond ``keep``."""
    applied[job_id] = version
    while len(applied) > keep:
        applied.pop(next(iter(applied)))
