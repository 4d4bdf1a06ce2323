"""The penalty box: tenants paused for flooding, as the auth sync applies them.

The control plane counts each tenant's messages at its door (agents/control/door.py)
and, past the tenant's ``max_requests_per_s``, writes a ``Penalty`` record
(``_penalty.<tenant>`` in the identities bucket: only the control plane's identity
may write there). The auth sync renders every tenant but the paused ones into
``auth.conf``; the server's reload closes the paused tenant's connections and
refuses its logins until the pause ends, when the next render puts it back. So a
flood is dropped by the server instead of being parsed, one message at a time, on
the control plane's one connection. A pause is bounded (:data:`MAX_PAUSE_S`) whatever
the record says, so a bad record cannot lock a tenant out for long.
"""

from __future__ import annotations

import logging
import time

from joynexus.schemas.base import decode
from joynexus.schemas.identities import Penalty
from joynexus.schemas.jobs import check_name

__all__ = ["MAX_PAUSE_S", "PenaltyBox"]

log = logging.getLogger(__name__)

#: The longest pause a record can impose, counted from when the auth sync reads it.
MAX_PAUSE_S = 16 * 60.0


class PenaltyBox:
    """Which tenants of each identities bucket are paused, until when (wall clock)."""

    def __init__(self) -> None:
        self._until: dict[str, dict[str, float]] = {}

    def update(self, bucket: str, tenant: str, value: bytes | None, now: float | None = None) -> float | None:
        """Apply a penalty record of ``tenant`` (``None``: deleted). Returns when the pause
        ends, or None if there is none (a record that does not decode is ignored)."""
        now = time.time() if now is None else now
        paused = self._until.setdefault(bucket, {})
        if value is None:
            paused.pop(tenant, None)
            return None
        try:
            check_name("tenant", tenant)
            p = decode(value, Penalty, what="penalty record")
            if p.tenant_id != tenant:
                raise ValueError(f"names tenant {p.tenant_id!r}, not its key's")
        except Exception as e:
            log.error("penalty record of %r in %s not applied: %s", tenant[:64], bucket, e)
            paused.pop(tenant, None)
            return None
        until = min(float(p.until), now + MAX_PAUSE_S)
        if until <= now:
            paused.pop(tenant, None)
            return None
        paused[tenant] = until
        return until

    def paused(self, bucket: str, now: float | None = None) -> set[str]:
        now = time.time() if now is None else now
        return {t for t, until in self._until.get(bucket, {}).items() if until > now}
