"""Usage metering per tenant: what each tenant used of the shared services.

Nothing new is recorded for it: the :class:`Meter` folds events that already
exist (busy intervals split by rows, Training Queue index records, terminal
job events) in stream-sequence order, and checkpoints every total with the
last sequence folded from each stream in one value written with
compare-and-set. So a meter that dies folds the same events again from its
last checkpoint (each counted once) and two meters cannot both advance it.

See docs/ARCHITECTURE.md, "Usage metering" (what is split how, what is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import zlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import orjson
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.schemas.api import UsageQuery
from joynexus.schemas.errors import InvalidSpec

log = logging.getLogger(__name__)

KEY = "meter"
STATE_VERSION = 1
#: Hourly buckets kept for ``since`` queries (the metrics stream keeps a day).
KEEP_HOURS = 48
#: Terminal jobs remembered (their time) for index records folded after them.
KEEP_CLOSED = 50_000
#: The figures per tenant.
FIELDS = ("train_s", "infer_s", "env_s", "tq_byte_s", "rows_trained", "rows_inferred",
          "infer_requests", "env_steps", "train_steps", "infer_batches", "rollouts",
          "jobs_completed", "jobs_dropped", "jobs_failed")
_TERMINAL = {"completed": "jobs_completed", "dropped": "jobs_dropped", "failed": "jobs_failed"}
SOURCES = ("metrics", "tq", "jobs")


def bucket_name(b: Broker) -> str:
    return b.names.usage_bucket


def empty_state() -> dict[str, Any]:
    return {
        "v": STATE_VERSION,
        "seq": dict.fromkeys(SOURCES, 0),
        "tenants": {},
        "hours": {},
        "services": {"train": 0.0, "infer": 0.0, "env": 0.0},
        "unattributed": {"train": 0.0, "infer": 0.0, "env": 0.0},
        "open_tq": {},
        "closed": {},
        "events": 0,
        "events_missed": 0,
        "first_at": None,
        "last_at": None,
    }


def _add(state: dict[str, Any], tenant: str, at: float, field: str, value: float) -> None:
    t = state["tenants"].setdefault(tenant, {})
    t[field] = t.get(field, 0) + value
    hour = str(int(at // 3600 * 3600))
    h = state["hours"].setdefault(hour, {}).setdefault(tenant, {})
    h[field] = h.get(field, 0) + value


def split(total: float, weights: dict[str, float]) -> dict[str, float]:
    """``total`` split in proportion to ``weights`` (tenant -> rows), in sorted
    tenant order, the last part the remainder: the parts add up to ``total``."""
    items = sorted((t, float(w)) for t, w in weights.items() if w > 0)
    if not items:
        return {}
    w_sum = sum(w for _, w in items)
    out: dict[str, float] = {}
    left = total
    for i, (t, w) in enumerate(items):
        part = left if i == len(items) - 1 else total * w / w_sum
        out[t] = part
        left -= part
    return out


def _weights(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    out: dict[str, float] = {}
    for k, v in value.items():
        if isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
            out[k] = float(v)
    return out


def _stamp(state: dict[str, Any], at: float) -> None:
    if state["first_at"] is None or at < state["first_at"]:
        state["first_at"] = at
    if state["last_at"] is None or at > state["last_at"]:
        state["last_at"] = at


def fold_metric(state: dict[str, Any], m: dict[str, Any]) -> None:
    """Fold one metric event (only busy intervals count)."""
    service = m.get("service")
    if m.get("kind") != "system" or service not in ("train", "infer", "env"):
        return
    try:
        start, end = float(m["busy_start"]), float(m["busy_end"])
    except (KeyError, TypeError, ValueError):
        return
    if not (math.isfinite(start) and math.isfinite(end)) or end < start:
        return
    d = end - start
    state["services"][service] += d
    _stamp(state, start)
    if service == "env":
        tenant = m.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            state["unattributed"]["env"] += d
            return
        _add(state, tenant, start, "env_s", d)
        _add(state, tenant, start, "rollouts", 1)
        steps = m.get("steps")
        if isinstance(steps, int) and steps > 0:
            _add(state, tenant, start, "env_steps", steps)
        return
    rows = _weights(m.get("tenant_rows"))
    if not rows and isinstance(m.get("tenants"), list):  # older events: equal split
        rows = {t: 1.0 for t in m["tenants"] if isinstance(t, str)}
    parts = split(d, rows)
    if not parts:
        state["unattributed"][service] += d
        return
    key, rows_key, count_key = (
        ("train_s", "rows_trained", "train_steps") if service == "train"
        else ("infer_s", "rows_inferred", "infer_batches")
    )
    for t, part in parts.items():
        _add(state, t, start, key, part)
        _add(state, t, start, count_key, 1)
        if isinstance(m.get("tenant_rows"), dict):
            _add(state, t, start, rows_key, rows[t])
    if service == "infer":
        for t, n in _weights(m.get("tenant_requests")).items():
            _add(state, t, start, "infer_requests", n)


def fold_tq_index(state: dict[str, Any], subject: str, data: bytes, at: float) -> None:
    """Fold one Training Queue index record (``<ns>.tq.<tenant>.<partition>.idx``)."""
    tokens = subject.split(".")
    if len(tokens) != 5 or tokens[4] != "idx":
        return
    tenant, partition = tokens[2], tokens[3]
    try:
        rec = orjson.loads(data)
        nbytes = sum(int(f.get("nbytes", 0)) for f in rec.get("fields", {}).values())
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return
    if nbytes <= 0:
        return
    key = f"{tenant}/{partition}"
    closed_at = state["closed"].get(key)
    if closed_at is not None:  # its job ended before this record was folded
        _add(state, tenant, at, "tq_byte_s", nbytes * max(0.0, closed_at - at))
        return
    state["open_tq"].setdefault(key, []).append([at, nbytes])


def fold_job(state: dict[str, Any], subject: str, data: bytes) -> None:
    """Fold one job event: a terminal one ends its partition's stay in the queue."""
    tokens = subject.split(".")
    if len(tokens) != 5 or tokens[4] not in _TERMINAL:
        return
    tenant, job_id = tokens[2], tokens[3]
    try:
        at = float(orjson.loads(data).get("at", 0.0))
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        at = 0.0
    _add(state, tenant, at, _TERMINAL[tokens[4]], 1)
    key = f"{tenant}/{job_id}"
    for put_at, nbytes in state["open_tq"].pop(key, []):
        _add(state, tenant, put_at, "tq_byte_s", nbytes * max(0.0, at - put_at))
    state["closed"][key] = at
    if len(state["closed"]) > KEEP_CLOSED:
        for k in list(state["closed"])[: len(state["closed"]) - KEEP_CLOSED]:
            del state["closed"][k]


