"""Every tenant's quota as this process sees it: one watcher on the identities bucket.

The control plane and the inference engines check every request against a
:class:`~joynexus.schemas.quotas.Quota`; a mirror of the identities bucket
(one watch, not one lookup per request) answers it, with the defaults for a
tenant without a record (a deployment without authorization).

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

from joynexus.broker.connection import Broker
from joynexus.broker.kvmirror import KVMirror
from joynexus.schemas.identities import TenantIdentity, is_bookkeeping_key
from joynexus.schemas.quotas import DEFAULT_QUOTA, Quota


class QuotaBook:
    def __init__(self, b: Broker) -> None:
        self._mirror = KVMirror(
            b, b.names.identities_bucket, TenantIdentity,
            skip=is_bookkeeping_key, belongs=lambda key, ident: ident.tenant_id == key,
        )

    @property
    def identities(self) -> dict[str, TenantIdentity]:
        return self._mirror.values

    def get(self, tenant: str) -> Quota:
        ident = self._mirror.values.get(tenant)
        return ident.quota if ident is not None and ident.quota is not None else DEFAULT_QUOTA

    async def start(self, wait_s: float = 5.0) -> None:
        await self._mirror.start(wait_s)

    async def stop(self) -> None:
        await self._mirror.stop()

    def update(self, ident: TenantIdentity) -> None:
        """Apply a record this process just wrote (read-your-writes)."""
        self._mirror.put(ident.tenant_id, ident)
