"""Every tenant's quota as this process sees it: one watcher on the identities bucket.

The control plane, the inference engines and the evaluator check tenants'
requests against :class:`~joynexus.schemas.quotas.Quota`. Each process keeps
one KV watch (not one lookup per request: a request must not cost the server
a consumer), applies changes as they come, and answers the defaults for a
tenant without a record (a deployment without authorization).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.schemas.base import decode
from joynexus.schemas.identities import TenantIdentity, is_applied_key
from joynexus.schemas.quotas import DEFAULT_QUOTA, Quota

log = logging.getLogger(__name__)


class QuotaBook:
    def __init__(self, b: Broker) -> None:
        self.b = b
        self.identities: dict[str, TenantIdentity] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    def get(self, tenant: str) -> Quota:
        ident = self.identities.get(tenant)
        return ident.quota if ident is not None and ident.quota is not None else DEFAULT_QUOTA

    async def start(self, wait_s: float = 5.0) -> None:
        self._task = asyncio.ensure_future(self._watch())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), wait_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    def update(self, ident: TenantIdentity) -> None:
        """Apply a record this process just wrote (read-your-writes)."""
        self.identities[ident.tenant_id] = ident

    async def _watch(self) -> None:
        while True:
            raise_if_cancelled()
            watcher: Any = None
            try:
                kv = await self.b.js.key_value(self.b.names.identities_bucket)
                watcher = await kv.watchall()
                while True:
                    try:
                        entry = await watcher.updates(timeout=5.0)
                    except TimeoutError:
                        continue
                    if entry is None:
                        self._ready.set()
                        continue
                    if is_applied_key(entry.key):
                        continue
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        self.identities.pop(entry.key, None)
                        continue
                    try:
                        ident = decode(entry.value, TenantIdentity)
                    except Exception:  # a bad record: the auth sync reports it; skip
                        log.warning("identity record %r does not decode; skipped", entry.key[:64])
                        continue
                    if ident.tenant_id == entry.key:
                        self.identities[entry.key] = ident
            except Exception as e:  # disconnected, or the bucket not there yet
                raise_if_cancelled()
                log.debug("quota watch restarts: %s", e)
                self._ready.set()
                await asyncio.sleep(1.0)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()
