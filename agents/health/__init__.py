"""Heartbeats, error reports and the health manager that restarts failed roles in place;
one module per job.

- :mod:`.core`: :class:`HealthCore`, the pure decisions (beats, exits, expiries,
  connection state -> restart, global restart, give up), and :class:`RestartBudget`;
- :mod:`.heartbeat`: :class:`Heartbeater`, an agent's beats from a thread of its own,
  and the count of the errors it logs;
- :mod:`.manager`: :class:`HealthManager`, which owns the role processes
  (:class:`RoleSlot`: spawn, logs, kill, restart) or only watches beats.

The records they exchange (:class:`Heartbeat`, :class:`HealthDecision`,
:class:`SlotState`, :class:`SupervisorState`) are in :mod:`joynexus.schemas.health`
and re-exported here. See docs/ARCHITECTURE.md ("Health: heartbeats and in-place
restarts", "Layout and import root").
"""

from __future__ import annotations

from joynexus.agents.health.core import (
    HEARTBEAT_S,
    MISS_AFTER,
    HealthCore,
    RestartBudget,
    ttl_for,
)
from joynexus.agents.health.heartbeat import Heartbeater
from joynexus.agents.health.manager import SUPERVISED_ELSEWHERE, HealthManager, RoleSlot
from joynexus.schemas.health import (
    Action,
    HealthDecision,
    Heartbeat,
    SlotState,
    SupervisorState,
)

__all__ = [
    "HEARTBEAT_S",
    "MISS_AFTER",
    "SUPERVISED_ELSEWHERE",
    "Action",
    "HealthCore",
    "HealthDecision",
    "HealthManager",
    "Heartbeat",
    "Heartbeater",
    "RestartBudget",
    "RoleSlot",
    "SlotState",
    "SupervisorState",
    "ttl_for",
]
