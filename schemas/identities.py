"""Tenant identities: the NATS users the control plane issues, and the operator API.

The record a tenant's access hangs on: the bcrypt hash of a password the
operator's client generated (the password never leaves the operator's
machine) and the tenant's quota, in the identities bucket under the tenant's
name; each server's auth sync renders the bucket into its authorization and
records the revision it applied under ``_applied.<server name>``.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

from typing import Literal

from joynexus.schemas.base import Wire
from joynexus.schemas.quotas import Quota
from joynexus.schemas.scheduler import ErrorBody

#: Keys in the identities bucket where each server's auth sync records what it
#: applied: ``_applied.<server name>`` (one per node of a cluster).
APPLIED_KEY = "_applied"


def applied_key(server_name: str) -> str:
    return f"{APPLIED_KEY}.{server_name}"


def is_applied_key(key: str) -> bool:
    return key == APPLIED_KEY or key.startswith(APPLIED_KEY + ".")


#: ``_penalty.<tenant>``: a tenant paused for flooding the control plane (``Penalty``).
PENALTY_KEY = "_penalty"


def penalty_key(tenant_id: str) -> str:
    return f"{PENALTY_KEY}.{tenant_id}"


def penalised_tenant(key: str) -> str | None:
    """The tenant a penalty key names, or None for another key."""
    return key[len(PENALTY_KEY) + 1:] if key.startswith(PENALTY_KEY + ".") else None


def is_bookkeeping_key(key: str) -> bool:
    """A key of the identities bucket that holds no tenant (``_applied.*``, ``_penalty.*``)."""
    return is_applied_key(key) or penalised_tenant(key) is not None


class Penalty(Wire, kw_only=True):
    """A tenant's user is off the server until ``until`` (wall clock): the control plane
    counted ``rate`` messages a second from it, over its ``max_requests_per_s``."""

    tenant_id: str
    until: float
    rate: int
    #: How many penalties in a row (each doubles the pause, up to 16x).
    strikes: int = 1


class TenantIdentity(Wire, kw_only=True, omit_defaults=True):
    tenant_id: str
    user: str
    #: bcrypt hash of the password (the password itself is never stored).
    password_hash: str
    created_at: float = 0.0
    rotated_at: float = 0.0
    #: Operator-set bounds and priority class (None: the defaults).
    quota: Quota | None = None


class AuthApplied(Wire, kw_only=True):
    """What the server's authorization was last rendered from."""

    revision: int
    tenants: list[str]
    at: float


class TenantRequest(Wire, kw_only=True, omit_defaults=True):
    tenant: str = ""
    #: tenant_add of an existing tenant: issue a new password (the old one stops working).
    rotate: bool = False
    #: tenant_add: the bcrypt hash of the password the operator's client generated
    #: (the password itself never travels). Empty: keep the current one (tenant_set).
    password_hash: str = ""
    #: tenant_add / tenant_set: the tenant's quota (None: keep it; a new tenant: defaults).
    quota: Quota | None = None
    #: tenant_remove: also cancel the tenant's active workloads.
    cancel_workloads: bool = True
    #: How long to wait for the server to apply the change.
    wait_s: float = 10.0


class TenantInfo(Wire, kw_only=True, omit_defaults=True):
    tenant_id: str
    user: str
    created_at: float = 0.0
    rotated_at: float = 0.0
    workloads: int = 0
    active_workloads: int = 0
    quota: Quota | None = None
    #: What the tenant holds now (the control plane's view): tq_bytes, open_jobs,
    #: requests_in_flight.
    usage: dict[str, int] = {}


class AdminReply(Wire, kw_only=True, omit_defaults=True):
    tenant: TenantInfo | None = None
    tenants: list[TenantInfo] = []
    #: Whether the server applied the change before the reply (``pending``: no
    #: auth sync acknowledged it in time, e.g. an external server or authorization off).
    applied: Literal["yes", "pending", "off"] = "yes"
    cancelled: list[str] = []
    error: ErrorBody | None = None