def prune(state: dict[str, Any]) -> None:
    hours = sorted(state["hours"], key=int)
    for h in hours[:-KEEP_HOURS]:
        del state["hours"][h]


def encode_state(state: dict[str, Any]) -> bytes:
    return zlib.compress(orjson.dumps(state), 6)


def decode_state(data: bytes) -> dict[str, Any]:
    state = orjson.loads(zlib.decompress(data))
    if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
        raise InvalidSpec("the usage checkpoint has an unknown format")
    return state


# ---------------------------------------------------------------- reports


def report(state: dict[str, Any], *, tenant: str | None = None, since: float = 0.0,
           now: float | None = None) -> dict[str, Any]:
    """Figures per tenant (only ``tenant``'s when given). With ``since``: the sum
    of the hourly buckets from the hour holding ``since`` on (``since_effective``
    says where that starts; buckets older than :data:`KEEP_HOURS` are gone, so
    figures older than that are totals since metering began)."""
    now = time.time() if now is None else now
    if since > 0:
        start = int(since // 3600 * 3600)
        kept = [int(h) for h in state["hours"]]
        if kept and start < min(kept) and state["first_at"] is not None and \
                state["first_at"] < min(kept):
            start = min(kept)
        rows: dict[str, dict[str, float]] = {}
        for h, per in state["hours"].items():
            if int(h) >= start:
                for t, f in per.items():
                    acc = rows.setdefault(t, {})
                    for k, v in f.items():
                        acc[k] = acc.get(k, 0) + v
        since_effective: float | None = float(start)
    else:
        rows = {t: dict(f) for t, f in state["tenants"].items()}
        since_effective = None
    held: dict[str, int] = {}
    for key, puts in state["open_tq"].items():
        t = key.split("/", 1)[0]
        acc = rows.setdefault(t, {})
        for put_at, nbytes in puts:
            lo = max(put_at, since_effective or 0.0)
            acc["tq_byte_s"] = acc.get("tq_byte_s", 0) + nbytes * max(0.0, now - lo)
            held[t] = held.get(t, 0) + nbytes
    tenants = {
        t: {**{k: round(float(f.get(k, 0)), 6) for k in FIELDS}, "tq_bytes_held": held.get(t, 0)}
        for t, f in sorted(rows.items())
        if tenant is None or t == tenant
    }
    out: dict[str, Any] = {
        "as_of": now,
        "since": since or None,
        "since_effective": since_effective,
        "tenants": tenants,
    }
    if tenant is None:
        out.update(
            services={k: round(v, 6) for k, v in state["services"].items()},
            unattributed={k: round(v, 6) for k, v in state["unattributed"].items()},
            events=state["events"],
            events_missed=state["events_missed"],
            seq=state["seq"],
            first_at=state["first_at"],
            last_at=state["last_at"],
        )
    return out


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


def fold_message(state: dict[str, Any], source: str, subject: str, data: bytes,
                 seq: int, at: float) -> None:
    """Fold one stream message of ``source`` (its sequence must be past the state's)."""
    last = state["seq"][source]
    if seq <= last:
        return  # already counted (a redelivery after a reconnect)
    state["seq"][source] = seq
    state["events"] += 1
    if source == "metrics":
        with contextlib.suppress(orjson.JSONDecodeError):
            m = orjson.loads(data)
            if isinstance(m, dict):
                fold_metric(state, m)
    elif source == "tq":
        fold_tq_index(state, subject, data, at)
    else:
        fold_job(state, subject, data)


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


def parse_since(value: str | None) -> float:
    """An ISO 8601 time (``2026-12-01T13:00:00Z``; no zone: UTC) as epoch seconds."""
    if not value:
        return 0.0
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise InvalidSpec(f"--since {value!r} is not an ISO 8601 time: {e}") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


__all__ = ["FIELDS", "Meter", "UsageQuery", "catch_up", "fold_message", "load_checkpoint",
           "parse_since", "read_usage", "report", "split"]
