"""The training client's entries in the trainer state buckets: each call's result
(kept where the control plane can answer ``train_result`` from it) and a custom
workload's named checkpoints (``save_state``/``load_state``/``list_states``/
``delete_state``).

Both live in the trainer KV and the checkpoints object store, under keys and
objects of the tenant's own workload (``Names.call_result_key``,
``Names.named_state_key``): a name is a validated token, so no call reaches
another tenant's or another workload's entries. A result is written by the
actor after the call's commit and written again if the call is re-delivered
(the same bytes, from the committed state); a named checkpoint's bytes go to a
fresh object before its record points at them. The bytes are opaque here.

See docs/ARCHITECTURE.md, "The training client".
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import time

from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from nats.js.object_store import ObjectStore

from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import check_token
from joynexus.schemas.base import Wire, decode, encode
from joynexus.schemas.errors import QuotaExceeded, Unavailable, UnknownTenant

__all__ = ["MAX_NAMED_STATES", "CallStore", "ClientEpoch", "NamedState"]

log = logging.getLogger(__name__)

#: Named checkpoints one workload may keep.
MAX_NAMED_STATES = 16


class NamedState(Wire, kw_only=True):
    """Value of ``state.<tenant>.<workload>.<name>``: where a named checkpoint is."""

    object_name: str
    size_bytes: int
    sha256: str
    version: int


class ClientEpoch(Wire, kw_only=True):
    """Value of ``client.<tenant>.<workload>``: the workload's current training client."""

    epoch: int
    started_at: float


class CallStore:
    """Call results and named checkpoints of custom workloads (see the module)."""

    def __init__(self, b: Broker) -> None:
        self.b = b
        self._kv: KeyValue | None = None
        self._obj: ObjectStore | None = None

    async def _stores(self) -> tuple[KeyValue, ObjectStore]:
        if self._kv is None or self._obj is None:
            try:
                self._kv = await self.b.js.key_value(self.b.names.trainer_bucket)
                self._obj = await self.b.js.object_store(self.b.names.checkpoints_store)
            except NotFoundError as e:
                raise Unavailable("the trainer state buckets are missing; run `joynexus up`") from e
        return self._kv, self._obj

    # ------------------------------------------------------------ results
    async def put_result(self, tenant: str, workload: str, job_id: str, data: bytes) -> None:
        kv, _ = await self._stores()
        await kv.put(self.b.names.call_result_key(tenant, workload, check_token("job", job_id)), data)

    async def get_result(self, tenant: str, workload: str, job_id: str) -> bytes | None:
        kv, _ = await self._stores()
        try:
            entry = await kv.get(self.b.names.call_result_key(tenant, workload, check_token("job", job_id)))
        except KeyNotFoundError:
            return None
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            return None
        return bytes(entry.value)

    async def forget_results(self, tenant: str, workload: str, job_ids: list[str]) -> None:
        """Purge results the tenant's state no longer keeps (best effort)."""
        kv, _ = await self._stores()
        for job_id in job_ids:
            with contextlib.suppress(Exception):
                await kv.purge(self.b.names.call_result_key(tenant, workload, job_id))

    # ------------------------------------------------------------ the current client
    async def new_client(self, tenant: str, workload: str) -> int:
        """A new training client takes the workload over: its epoch (one more than the
        last; compare-and-set, so two clients starting at once get different ones)."""
        kv, _ = await self._stores()
        key = self.b.names.client_epoch_key(tenant, workload)
        for _ in range(16):
            entry = await _entry(kv, key)
            epoch = 1 if entry is None else decode(entry.value or b"", ClientEpoch).epoch + 1
            value = encode(ClientEpoch(epoch=epoch, started_at=time.time()))
            try:
                if entry is None:
                    await kv.create(key, value)
                else:
                    await kv.update(key, value, last=entry.revision)
                return epoch
            except (KeyWrongLastSequenceError, BadRequestError):
                continue  # another client started meanwhile: take the next epoch
        raise Unavailable(f"workload {workload!r}: too many training clients starting at once")

    async def client(self, tenant: str, workload: str) -> ClientEpoch | None:
        """The workload's current training client (None: none started yet)."""
        kv, _ = await self._stores()
        entry = await _entry(kv, self.b.names.client_epoch_key(tenant, workload))
        return None if entry is None else decode(entry.value or b"", ClientEpoch)

    # ------------------------------------------------------------ named checkpoints
    async def names(self, tenant: str, workload: str) -> list[str]:
        """The workload's named checkpoints, sorted."""
        kv, _ = await self._stores()
        prefix = self.b.names.named_state_key(tenant, workload, "")
        keys = await kvwatch.keys(kv, self.b.names.named_state_key(tenant, workload, "*"))
        return sorted(k.removeprefix(prefix) for k in keys if k.startswith(prefix))

    async def save(self, tenant: str, workload: str, name: str, data: bytes, version: int) -> None:
        """Write (or overwrite) checkpoint ``name``; at most MAX_NAMED_STATES per workload."""
        kv, obj = await self._stores()
        key = self.b.names.named_state_key(tenant, workload, check_token("state name", name))
        existing = await self.names(tenant, workload)
        if name not in existing and len(existing) >= MAX_NAMED_STATES:
            raise QuotaExceeded(
                f"workload {workload!r} keeps {len(existing)} named states (at most "
                f"{MAX_NAMED_STATES}); delete_state one first"
            )
        old = await self._record(kv, key)
        object_name = self.b.names.named_state_object(tenant, workload, name, os.urandom(4).hex())
        await obj.put(object_name, data)
        rec = NamedState(object_name=object_name, size_bytes=len(data),
                         sha256=hashlib.sha256(data).hexdigest(), version=version)
        await kv.put(key, encode(rec))
        if old is not None and old.object_name != object_name:
            with contextlib.suppress(Exception):
                await obj.delete(old.object_name)

    async def load(self, tenant: str, workload: str, name: str) -> bytes:
        kv, obj = await self._stores()
        rec = await self._record(kv, self.b.names.named_state_key(tenant, workload, check_token("state name", name)))
        if rec is None:
            raise UnknownTenant(f"workload {workload!r} has no state named {name!r}")
        buf = io.BytesIO()
        try:
            await obj.get(rec.object_name, writeinto=buf)
        except ObjectNotFoundError as e:
            raise Unavailable(f"state {name!r} of {workload!r}: its bytes are missing") from e
        data = buf.getvalue()
        if hashlib.sha256(data).hexdigest() != rec.sha256:
            raise Unavailable(f"state {name!r} of {workload!r} does not match its record")
        return data

    async def delete(self, tenant: str, workload: str, name: str) -> bool:
        """Delete checkpoint ``name``; False if there was none."""
        kv, obj = await self._stores()
        key = self.b.names.named_state_key(tenant, workload, check_token("state name", name))
        rec = await self._record(kv, key)
        if rec is None:
            return False
        await kv.purge(key)
        with contextlib.suppress(Exception):
            await obj.delete(rec.object_name)
        return True

    @staticmethod
    async def _record(kv: KeyValue, key: str) -> NamedState | None:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            return None
        return decode(entry.value, NamedState, what="named state record")


async def _entry(kv: KeyValue, key: str) -> KeyValue.Entry | None:
    """The key's live entry (None: never written, deleted or purged)."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    return None if entry.operation in (KV_DEL, KV_PURGE) or not entry.value else entry
