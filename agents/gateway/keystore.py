"""The gateway's view of the API keys bucket: one watcher, keys checked in memory,
revocations told at once.

The control plane writes ``key.<id>`` (agents/control/apikeys.py); this store
keeps every record in memory, so checking a presented key costs one sha256 and
no round trip, and calls :attr:`KeyStore.on_revoke` with a key's id as soon as
its record is deleted (the gateway closes that key's connections). It writes
``used.<id>`` (:class:`~joynexus.schemas.apikeys.ApiKeyUse`) at most once per
:data:`USE_EVERY_S` per key. Until the watcher has read the bucket, no key is
accepted.

See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.broker.subjects import APIKEY_KEYS, APIKEY_USED_KEYS
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.apikeys import ApiKeyRecord, ApiKeyUse, hash_matches, parse_key
from joynexus.schemas.base import decode, encode

log = logging.getLogger(__name__)

#: How often a key's last use is written at most (seconds).
USE_EVERY_S = 60.0


class KeyStore:
    def __init__(self, b: Broker, *, instance: str = "gateway") -> None:
        self.b = b
        self.instance = instance
        self.records: dict[str, ApiKeyRecord] = {}
        self.ready = asyncio.Event()
        self.on_revoke: Callable[[str], None] = lambda _key_id: None
        self._used: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._kv: Any = None
        self._writes: set[asyncio.Task[None]] = set()

    async def start(self, wait_s: float = 10.0) -> None:
        self._task = asyncio.ensure_future(self._run())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), wait_s)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    def check(self, presented: str) -> ApiKeyRecord | None:
        """The record of a valid, current key; None for anything else."""
        parsed = parse_key(presented)
        if parsed is None or not self.ready.is_set():
            return None
        rec = self.records.get(parsed[0])
        if rec is None or not hash_matches(rec.secret_sha256, parsed[1]):
            return None
        return rec

    def used(self, key_id: str) -> None:
        """Record a use (written in the background, at most once per USE_EVERY_S)."""
        now = time.time()
        if now - self._used.get(key_id, 0.0) < USE_EVERY_S or self._kv is None:
            return
        self._used[key_id] = now
        t = asyncio.ensure_future(self._write_use(key_id, now))
        self._writes.add(t)
        t.add_done_callback(self._writes.discard)

    async def _write_use(self, key_id: str, at: float) -> None:
        with contextlib.suppress(Exception):
            await self._kv.put(APIKEY_USED_KEYS + key_id,
                               encode(ApiKeyUse(at=at, gateway=self.instance)))

    async def _run(self) -> None:
        while True:
            raise_if_cancelled()
            watcher: Any = None
            try:
                self._kv = await self.b.js.key_value(self.b.names.apikeys_bucket)
                watcher = await kvwatch.watch(self._kv, APIKEY_KEYS + ">")
                seen: set[str] = set()
                while True:
                    try:
                        entry = await watcher.updates(timeout=5.0)
                    except TimeoutError:
                        continue
                    if entry is None:
                        # Caught up: keys deleted while the watch was down are gone too.
                        for gone in set(self.records) - seen:
                            self._revoke(gone)
                        self.ready.set()
                        continue
                    seen.add(entry.key[len(APIKEY_KEYS):])
                    self._apply(entry)
            except Exception as e:  # disconnected, or the bucket not made yet
                raise_if_cancelled()
                log.debug("watch of the API keys restarts: %s", e)
                await asyncio.sleep(1.0)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    def _apply(self, entry: Any) -> None:
        key_id = entry.key[len(APIKEY_KEYS):]
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self._revoke(key_id)
            return
        try:
            rec = decode(entry.value, ApiKeyRecord)
        except Exception:
            log.warning("API key record %r does not decode; refused", key_id[:32])
            self._revoke(key_id)
            return
        if rec.key_id != key_id:
            self._revoke(key_id)
            return
        old = self.records.get(key_id)
        self.records[key_id] = rec
        if old is not None and old != rec:  # rescoped: its connections start again
            self.on_revoke(key_id)

    def _revoke(self, key_id: str) -> None:
        if self.records.pop(key_id, None) is not None:
            self.on_revoke(key_id)
