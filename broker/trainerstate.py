"""Trainer state in JetStream: a tenant's training checkpoint, readable from any host.

An actor's step is exactly-once because of its per-tenant checkpoint (module,
optimizer state, version, jobs applied); on one host's disk a lost host would
take it along. So the bytes go into the object store under a fresh name (a
half-written object is never referenced), then a :class:`CheckpointRecord`
is written with a compare-and-set on the revision the writer last read: the
commit point. A writer that lost the race gets ``Conflict`` and must reload;
objects no record points to are swept afterwards. The bytes are opaque here
(no torch) and a digest in the record is checked on load.

See docs/ARCHITECTURE.md, "Workloads, from the SDK to a new policy version" (the actor).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time

from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue
from nats.js.object_store import ObjectStore

from joynexus.broker.connection import Broker
from joynexus.broker.subjects import check_token
from joynexus.schemas.base import Wire, decode, encode
from joynexus.schemas.errors import Conflict, Unavailable

__all__ = ["CheckpointRecord", "Loaded", "TrainerStateStore"]

log = logging.getLogger(__name__)


class CheckpointRecord(Wire, kw_only=True, omit_defaults=True):
    """Value of ``<tenant>.<workload>`` in the trainer bucket: the checkpoint in force."""

    tenant_id: str
    workload: str
    version: int
    #: Object name in the checkpoints store.
    object_name: str
    size_bytes: int
    sha256: str
    jobs_applied: int = 0
    last_job: str | None = None
    #: A custom workload's last applied training-client call (its ``seq``).
    last_call_seq: int = 0
    #: Which actor instance committed it, and when.
    written_by: str = ""
    written_at: float = 0.0


class Loaded(Wire, kw_only=True):
    """A checkpoint read back: its record, its bytes and the KV revision (the CAS token)."""

    record: CheckpointRecord
    data: bytes
    revision: int


class TrainerStateStore:
    """Save and load per-tenant trainer checkpoints (see the module docstring)."""

    def __init__(self, b: Broker, *, instance: str = "") -> None:
        self.b = b
        self.instance = instance
        self._kv: KeyValue | None = None
        self._obj: ObjectStore | None = None
        #: key -> the object this process last committed (deleted when superseded).
        self._committed: dict[str, str] = {}

    async def _stores(self) -> tuple[KeyValue, ObjectStore]:
        if self._kv is None or self._obj is None:
            try:
                self._kv = await self.b.js.key_value(self.b.names.trainer_bucket)
                self._obj = await self.b.js.object_store(self.b.names.checkpoints_store)
            except (BucketNotFoundError, NotFoundError) as e:
                raise Unavailable(
                    f"trainer state buckets of namespace {self.b.names.namespace!r} are missing; "
                    "run `joynexus up` (or ensure_layout) to create them"
                ) from e
        return self._kv, self._obj

    @staticmethod
    def key(tenant_id: str, workload: str) -> str:
        check_token("tenant", tenant_id)
        check_token("workload", workload)
        return f"{tenant_id}.{workload}"

    async def load(self, tenant_id: str, workload: str) -> Loaded | None:
        """The checkpoint in force, or None if this tenant's policy never committed one."""
        _, obj = await self._stores()
        head = await self.head(tenant_id, workload)
        if head is None:
            return None
        rec, revision = head
        buf = io.BytesIO()
        try:
            await obj.get(rec.object_name, writeinto=buf)
        except ObjectNotFoundError as e:
            raise Unavailable(
                f"checkpoint object {rec.object_name} of {tenant_id}/{workload} v{rec.version} "
                "is missing from the checkpoints store"
            ) from e
        data = buf.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        if digest != rec.sha256 or len(data) != rec.size_bytes:
            raise Unavailable(
                f"checkpoint {rec.object_name} does not match its record "
                f"({len(data)} bytes, sha256 {digest[:12]}; record: {rec.size_bytes} bytes, "
                f"{rec.sha256[:12]})"
            )
        return Loaded(record=rec, data=data, revision=revision)

    async def head(self, tenant_id: str, workload: str) -> tuple[CheckpointRecord, int] | None:
        """The checkpoint record in force and its revision, without its bytes (None:
        none): a holder of a cached state checks it is still the one committed."""
        kv, _ = await self._stores()
        try:
            entry = await kv.get(self.key(tenant_id, workload))
        except KeyNotFoundError:
            return None
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            return None
        return decode(entry.value, CheckpointRecord, what="trainer checkpoint record"), int(entry.revision or 0)

    async def revision(self, tenant_id: str, workload: str) -> int | None:
        """The revision of the checkpoint record in force (None: none)."""
        head = await self.head(tenant_id, workload)
        return None if head is None else head[1]

    async def save(
        self,
        tenant_id: str,
        workload: str,
        *,
        version: int,
        data: bytes,
        expected_revision: int | None,
        jobs_applied: int = 0,
        last_job: str | None = None,
        last_call_seq: int = 0,
    ) -> int:
        """Commit ``data`` as the checkpoint in force; returns the new KV revision.

        ``expected_revision``: the revision this writer last loaded or saved (None:
        it believes there is none yet). If another writer committed since, raise
        ``Conflict`` and leave the newer checkpoint untouched.
        """
        kv, obj = await self._stores()
        key = self.key(tenant_id, workload)
        name = f"{tenant_id}/{workload}/v{version}-{os.urandom(4).hex()}.ckpt"
        await obj.put(name, data)
        rec = CheckpointRecord(
            tenant_id=tenant_id,
            workload=workload,
            version=version,
            object_name=name,
            size_bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            jobs_applied=jobs_applied,
            last_job=last_job,
            last_call_seq=last_call_seq,
            written_by=self.instance,
            written_at=time.time(),
        )
        try:
            if expected_revision is None:
                revision = int(await kv.create(key, encode(rec)))
            else:
                revision = int(await kv.update(key, encode(rec), last=expected_revision))
        except KeyWrongLastSequenceError as e:
            await self._delete(name)
            raise Conflict(
                f"checkpoint of {tenant_id}/{workload} was committed by another actor since "
                f"revision {expected_revision}; reload it before training this tenant"
            ) from e
        except Exception:
            await self._delete(name)
            raise
        previous = self._committed.get(key)
        self._committed[key] = name
        if previous is None:  # first commit here: sweep what earlier writers left
            await self._sweep(tenant_id, workload, keep=name)
        else:
            await self._delete(previous)
        return revision

    async def _delete(self, name: str) -> None:
        _, obj = await self._stores()
        try:
            await obj.delete(name)
        except Exception as e:  # best effort: the next sweep gets it
            log.debug("checkpoint object %s not deleted: %s", name, e)

    async def _sweep(self, tenant_id: str, workload: str, *, keep: str) -> None:
        """Delete this policy's objects other than ``keep`` (older ones, crash leftovers)."""
        _, obj = await self._stores()
        prefix = f"{tenant_id}/{workload}/"
        try:
            infos = await obj.list(ignore_deletes=True)
        except NotFoundError:  # an empty store
            return
        for info in infos:
            if info.name.startswith(prefix) and info.name != keep:
                await self._delete(info.name)

    async def objects(self, tenant_id: str, workload: str) -> list[str]:
        """This policy's checkpoint objects (one, except between a save and its sweep)."""
        _, obj = await self._stores()
        prefix = f"{tenant_id}/{workload}/"
        try:
            infos = await obj.list(ignore_deletes=True)
        except NotFoundError:
            return []
        return sorted(i.name for i in infos if i.name.startswith(prefix))
