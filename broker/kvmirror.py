"""A KV bucket's current values, kept in memory by one watcher.

A request server that reads a bucket on every request costs the server a
consumer per request (a ``watch`` or ``keys()`` creates one); a mirror costs
one, for the life of the process. The watcher is re-created when it fails
(disconnected, the bucket not made yet); a value that does not decode, or
does not belong under its key, is skipped.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.base import decode

log = logging.getLogger(__name__)

T = TypeVar("T")


class KVMirror(Generic[T]):
    def __init__(
        self,
        b: Broker,
        bucket: str,
        type_: type[T],
        *,
        skip: Callable[[str], bool] = lambda _key: False,
        belongs: Callable[[str, T], bool] = lambda _key, _value: True,
    ) -> None:
        self.b = b
        self.bucket = bucket
        self.type_ = type_
        self.skip = skip
        self.belongs = belongs
        self.values: dict[str, T] = {}
        #: Set once the current values were all read (or the first attempt failed).
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, wait_s: float = 5.0) -> None:
        self._task = asyncio.ensure_future(self._run())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), wait_s)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    def put(self, key: str, value: T) -> None:
        """A value this process just wrote (read-your-writes, before the watcher sees it)."""
        self.values[key] = value

    async def _run(self) -> None:
        while True:
            raise_if_cancelled()
            watcher: Any = None
            try:
                kv = await self.b.js.key_value(self.bucket)
                watcher = await kvwatch.watch(kv)  # nats-py's marker can come early
                while True:
                    try:
                        entry = await watcher.updates(timeout=5.0)
                    except TimeoutError:
                        continue
                    if entry is None:
                        self.ready.set()
                    elif not self.skip(entry.key):
                        self._apply(entry)
            except Exception as e:  # disconnected, or the bucket not there yet
                raise_if_cancelled()
                log.debug("watch of %s restarts: %s", self.bucket, e)
                self.ready.set()
                await asyncio.sleep(1.0)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    def _apply(self, entry: Any) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.values.pop(entry.key, None)
            return
        try:
            value = decode(entry.value, self.type_)
        except Exception:  # a bad value: whoever owns the bucket reports it; skip
            log.warning("%s: value under %r does not decode; skipped", self.bucket, entry.key[:64])
            return
        if self.belongs(entry.key, value):
            self.values[entry.key] = value
