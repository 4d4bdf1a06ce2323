"""Policy publication: tenant action-module weights and their versions.

A version is two writes, in this order: the weights into the object store,
then a :class:`PolicyRecord` into the policy KV (``<tenant>.<workload>``,
compare-and-set on the key's revision), so a reader that sees a record can
always fetch its weights and two publishers of one version cannot both win
(``Conflict``). The key's history holds the retained versions. It stays at
the bytes level, so the broker never imports torch; ``PolicyStore`` in
``agents/models/policyio.py`` adds the heads.

See docs/ARCHITECTURE.md, "Layout and import root" (why the store is split).
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KV_DEL, KV_PURGE

from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import check_token
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import Conflict, InvalidSpec, Unavailable, UnknownTenant
from joynexus.schemas.inference import (
    FeatureSchemaSpec,
    IncompatibleSchema,
    PolicyRecord,
    UnknownPolicyVersion,
)


class WeightsCache:
    """The weights of the versions read last, whole, within ``max_bytes`` (least
    recently read first out): a tenant paging through a version's weights in
    slices (``get_policy`` with ``limit``) reads the object once, not once per
    slice (issue 24: 32 concurrent 1-byte slices read 32 whole objects). A
    version's weights never change, so an entry is never stale."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._loading: dict[str, asyncio.Future[bytes]] = {}
        self.loads = 0

    async def get(self, key: str, load: Any) -> bytes:
        data = self._items.get(key)
        if data is not None:
            self._items.move_to_end(key)
            return data
        pending = self._loading.get(key)
        if pending is not None:  # one read for all who ask at once
            return await asyncio.shield(pending)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._loading[key] = fut
        try:
            data = await load()
            self.loads += 1
            fut.set_result(data)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when none waits
            raise
        finally:
            del self._loading[key]
        if len(data) <= self.max_bytes:
            self._items[key] = data
            self.bytes += len(data)
            while self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= len(old)
        return data

__all__ = ["IncompatibleSchema", "PolicyRecords", "UnknownPolicyVersion", "WeightsCache"]

log = logging.getLogger(__name__)


# -- the store ------------------------------------------------------------------


