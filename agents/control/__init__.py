"""The control plane: tenant slots and credentials, workload specs, and the
tenant's only door to its own data; one module per job.

- :mod:`.agent`: :class:`ControlPlane`, the micro service ``<ns>-control`` that
  wires the parts below and answers each verb;
- :mod:`.checks`: the pure decisions (a request against the tenant's quota and
  records, names, sizes, pages), tested alone;
- :mod:`.workloads`: workload CRUD; :mod:`.submissions`: tenant jobs (open,
  close, abort, expiry); :mod:`.data`: the data gateway (events, rows, policy
  weights, videos, usage); :mod:`.operator`: the operator API (tenants);
- :mod:`.base`: the state they share and the tenant-scoped lookups.

Every tenant input is hostile (issue 11); see docs/ARCHITECTURE.md ("Layout and
import root", "Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

from joynexus.agents.control.agent import ControlPlane
from joynexus.agents.control.base import InitPolicy
from joynexus.agents.control.checks import (
    MAX_EVENTS_PAGE,
    MAX_EVENTS_WAIT_S,
    MAX_SMALL_REQUEST,
    RESERVED_TENANTS,
    check_rows,
)
from joynexus.schemas.api import ADMIN_VERBS, BIG_VERBS, VERBS

__all__ = [
    "ADMIN_VERBS",
    "BIG_VERBS",
    "MAX_EVENTS_PAGE",
    "MAX_EVENTS_WAIT_S",
    "MAX_SMALL_REQUEST",
    "RESERVED_TENANTS",
    "VERBS",
    "ControlPlane",
    "InitPolicy",
    "check_rows",
]
