"""The operator API's key verbs (``<ns>.admin.key_add|key_rm|key_ls``): API keys of
the policy gateway, bound to one tenant and optionally one workload and version.

Only the sha256 of a key's secret arrives and is stored (``key.<id>`` in the API
keys bucket; the operator's client made the key and prints it once). A removed
key is deleted from the bucket, which every gateway watches: it refuses the key
from then on and closes the connections that used it. Removing a tenant removes
its keys (:meth:`ApiKeysAPI.revoke_tenant_keys`).

See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

import re
import time
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from joynexus.agents.control.base import ControlBase
from joynexus.broker import kvwatch
from joynexus.broker.subjects import APIKEY_KEYS, APIKEY_USED_KEYS
from joynexus.schemas.apikeys import (
    ApiKeyInfo,
    ApiKeyRecord,
    ApiKeyUse,
    KeyReply,
    KeyRequest,
    valid_key_id,
)
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import InvalidSpec, UnknownTenant
from joynexus.schemas.jobs import check_name

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ApiKeysAPI(ControlBase):
    _keys: Any

    async def _key_record(self, key_id: str) -> ApiKeyRecord | None:
        try:
            entry = await self._keys.get(APIKEY_KEYS + key_id)
        except KeyNotFoundError:
            return None
        return decode(entry.value, ApiKeyRecord) if entry.value else None

    async def _key_add(self, req: KeyRequest) -> KeyReply:
        tenant = check_name("tenant", req.tenant)
        if not valid_key_id(req.key_id) or not _SHA256.match(req.secret_sha256):
            raise InvalidSpec("key_add needs a key id (12 hex digits) and the sha256 of its secret")
        if req.version < 0:
            raise InvalidSpec(f"version must be >= 0 (0: the latest), got {req.version}")
        if len(req.label) > 200:
            raise InvalidSpec("a key's label is at most 200 characters")
        if await self._identity_of(tenant) is None:
            raise UnknownTenant(f"no tenant {tenant!r}; add it first (joynexus tenant add)")
        if req.workload:
            check_name("workload", req.workload)
            # Only the tenant's own workloads: a name of another tenant's means nothing here.
            if not any(r.spec.name == req.workload for r in await self._records(tenant)):
                raise InvalidSpec(f"tenant {tenant!r} has no workload {req.workload!r}")
        elif req.version:
            raise InvalidSpec("a key pinned to a version names its workload (--workload)")
        rec = ApiKeyRecord(
            key_id=req.key_id, tenant_id=tenant, secret_sha256=req.secret_sha256,
            workload=req.workload, version=req.version, created_at=time.time(), label=req.label,
        )
        try:
            await self._keys.create(APIKEY_KEYS + req.key_id, encode(rec))
        except KeyWrongLastSequenceError as e:
            raise InvalidSpec(f"key id {req.key_id} is taken; make a new key") from e
        return KeyReply(key=_info(rec, 0.0))

    async def _key_rm(self, req: KeyRequest) -> KeyReply:
        tenant = check_name("tenant", req.tenant)
        rec = await self._key_record(req.key_id) if valid_key_id(req.key_id) else None
        if rec is None or rec.tenant_id != tenant:
            raise InvalidSpec(f"tenant {tenant!r} has no key {req.key_id!r} (joynexus tenant key ls)")
        await self._delete_key(req.key_id)
        return KeyReply(key=_info(rec, 0.0))

    async def _key_ls(self, req: KeyRequest) -> KeyReply:
        tenant = check_name("tenant", req.tenant) if req.tenant else ""
        out = []
        for key in await kvwatch.keys(self._keys, APIKEY_KEYS + ">"):
            rec = await self._key_record(key[len(APIKEY_KEYS):])
            if rec is None or (tenant and rec.tenant_id != tenant):
                continue
            out.append(_info(rec, await self._last_use(rec.key_id)))
        return KeyReply(keys=sorted(out, key=lambda k: (k.tenant_id, k.created_at)))

    async def _last_use(self, key_id: str) -> float:
        try:
            entry = await self._keys.get(APIKEY_USED_KEYS + key_id)
        except KeyNotFoundError:
            return 0.0
        return decode(entry.value, ApiKeyUse).at if entry.value else 0.0

    async def _delete_key(self, key_id: str) -> None:
        await self._keys.delete(APIKEY_KEYS + key_id)
        try:
            await self._keys.delete(APIKEY_USED_KEYS + key_id)
        except KeyNotFoundError:
            pass

    async def _identity_of(self, tenant: str) -> bytes | None:
        try:
            entry = await self._ids.get(tenant)
        except KeyNotFoundError:
            return None
        return entry.value or None

    async def revoke_tenant_keys(self, tenant: str) -> list[str]:
        """Delete every key of ``tenant`` (its removal); the ids removed."""
        gone = []
        for key in await kvwatch.keys(self._keys, APIKEY_KEYS + ">"):
            rec = await self._key_record(key[len(APIKEY_KEYS):])
            if rec is not None and rec.tenant_id == tenant:
                await self._delete_key(rec.key_id)
                gone.append(rec.key_id)
        return gone


def _info(rec: ApiKeyRecord, last_used: float) -> ApiKeyInfo:
    return ApiKeyInfo(key_id=rec.key_id, tenant_id=rec.tenant_id, workload=rec.workload,
                      version=rec.version, created_at=rec.created_at, last_used_at=last_used,
                      label=rec.label)