class PolicyRecords:
    """Publish (as bytes), look up and watch tenant policy versions."""

    def __init__(self, broker: Broker) -> None:
        self.b = broker
        self._kv: Any = None
        self._obj: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            try:
                self._kv = await self.b.js.key_value(self.b.names.policy_bucket)
            except (BucketNotFoundError, NotFoundError) as e:
                raise Unavailable(
                    f"policy bucket {self.b.names.policy_bucket} does not exist; "
                    "run ensure_layout (any agent's start does)"
                ) from e
        return self._kv

    async def _store(self) -> Any:
        if self._obj is None:
            try:
                self._obj = await self.b.js.object_store(self.b.names.weights_store)
            except (BucketNotFoundError, NotFoundError) as e:
                raise Unavailable(
                    f"weights store {self.b.names.weights_store} does not exist; "
                    "run ensure_layout (any agent's start does)"
                ) from e
        return self._obj

    @staticmethod
    def _key(tenant_id: str, workload: str) -> str:
        from joynexus.broker.subjects import Names

        return Names.policy_record_key(check_token("tenant_id", tenant_id), check_token("workload", workload))

    # -- writing
    async def publish_weights(
        self,
        tenant_id: str,
        workload: str,
        weights: Callable[[int], bytes],
        *,
        head_type: str,
        head_config: dict[str, Any],
        feature_schema: FeatureSchemaSpec,
        schema_signature: str,
        base_model: str,
        version: int | None = None,
    ) -> PolicyRecord:
        """Publish a new version (weights first, record second); ``weights(version)``
        gives the safetensors bytes of the version chosen.

        ``version`` defaults to the latest published + 1 (1 for the first);
        an explicit one must be above the latest. Raises ``Conflict`` if
        another publisher wrote the key meanwhile.
        """
        kv = await self._bucket()
        key = self._key(tenant_id, workload)
        try:
            entry = await kv.get(key)
            last_rev: int | None = entry.revision
            latest = decode(entry.value, PolicyRecord, what=f"policy record {key}").version
        except KeyNotFoundError:  # also KeyDeletedError
            last_rev, latest = None, 0
        if version is None:
            version = latest + 1
        elif version <= latest:
            raise InvalidSpec(
                f"version {version} of {key} is not above the latest published ({latest}); "
                "publish a higher version"
            )
        if version < 1:
            raise InvalidSpec(f"version {version}: policy versions start at 1 (0 means 'latest')")

        data = weights(version)
        object_name = self.b.names.weights_object(tenant_id, workload, version)
        await (await self._store()).put(object_name, data)
        record = PolicyRecord(
            tenant_id=tenant_id,
            workload=workload,
            version=version,
            head_type=head_type,
            head_config=head_config,
            schema_signature=schema_signature,
            feature_schema=feature_schema,
            base_model=base_model,
            object_name=object_name,
            size_bytes=len(data),
            created_at=time.time(),
        )
        try:
            if last_rev is None:
                await kv.create(key, encode(record))
            else:
                await kv.update(key, encode(record), last=last_rev)
        except KeyWrongLastSequenceError as e:  # create() on an existing key lands here too
            raise Conflict(
                f"{key} changed while publishing version {version}; read the latest and publish again"
            ) from e
        return record

    # -- reading
    async def latest(self, tenant_id: str, workload: str = "default") -> PolicyRecord:
        """The newest version's record; ``UnknownTenant`` if none was published."""
        kv = await self._bucket()
        key = self._key(tenant_id, workload)
        try:
            entry = await kv.get(key)
        except KeyNotFoundError as e:
            raise UnknownTenant(
                f"no policy published for tenant {tenant_id!r} (key {workload!r}); "
                "publish one (PolicyStore.publish) before asking for actions"
            ) from e
        return decode(entry.value, PolicyRecord, what=f"policy record {key}")

    async def history(self, tenant_id: str, workload: str = "default") -> list[PolicyRecord]:
        """Every retained version's record, oldest first."""
        kv = await self._bucket()
        key = self._key(tenant_id, workload)
        entries = await kvwatch.history(kv, key)
        if not entries:
            raise UnknownTenant(f"no policy published for tenant {tenant_id!r} (key {workload!r})")
        out = []
        for entry in entries:
            if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                continue
            out.append(decode(entry.value, PolicyRecord, what=f"policy record {key}"))
        if not out:
            raise UnknownTenant(f"the policy of tenant {tenant_id!r} (key {workload!r}) was deleted")
        return out

    async def get(
        self, tenant_id: str, workload: str = "default", version: int | None = None
    ) -> PolicyRecord:
        """One version's record (None or 0: the latest); ``UnknownPolicyVersion`` if not retained."""
        latest = await self.latest(tenant_id, workload)
        if not version or version == latest.version:
            return latest
        records = await self.history(tenant_id, workload)
        for r in records:
            if r.version == version:
                return r
        retained = [r.version for r in records]
        if version > latest.version:
            why = f"the latest published is {latest.version}"
        else:
            why = f"retained versions are {retained} (older ones were dropped from history)"
        raise UnknownPolicyVersion(
            f"tenant {tenant_id!r} policy {workload!r} has no version {version}: {why}; "
            "pin a retained version or omit policy_version for the latest"
        )

    async def records(self) -> list[PolicyRecord]:
        """The latest record of every tenant policy."""
        return [rec async for rec in self.watch(follow=False)]

    async def load_weights(self, record: PolicyRecord) -> bytes:
        """The safetensors bytes of one version."""
        store = await self._store()
        buf = io.BytesIO()
        try:
            await store.get(record.object_name, writeinto=buf)
        except (ObjectNotFoundError, NotFoundError) as e:
            raise UnknownPolicyVersion(
                f"weights {record.object_name!r} of tenant {record.tenant_id!r} v{record.version} are "
                "missing from the weights store; republish the version"
            ) from e
        return buf.getvalue()

    async def watch(
        self, *, ready: asyncio.Event | None = None, follow: bool = True
    ) -> AsyncIterator[PolicyRecord]:
        """The latest record of every key, then (``follow``) each new one as it is published.

        ``ready`` is set once the current records have been yielded (and the
        consumer has processed them, since it pulls the next only after).
        Deletes and malformed records are skipped (logged).
        """
        kv = await self._bucket()
        watcher = await kvwatch.watch(kv)  # nats-py's marker can come early
        try:
            async for entry in watcher:
                if entry is None:  # end of the current values
                    if ready is not None:
                        ready.set()
                    if not follow:
                        return
                    continue
                if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                    continue
                try:
                    rec = decode(entry.value, PolicyRecord, what=f"policy record {entry.key}")
                except Exception as e:  # one bad record must not stop the watch
                    log.warning("skipping policy record %s: %s", entry.key, e)
                    continue
                yield rec
        finally:
            try:
                await watcher.stop()
            except Exception:  # connection already closed
                pass
