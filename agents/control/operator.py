"""The operator API (``<ns>.admin.<verb>``, the admin identity only): issue a
tenant its NATS user (a bcrypt hash stored, never the password), set its
quota, revoke it (cancelling its active workloads), list tenants. The server's
auth sync applies a change without a restart; the reply waits until it has.

See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from nats.js.errors import KeyNotFoundError

from joynexus.agents.control.base import ControlBase
from joynexus.agents.control.checks import (
    applied_state,
    check_new_tenant,
    count_active,
    issued_identity,
)
from joynexus.broker import kvwatch, metrics
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import InvalidSpec, UnknownTenant
from joynexus.schemas.identities import (
    APPLIED_KEY,
    AdminReply,
    AuthApplied,
    TenantIdentity,
    TenantInfo,
    TenantRequest,
    is_bookkeeping_key,
)
from joynexus.schemas.jobs import check_name

log = logging.getLogger(__name__)


class OperatorAPI(ControlBase):
    async def _identity(self, tenant: str) -> TenantIdentity | None:
        try:
            entry = await self._ids.get(tenant)
        except KeyNotFoundError:
            return None
        return decode(entry.value, TenantIdentity) if entry.value else None

    async def _wait_applied(self, revision: int, wait_s: float) -> str:
        """'yes' once every server's auth sync (one per node) applied ``revision``;
        'off' when none answers for this namespace (authorization off, or an
        external server); 'pending' if one did not apply it in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        # An auth sync finds a new bucket at once (an advisory) or within 0.5 s.
        discover_deadline = loop.time() + min(wait_s, 5.0)
        applied: dict[str, int] = {}
        watcher = await self._ids.watch(f"{APPLIED_KEY}.>")
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    entry = await watcher.updates(timeout=0.25)
                    if entry is not None and entry.operation in ("DEL", "PURGE"):
                        applied.pop(entry.key, None)
                    elif entry is not None and entry.value:
                        applied[entry.key] = decode(entry.value, AuthApplied).revision
                state = applied_state(applied, revision, loop.time(), discover_deadline, deadline)
                if state is not None:
                    return state
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _tenant_info(self, ident: TenantIdentity) -> TenantInfo:
        records = await self._records(ident.tenant_id)
        return TenantInfo(
            tenant_id=ident.tenant_id,
            user=ident.user,
            created_at=ident.created_at,
            rotated_at=ident.rotated_at,
            workloads=len(records),
            active_workloads=count_active(records),
            quota=ident.quota,
            usage=self.usage(ident.tenant_id),
        )

    async def _tenant_add(self, req: TenantRequest) -> AdminReply:
        tenant = check_new_tenant(req)
        async with self._lock:
            old = await self._identity(tenant)
            ident = issued_identity(req, tenant, self.n.tenant_user(tenant), old, time.time())
            revision = await self._ids.put(tenant, encode(ident))
            self.quotas.update(ident)
        applied = await self._wait_applied(revision, req.wait_s)
        return AdminReply(tenant=await self._tenant_info(ident), applied=applied)  # type: ignore[arg-type]

    async def _tenant_set(self, req: TenantRequest) -> AdminReply:
        tenant = check_name("tenant", req.tenant)
        if req.quota is None:
            raise InvalidSpec("tenant_set needs quota (joynexus tenant set NAME --quota KEY=VALUE)")
        async with self._lock:
            old = await self._identity(tenant)
            if old is None:
                raise UnknownTenant(f"no tenant {tenant!r}; add it first (joynexus tenant add)")
            ident = msgspec.structs.replace(old, quota=req.quota)
            revision = await self._ids.put(tenant, encode(ident))
            self.quotas.update(ident)
        applied = await self._wait_applied(revision, req.wait_s)
        return AdminReply(tenant=await self._tenant_info(ident), applied=applied)  # type: ignore[arg-type]

    async def _tenant_remove(self, req: TenantRequest) -> AdminReply:
        tenant = check_name("tenant", req.tenant)
        async with self._lock:
            ident = await self._identity(tenant)
            if ident is None:
                raise UnknownTenant(f"tenant {tenant!r} has no credentials to revoke")
            await self._ids.delete(tenant)
            await self.revoke_tenant_keys(tenant)  # agents/control/apikeys.py
            # The delete marker's revision, or a later one: applying either applies ours.
            entry_rev = await self._last_revision()
        cancelled = []
        if req.cancel_workloads:
            for rec in await self._records(tenant):
                if rec.state == "active":
                    await self._cancel(tenant, rec.spec.name)
                    cancelled.append(rec.spec.name)
        applied = await self._wait_applied(entry_rev, req.wait_s)
        return AdminReply(tenant=await self._tenant_info(ident), applied=applied, cancelled=cancelled)  # type: ignore[arg-type]

    async def _last_revision(self) -> int:
        info = await self.b.js.stream_info(f"KV_{self.n.identities_bucket}")
        return int(info.state.last_seq)

    async def _tenant_list(self, _req: TenantRequest) -> AdminReply:
        infos = []
        for key in await self._identity_keys():
            try:
                ident = await self._identity(key)
            except Exception:  # a record that does not decode: list the others
                log.warning("identity record %r does not decode", metrics.clip(key, 64))
                continue
            if ident is not None:
                infos.append(await self._tenant_info(ident))
        return AdminReply(tenants=infos)

    async def _identity_keys(self) -> list[str]:
        keys = await kvwatch.keys(self._ids)
        return sorted(k for k in keys if not is_bookkeeping_key(k))
