"""What a job's ``metadata.extra`` says, read as decisions (pure, no torch): whether
its producer routed it through the ``actor_forward`` stage, whether its rows mark
the policy's decisions, its numbers (gamma, the exploration floor...) within bounds.

The advantage stage (numpy only) and the actor read them alike; they were in
:mod:`joynexus.agents.actor.forward`, which re-exports them. See docs/ARCHITECTURE.md
("Policies that learn", "Light roles").
"""

from __future__ import annotations

import math

from joynexus.schemas.jobs import TrainingJob

__all__ = [
    "MAX_EXPLORATION_STD",
    "exploration_floor",
    "extra_number",
    "uses_actor_forward",
    "uses_decisions",
]

#: Exploration std bounds (env action units); the spec validates the same.
MAX_EXPLORATION_STD = 1.0


def uses_actor_forward(job: TrainingJob) -> bool:
    """The job was routed through this stage (its producer said so)."""
    return job.metadata.extra.get("actor_forward") == "1"


def extra_number(job: TrainingJob, key: str, lo: float, hi: float, default: float = 0.0) -> float:
    """A number of the job's metadata, ``default`` where absent, unreadable or outside [lo, hi]."""
    raw = job.metadata.extra.get(key, "")
    try:
        v = float(raw) if raw else default
    except ValueError:
        return default
    return v if math.isfinite(v) and lo <= v <= hi else default


def exploration_floor(job: TrainingJob) -> float:
    """The std floor (env action units) the job's rollout sampled with; 0 if none."""
    return extra_number(job, "exploration_std", 0.0, MAX_EXPLORATION_STD)


def uses_decisions(job: TrainingJob) -> bool:
    """The job's rows say where the policy decided (``DECISION_FIELD``)."""
    return job.metadata.extra.get("decisions") == "1"
