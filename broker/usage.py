"""Usage metering per tenant: what each tenant used of the shared services.

Nothing new is recorded for it: the :class:`Meter` folds events that already
exist (busy intervals split by rows, Training Queue index records, terminal
job events) in stream-sequence order, and checkpoints every total with the
last sequence folded from each stream in one value written with
compare-and-set. So a meter that dies folds the same events again from its
last checkpoint (each counted once) and two meters cannot both advance it.

The state and its folding, pure, are in broker/usagestate.py. See
docs/ARCHITECTURE.md, "Usage metering" (what is split how, what is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.broker.usagestate import (
    decode_state,
    empty_state,
    encode_state,
    fold_message,
    prune,
    report,
)
from joynexus.schemas.api import UsageQuery

log = logging.getLogger(__name__)

KEY = "meter"


def bucket_name(b: Broker) -> str:
    return b.names.usage_bucket


# ---------------------------------------------------------------- reading the streams


def _sources(b: Broker) -> dict[str, tuple[str, str]]:
    n = b.names
    return {
        "metrics": (n.metrics_stream, n.metrics("system", "*")),
        "tq": (n.tq_stream, n.all_tq_indexes),
        "jobs": (n.jobs_stream, n.all_jobs),
    }


def _ts(m: Any) -> float:
    ts = getattr(m.metadata, "timestamp", None)
    if isinstance(ts, datetime):
        return ts.replace(tzinfo=ts.tzinfo or UTC).timestamp()
    return time.time()


class _Reader:
    """One ordered pull consumer over a source from a sequence on."""

    def __init__(self, b: Broker, stream: str, subject: str, after: int) -> None:
        self.b, self.stream, self.subject, self.after = b, stream, subject, after
        self.sub: Any = None

    async def open(self) -> int:
        """Opens the consumer; returns the stream's first sequence (gap detection)."""
        info = await self.b.js.stream_info(self.stream)
        first = int(info.state.first_seq or 0)
        cfg = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, self.after + 1),
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
            mem_storage=True,
        )
        self.sub = await self.b.js.pull_subscribe(self.subject, stream=self.stream, config=cfg)
        return first

    async def batch(self, n: int = 500, wait_s: float = 0.02) -> list[Any]:
        try:
            return list(await self.sub.fetch(n, timeout=wait_s))
        except TimeoutError:
            return []

    async def pending(self) -> int:
        info = await self.sub.consumer_info()
        return int(info.num_pending or 0)

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                name = (await self.sub.consumer_info()).name
                await self.sub.unsubscribe()
                await self.b.js.delete_consumer(self.stream, name)
            self.sub = None


async def _drain(state: dict[str, Any], source: str, reader: _Reader,
                 limit: int | None = None) -> AsyncIterator[int]:
    """Fold what the reader has now; yields the count after each batch."""
    done = 0
    while limit is None or done < limit:
        msgs = await reader.batch()
        if not msgs:
            return
        for m in msgs:
            fold_message(state, source, m.subject, m.data, m.metadata.sequence.stream, _ts(m))
        done += len(msgs)
        yield done


async def _bucket(b: Broker, create: bool) -> Any:
    try:
        return await b.js.key_value(bucket_name(b))
    except BucketNotFoundError:
        if not create:
            return None
        with contextlib.suppress(Exception):
            return await b.js.create_key_value(KeyValueConfig(
                bucket=bucket_name(b), history=1, storage=StorageType.FILE,
                description="JoyNexus usage metering: one checkpoint (totals + stream sequences)",
            ))
        return await b.js.key_value(bucket_name(b))


async def load_checkpoint(b: Broker, *, create: bool = False) -> tuple[dict[str, Any], int]:
    """The checkpoint and its KV revision (an empty state and 0 if there is none)."""
    kv = await _bucket(b, create)
    if kv is None:
        return empty_state(), 0
    try:
        entry = await kv.get(KEY)
    except KeyNotFoundError:
        return empty_state(), 0
    if entry.value is None:
        return empty_state(), 0
    return decode_state(entry.value), int(entry.revision or 0)


async def catch_up(b: Broker, state: dict[str, Any]) -> dict[str, Any]:
    """Fold every event after the state's sequences (read-only: nothing written)."""
    for source, (stream, subject) in _sources(b).items():
        r = _Reader(b, stream, subject, state["seq"][source])
        try:
            first = await r.open()
            if source == "metrics" and first > state["seq"][source] + 1 and state["seq"][source]:
                state["events_missed"] += first - state["seq"][source] - 1
            while await r.pending() > 0:
                async for _ in _drain(state, source, r):
                    pass
        finally:
            await r.close()
    return state


async def read_usage(b: Broker) -> dict[str, Any]:
    """The checkpoint plus everything after it (what an operator reads)."""
    state, _ = await load_checkpoint(b)
    return await catch_up(b, state)


class Meter:
    """Folds the three streams into the checkpoint, every ``interval_s``."""

    def __init__(self, b: Broker, *, interval_s: float = 1.0, instance: str = "meter") -> None:
        self.b = b
        self.interval_s = interval_s
        self.instance = instance
        self.state = empty_state()
        self.revision = 0
        self._kv: Any = None
        self._readers: dict[str, _Reader] = {}
        self.checkpoints = 0
        #: Set once the first catch-up after (re)start has been folded.
        self.ready = asyncio.Event()

    async def _open(self) -> None:
        await self._close()
        self._kv = await _bucket(self.b, True)
        self.state, self.revision = await load_checkpoint(self.b, create=True)
        for source, (stream, subject) in _sources(self.b).items():
            r = _Reader(self.b, stream, subject, self.state["seq"][source])
            first = await r.open()
            last = self.state["seq"][source]
            if source == "metrics" and last and first > last + 1:
                self.state["events_missed"] += first - last - 1
                log.warning("usage: %d metric events expired before they were metered",
                            first - last - 1)
            self._readers[source] = r

    async def _close(self) -> None:
        for r in self._readers.values():
            await r.close()
        self._readers = {}

    async def checkpoint(self) -> None:
        prune(self.state)
        try:
            self.revision = int(await self._kv.update(KEY, encode_state(self.state),
                                                      last=self.revision))
        except KeyWrongLastSequenceError:
            # Another meter moved the checkpoint: take its word and go on from it.
            log.warning("usage: the checkpoint moved under this meter; reloading")
            await self._open()
            return
        self.checkpoints += 1

    async def run_once(self) -> None:
        """One round: fold everything pending in each stream, then checkpoint."""
        before = self.state["events"]
        for source, r in self._readers.items():
            while True:
                got = [n async for n in _drain(self.state, source, r, limit=5000)]
                if not got:
                    break
        if self.state["events"] != before or self.revision == 0:
            await self.checkpoint()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                if not self._readers:
                    await self._open()
                await self.run_once()
                self.ready.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise_if_cancelled()
                log.warning("usage meter: %s; reopening", e)
                await self._close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
        await self._close()

    def report(self, *, tenant: str | None = None, since: float = 0.0) -> dict[str, Any]:
        return report(self.state, tenant=tenant, since=since)


__all__ = ["Meter", "UsageQuery", "catch_up", "load_checkpoint", "read_usage"]
