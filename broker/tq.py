"""The Training Queue: a sample-oriented tensor store on JetStream (TransferQueue-style).

Producers put fields (tensors with a leading row dimension) into a tenant's
partition; consumers claim rows whose requested fields are all produced,
per task. Everything is in one stream, so any agent in any process can use a
partition and it survives restarts of either side. The invariants: an index
record is written after its chunks (the commit point); row ids and claims are
compare-and-append, so producers never share ids and two consumers of a task
never get the same row; tensors travel as raw bytes with dtype and shape in a
header, never pickle.

See docs/ARCHITECTURE.md, "The Training Queue" (subjects, TTLs, clearing).
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np
from nats.js.errors import APIError, NotFoundError

from joynexus.broker import tracing
from joynexus.broker.connection import Broker
from joynexus.broker.direct import read_subject
from joynexus.broker.errcodes import WRONG_LAST_SEQUENCE
from joynexus.broker.headers import EXPECTED_LAST_SUBJECT_SEQ
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import (
    Conflict,
    InvalidMessage,
    InvalidSpec,
    PayloadTooLarge,
    ShapeMismatch,
    Unavailable,
    UnknownPartition,
)
from joynexus.schemas.jobs import check_name
from joynexus.schemas.tq import (
    CHUNK_HEADER,
    BatchMeta,
    RowRanges,
    TqChunkHeader,
    TqClaimRecord,
    TqFieldData,
    TqIndexRecord,
    TqSegment,
    row_ranges,
)

__all__ = ["DEFAULT_MAX_PARTITION_BYTES", "TrainingQueue"]

MiB = 1024 * 1024
DEFAULT_MAX_PARTITION_BYTES = 256 * MiB
#: Room left in a message for the subject and headers (traceparent, TTL, chunk header).
HEADER_MARGIN = 16 * 1024
#: Compare-and-append attempts before giving up; each failed round means another
#: writer succeeded, so this bounds the number of writers racing on one subject.
MAX_APPEND_ATTEMPTS = 64
#: Chunks in flight per call: enough to hide round trips, small enough not to
#: fill the client's outbound buffer with a 256 MiB partition at once.
MAX_IN_FLIGHT = 8
#: Records per batched direct get request.
READ_BATCH = 1000
REQUEST_TIMEOUT_S = 10.0
#: Kinds of numpy dtypes that travel as raw bytes (bool, ints, floats, complex).
_RAW_KINDS = "biufc"
_FIELD = re.compile(r"^[a-z0-9_]{1,64}$")

ArrayLike = Any
T = TypeVar("T")


def check_field(name: str) -> str:
    """A field name becomes a subject token: lowercase letters, digits and ``_``."""
    if not isinstance(name, str) or not _FIELD.match(name):
        raise InvalidSpec(
            f"field name {name!r} is not valid: use 1-64 lowercase letters, digits or '_'"
        )
    return name


def to_numpy(field: str, value: ArrayLike) -> np.ndarray:
    """A C-contiguous numpy view/copy of a numpy array, torch tensor or ``__array__`` object."""
    try:
        if isinstance(value, np.ndarray):
            arr = value
        elif hasattr(value, "detach"):  # torch without importing torch
            arr = value.detach().cpu().numpy()
        elif hasattr(value, "__array__"):
            arr = np.asarray(value)
        else:
            raise InvalidSpec(
                f"field {field!r}: expected an array (numpy, torch, or with __array__), "
                f"got {type(value).__name__}"
            )
    except (TypeError, RuntimeError) as e:  # e.g. torch bfloat16 has no numpy dtype
        raise InvalidSpec(f"field {field!r}: cannot convert to a numpy array: {e}") from e
    if arr.dtype.kind not in _RAW_KINDS:
        raise InvalidSpec(
            f"field {field!r}: dtype {arr.dtype} cannot travel as raw bytes; "
            "use bool, integer, float or complex"
        )
    if arr.ndim == 0:
        raise ShapeMismatch(f"field {field!r} is a scalar: it needs a leading batch dimension")
    return np.ascontiguousarray(arr)


def _row_nbytes(dtype: str, row_shape: Iterable[int]) -> int:
    return np.dtype(dtype).itemsize * math.prod(row_shape)


@dataclass
class _Records:
    """Records read from one subject: (stream seq, payload) in order, and the last seq seen."""

    items: list[tuple[int, bytes]]
    last_seq: int


@dataclass
class _Partition:
    """What the index of a partition says, folded in commit order."""

    records: list[tuple[int, TqIndexRecord]]
    last_seq: int

    @property
    def next_row(self) -> int:
        return max((b for _, r in self.records if r.appended for _, b in r.rows), default=0)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for _, r in self.records for f in r.fields.values())

    def field_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for _, rec in self.records:
            for name, f in rec.fields.items():
                specs.setdefault(name, (f.dtype, tuple(f.row_shape)))
        return specs


@dataclass
class _Prepared:
    """One field of a put, ready to publish."""

    name: str
    arr: np.ndarray
    chunk_bytes: int

    @property
    def nbytes(self) -> int:
        return int(self.arr.nbytes)

    @property
    def parts(self) -> int:
        return math.ceil(self.nbytes / self.chunk_bytes) if self.nbytes else 0


class TrainingQueue:
    """Put / get_meta / get_data / clear over the ``<NS>_TQ`` stream.

    Holds nothing but the connection and its limits: every answer is read
    from the stream, so instances in different processes agree.
    """

    def __init__(
        self,
        broker: Broker,
        *,
        ttl_s: float = 3600.0,
        max_partition_bytes: int = DEFAULT_MAX_PARTITION_BYTES,
        chunk_bytes: int | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise InvalidSpec(f"ttl_s must be positive, got {ttl_s}")
        if max_partition_bytes <= 0:
            raise InvalidSpec(f"max_partition_bytes must be positive, got {max_partition_bytes}")
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise InvalidSpec(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.broker = broker
        # The server's TTL header takes whole seconds; round up so nothing expires early.
        self.ttl_s = max(1, math.ceil(ttl_s))
        self.max_partition_bytes = max_partition_bytes
        self._chunk_bytes = chunk_bytes

    # -- limits and names

    @property
    def chunk_bytes(self) -> int:
        """Largest chunk payload: the configured size, never above what one message can carry."""
        limit = max(1024, self.broker.max_payload - HEADER_MARGIN)
        return min(self._chunk_bytes, limit) if self._chunk_bytes else limit

    @property
    def stream(self) -> str:
        return self.broker.names.tq_stream

    # -- put

    async def async_put(
        self,
        data: Mapping[str, ArrayLike],
        *,
        tenant_id: str,
        partition_id: str | None = None,
        metadata: BatchMeta | None = None,
    ) -> BatchMeta:
        """Store fields for new rows (``partition_id``) or for ``metadata``'s rows (derived fields).

        Returns a BatchMeta of the rows written and where the new data lives.
        Raises ShapeMismatch (batch dims, or dtype/row shape against earlier
        puts of a field), PayloadTooLarge (partition cap) before publishing
        anything, InvalidSpec for bad names.
        """
        check_name("tenant_id", tenant_id)
        if metadata is not None:
            if metadata.tenant_id != tenant_id:
                raise InvalidSpec(
                    f"metadata belongs to tenant {metadata.tenant_id!r}, not {tenant_id!r}"
                )
            if partition_id is not None and partition_id != metadata.partition_id:
                raise InvalidSpec(
                    f"partition_id {partition_id!r} differs from the metadata's "
                    f"partition {metadata.partition_id!r}"
                )
            partition_id = metadata.partition_id
        if partition_id is None:
            raise InvalidSpec("async_put needs partition_id (new rows) or metadata (derived fields)")
        check_name("partition_id", partition_id)
        if not data:
            raise InvalidSpec("async_put got no fields")
        prepared = self._prepare(data, metadata)
        n_rows = len(prepared[0].arr)

        part = await self._read_index(tenant_id, partition_id)
        self._check_against(part, prepared, tenant_id, partition_id)
        if metadata is not None and metadata.rows:
            top = max(metadata.rows)
            if top >= part.next_row or min(metadata.rows) < 0:
                raise InvalidSpec(
                    f"metadata row {top} does not exist in partition {partition_id!r} "
                    f"of tenant {tenant_id!r} ({part.next_row} rows)"
                )

        stored = await self._publish_fields(tenant_id, partition_id, prepared)
        try:
            if metadata is not None:
                rows = list(metadata.rows)
                ranges = row_ranges(rows)
                rec = TqIndexRecord(rows=ranges, appended=False, fields=stored)
                await self._publish(self.broker.names.tq_index(tenant_id, partition_id), encode(rec))
            else:
                ranges = await self._append_rows(tenant_id, partition_id, part, n_rows, stored,
                                                 prepared)
                rows = list(range(ranges[0][0], ranges[0][1]))
        except Exception:
            await self._delete_quietly(s for f in stored.values() for s in f.seqs)
            raise
        return BatchMeta(
            tenant_id=tenant_id,
            partition_id=partition_id,
            rows=rows,
            fields={
                name: [TqSegment(rows=ranges, **msgspec.structs.asdict(f))]
                for name, f in stored.items()
            },
        )

    def _prepare(self, data: Mapping[str, ArrayLike], metadata: BatchMeta | None) -> list[_Prepared]:
        prepared = [_Prepared(check_field(k), to_numpy(k, v), self.chunk_bytes)
                    for k, v in data.items()]
        dims = {p.name: int(p.arr.shape[0]) for p in prepared}
        if metadata is not None:
            want = len(metadata.rows)
            bad = {k: d for k, d in dims.items() if d != want}
            if bad:
                raise ShapeMismatch(
                    f"derived fields must have one row per metadata row ({want}); got "
                    + ", ".join(f"{k}: {d}" for k, d in bad.items())
                )
            if len(set(metadata.rows)) != want:
                raise InvalidSpec("metadata lists a row more than once")
        elif len(set(dims.values())) > 1:
            raise ShapeMismatch(
                "fields of one put must have the same leading batch dimension; got "
                + ", ".join(f"{k}: {d}" for k, d in dims.items())
            )
        return prepared

    def _check_against(self, part: _Partition, prepared: list[_Prepared], tenant_id: str,
                       partition_id: str) -> None:
        specs = part.field_specs()
        for p in prepared:
            spec = specs.get(p.name)
            if spec is None:
                continue
            dtype, row_shape = spec
            if dtype != p.arr.dtype.str or row_shape != p.arr.shape[1:]:
                raise ShapeMismatch(
                    f"field {p.name!r} of partition {partition_id!r} (tenant {tenant_id!r}) "
                    f"holds rows of dtype {np.dtype(dtype)} shape {list(row_shape)}; this put "
                    f"has dtype {p.arr.dtype} shape {list(p.arr.shape[1:])}"
                )
        new = sum(p.nbytes for p in prepared)
        if part.nbytes + new > self.max_partition_bytes:
            raise PayloadTooLarge(
                f"partition {partition_id!r} of tenant {tenant_id!r} would hold "
                f"{part.nbytes + new} bytes ({part.nbytes} stored + {new} in this put), "
                f"over the limit of {self.max_partition_bytes} bytes; split the batch "
                "into several partitions"
            )

    async def _publish_fields(self, tenant_id: str, partition_id: str,
                              prepared: list[_Prepared]) -> dict[str, TqFieldData]:
        names = self.broker.names
        jobs: list[tuple[str, int, Callable[[], Awaitable[int]]]] = []
        for p in prepared:
            subject = names.tq_data(tenant_id, partition_id, p.name)
            # A byte view of the contiguous array: chunks are slices, not copies.
            flat = p.arr.reshape(-1).view(np.uint8).data if p.nbytes else memoryview(b"")
            shape = list(p.arr.shape)
            dtype = p.arr.dtype.str
            for k in range(p.parts):
                off = k * p.chunk_bytes
                hdr = encode(TqChunkHeader(field=p.name, dtype=dtype, shape=shape, offset=off,
                                           part=k, parts=p.parts)).decode()
                payload = flat[off:off + p.chunk_bytes]

                def job(subject: str = subject, payload: memoryview = payload,
                        hdr: str = hdr) -> Awaitable[int]:
                    return self._publish(subject, payload, {CHUNK_HEADER: hdr})

                jobs.append((p.name, k, job))
        results = await self._gather_limited([j for _, _, j in jobs], fail_cleanup=True)
        seqs: dict[str, list[int]] = {p.name: [] for p in prepared}
        for (name, _, _), seq in zip(jobs, results, strict=True):
            seqs[name].append(seq)
        return {
            p.name: TqFieldData(dtype=p.arr.dtype.str, row_shape=list(p.arr.shape[1:]),
                                nbytes=p.nbytes, chunk_bytes=p.chunk_bytes, seqs=seqs[p.name])
            for p in prepared
        }

    async def _append_rows(self, tenant_id: str, partition_id: str, part: _Partition, n_rows: int,
                           stored: dict[str, TqFieldData], prepared: list[_Prepared]) -> RowRanges:
        """Commit new rows: ids after the partition's last row, by compare-and-append."""
        subject = self.broker.names.tq_index(tenant_id, partition_id)
        for _ in range(MAX_APPEND_ATTEMPTS):
            start = part.next_row
            ranges: RowRanges = [(start, start + n_rows)]
            rec = TqIndexRecord(rows=ranges, appended=True, fields=stored)
            try:
                await self._publish(subject, encode(rec), expect_last_subject_seq=part.last_seq)
                return ranges
            except APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE:
                    raise
            # Someone committed first: fold in their records, re-check, take the next ids.
            more = await self._read_records(subject, part.last_seq + 1)
            part.records.extend((s, decode(d, TqIndexRecord)) for s, d in more.items)
            part.last_seq = max(part.last_seq, more.last_seq)
            self._check_against(part, prepared, tenant_id, partition_id)
        raise Conflict(
            f"could not append rows to partition {partition_id!r} of tenant {tenant_id!r}: "
            f"{MAX_APPEND_ATTEMPTS} concurrent commits won first; retry the put"
        )

    # -- get

    async def async_get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        *,
        tenant_id: str,
        partition_id: str,
        task_name: str,
    ) -> BatchMeta:
        """Claim up to ``batch_size`` rows (row order) that have all ``data_fields``
        and that ``task_name`` has not consumed; empty rows when none are ready.

        Raises UnknownPartition when the partition has no index records at all.
        """
        check_name("tenant_id", tenant_id)
        check_name("partition_id", partition_id)
        check_name("task_name", task_name)
        if not data_fields:
            raise InvalidSpec("async_get_meta needs at least one field")
        for f in data_fields:
            check_field(f)
        if batch_size <= 0:
            raise InvalidSpec(f"batch_size must be positive, got {batch_size}")
        claim_subject = self.broker.names.tq_consumed(tenant_id, partition_id, task_name)
        # Index and claims are independent reads: one round trip instead of two.
        part, first_claims = await asyncio.gather(
            self._read_index(tenant_id, partition_id), self._read_records(claim_subject, 1)
        )
        if not part.records:
            raise UnknownPartition(
                f"partition {partition_id!r} of tenant {tenant_id!r} has no data: never written, "
                "cleared, or expired"
            )
        n = part.next_row
        # Per field, which index record owns each row (-1: not produced); later records win.
        owner = {f: np.full(n, -1, dtype=np.int64) for f in dict.fromkeys(data_fields)}
        for i, (_, rec) in enumerate(part.records):
            for f, arr in owner.items():
                if f in rec.fields:
                    for a, b in rec.rows:
                        arr[a:b] = i
        ready = np.ones(n, dtype=bool)
        for arr in owner.values():
            ready &= arr >= 0

        claimed = np.zeros(n, dtype=bool)
        last_seq = 0
        more: _Records | None = first_claims
        for _ in range(MAX_APPEND_ATTEMPTS):
            if more is None:  # a concurrent claim won: read what it took
                more = await self._read_records(claim_subject, last_seq + 1)
            for _, d in more.items:
                for a, b in decode(d, TqClaimRecord).rows:
                    claimed[a:min(b, n)] = True
            last_seq = max(last_seq, more.last_seq)
            more = None
            rows = np.flatnonzero(ready & ~claimed)[:batch_size].tolist()
            if not rows:
                return BatchMeta(tenant_id=tenant_id, partition_id=partition_id,
                                 task_name=task_name)
            claim = TqClaimRecord(rows=row_ranges(rows))
            try:
                await self._publish(claim_subject, encode(claim), expect_last_subject_seq=last_seq)
                break
            except APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE:
                    raise
        else:
            raise Conflict(
                f"could not claim rows of partition {partition_id!r} (tenant {tenant_id!r}) for "
                f"task {task_name!r}: {MAX_APPEND_ATTEMPTS} concurrent claims won first"
            )

        fields: dict[str, list[TqSegment]] = {}
        idx = np.asarray(rows, dtype=np.int64)
        for f, arr in owner.items():
            used = np.unique(arr[idx]).tolist()  # sorted = commit order, as later wins
            fields[f] = [
                TqSegment(rows=part.records[i][1].rows,
                          **msgspec.structs.asdict(part.records[i][1].fields[f]))
                for i in used
            ]
        return BatchMeta(tenant_id=tenant_id, partition_id=partition_id, task_name=task_name,
                         rows=rows, fields=fields)

    async def async_get_data(self, meta: BatchMeta) -> dict[str, np.ndarray]:
        """The tensors of ``meta``'s fields for ``meta.rows``, in that order (writable arrays).

        Raises UnknownPartition when a chunk is gone (partition cleared or expired).
        """
        plans = {f: self._plan(meta, f, segs) for f, segs in meta.fields.items()}
        seqs = sorted({s for plan in plans.values() for s in plan.needed_seqs()})
        fetched = await self._gather_limited([self._fetch_factory(meta, s) for s in seqs])
        chunks = dict(zip(seqs, fetched, strict=True))
        return {f: plan.assemble(chunks) for f, plan in plans.items()}

    def _fetch_factory(self, meta: BatchMeta, seq: int) -> Callable[[], Awaitable[bytes]]:
        return lambda: self._fetch_chunk(meta, seq)

    def _plan(self, meta: BatchMeta, field: str, segs: list[TqSegment]) -> _ReadPlan:
        if not segs:
            raise InvalidSpec(f"metadata lists field {field!r} without data")
        dtype, row_shape = segs[0].dtype, tuple(segs[0].row_shape)
        for s in segs[1:]:
            if s.dtype != dtype or tuple(s.row_shape) != row_shape:
                raise ShapeMismatch(f"metadata segments of field {field!r} disagree on "
                                    f"dtype/shape: {dtype} {list(row_shape)} vs "
                                    f"{s.dtype} {s.row_shape}")
        rows = np.asarray(meta.rows, dtype=np.int64)
        seg_of = np.full(len(rows), -1, dtype=np.int64)
        pos_of = np.zeros(len(rows), dtype=np.int64)
        for i, s in enumerate(segs):
            off = 0
            for a, b in s.rows:
                m = (rows >= a) & (rows < b)
                seg_of[m] = i
                pos_of[m] = off + rows[m] - a
                off += b - a
        if len(rows) and (seg_of < 0).any():
            missing = rows[seg_of < 0][:5].tolist()
            raise InvalidSpec(f"metadata has no data of field {field!r} for rows {missing}")
        return _ReadPlan(field, np.dtype(dtype), row_shape, segs, seg_of, pos_of)

    async def _fetch_chunk(self, meta: BatchMeta, seq: int) -> bytes:
        try:
            msg = await self.broker.js.get_msg(self.stream, seq=seq, direct=True)
        except NotFoundError:
            raise UnknownPartition(
                f"partition {meta.partition_id!r} of tenant {meta.tenant_id!r} was cleared or "
                f"expired: its chunk at stream sequence {seq} is gone"
            ) from None
        except TimeoutError as e:
            raise Unavailable(f"reading chunk {seq} of {self.stream} timed out") from e
        prefix = self.broker.names.tq_partition(meta.tenant_id, meta.partition_id)[:-1]
        if not (msg.subject or "").startswith(prefix):
            # The sequence now holds something else: the partition's data is gone.
            raise UnknownPartition(
                f"partition {meta.partition_id!r} of tenant {meta.tenant_id!r} was cleared: "
                f"stream sequence {seq} is no longer its chunk"
            )
        return msg.data or b""

    # -- housekeeping

    async def async_clear_partition(self, tenant_id: str, partition_id: str) -> None:
        """Drop every message of the partition (data, index, claims)."""
        check_name("tenant_id", tenant_id)
        check_name("partition_id", partition_id)
        await self.broker.js.purge_stream(
            self.stream, subject=self.broker.names.tq_partition(tenant_id, partition_id)
        )

    async def list_partitions(self, tenant_id: str | None = None) -> dict[tuple[str, str], int]:
        """(tenant, partition) -> messages stored, committed or not (orphans show up too)."""
        if tenant_id is not None:
            check_name("tenant_id", tenant_id)
        filt = self.broker.names.tq_partition(tenant_id or "*", "*")
        info = await self.broker.js.stream_info(self.stream, subjects_filter=filt)
        out: dict[tuple[str, str], int] = {}
        for subject, count in (info.state.subjects or {}).items():
            tokens = subject.split(".")
            key = (tokens[2], tokens[3])
            out[key] = out.get(key, 0) + int(count)
        return out

    async def partition_bytes(self, tenant_id: str | None = None,
                              partition_id: str | None = None) -> int:
        """Tensor bytes committed in one partition, or in all of a tenant's partitions;
        with no arguments, the whole Training Queue stream's stored bytes."""
        if tenant_id is None:
            if partition_id is not None:
                raise InvalidSpec("partition_bytes: a partition_id needs its tenant_id")
            info = await self.broker.js.stream_info(self.stream)
            return int(info.state.bytes or 0)
        check_name("tenant_id", tenant_id)
        if partition_id is not None:
            check_name("partition_id", partition_id)
            return (await self._read_index(tenant_id, partition_id)).nbytes
        parts = [p for (_, p) in await self.list_partitions(tenant_id)]
        sizes = await asyncio.gather(*(self._read_index(tenant_id, p) for p in parts))
        return sum(s.nbytes for s in sizes)

    # -- plumbing

    async def _read_index(self, tenant_id: str, partition_id: str) -> _Partition:
        recs = await self._read_records(self.broker.names.tq_index(tenant_id, partition_id), 1)
        return _Partition([(s, decode(d, TqIndexRecord)) for s, d in recs.items], recs.last_seq)

    async def _read_records(self, subject: str, start_seq: int) -> _Records:
        """Every message on ``subject`` from ``start_seq`` on (batched direct gets)."""
        items, last = await read_subject(self.broker, self.stream, subject, start_seq,
                                         batch=READ_BATCH)
        return _Records(items, last)

    async def _publish(self, subject: str, payload: bytes | memoryview,
                       headers: dict[str, str] | None = None,
                       expect_last_subject_seq: int | None = None) -> int:
        """Publish with TTL and trace context; returns the stream sequence."""
        hdrs = tracing.inject(headers if headers is not None else {})
        if expect_last_subject_seq is not None:
            hdrs[EXPECTED_LAST_SUBJECT_SEQ] = str(expect_last_subject_seq)
        try:
            ack = await self.broker.js.publish(subject, payload,  # type: ignore[arg-type]
                                               timeout=REQUEST_TIMEOUT_S, headers=hdrs,
                                               stream=self.stream, msg_ttl=self.ttl_s)
        except APIError as e:
            desc = (e.description or "").lower()
            if "maximum" in desc or "resource" in desc:
                raise PayloadTooLarge(
                    f"the Training Queue stream {self.stream} refused {subject}: "
                    f"{e.description}; clear finished partitions or raise tq_max_bytes"
                ) from e
            raise
        except TimeoutError as e:
            raise Unavailable(f"publishing to {subject} timed out") from e
        return int(ack.seq)

    async def _gather_limited(self, jobs: list[Callable[[], Awaitable[T]]],
                              fail_cleanup: bool = False) -> list[T]:
        """Run ``jobs`` with at most MAX_IN_FLIGHT at once; results in order. With
        ``fail_cleanup`` (jobs publish and return seqs), a failure deletes what was stored."""
        sem = asyncio.Semaphore(MAX_IN_FLIGHT)

        async def one(job: Callable[[], Awaitable[T]]) -> T:
            async with sem:
                return await job()

        results = await asyncio.gather(*(one(j) for j in jobs), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if fail_cleanup:
                await self._delete_quietly(r for r in results if isinstance(r, int))
            raise errors[0]
        return results  # type: ignore[return-value]

    async def _delete_quietly(self, seqs: Iterable[int]) -> None:
        """Best effort: chunks of a failed put would otherwise wait for their TTL."""
        for s in list(seqs):
            try:
                await self.broker.js.delete_msg(self.stream, s)
            except Exception:  # already gone, or the server is away: the TTL covers it
                pass


@dataclass
class _ReadPlan:
    """How to rebuild one field for meta.rows from chunks of its segments."""

    field: str
    dtype: np.dtype[Any]
    row_shape: tuple[int, ...]
    segs: list[TqSegment]
    seg_of: np.ndarray  # per output row: index into segs
    pos_of: np.ndarray  # per output row: its row position in that segment's tensor

    @property
    def row_nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.row_shape)

    def runs(self) -> list[tuple[int, int, int, int]]:
        """(out_start, out_stop, seg, pos_start): output rows that are consecutive in one segment."""
        n = len(self.seg_of)
        if n == 0:
            return []
        brk = np.flatnonzero((np.diff(self.seg_of) != 0) | (np.diff(self.pos_of) != 1)) + 1
        starts = [0, *brk.tolist()]
        stops = [*brk.tolist(), n]
        return [(a, b, int(self.seg_of[a]), int(self.pos_of[a])) for a, b in
                zip(starts, stops, strict=True)]

    def needed_seqs(self) -> set[int]:
        rb = self.row_nbytes
        out: set[int] = set()
        if rb == 0:
            return out
        for a, b, s, p in self.runs():
            seg = self.segs[s]
            lo, hi = p * rb, (p + b - a) * rb
            out.update(seg.seqs[lo // seg.chunk_bytes:(hi - 1) // seg.chunk_bytes + 1])
        return out

    def assemble(self, chunks: Mapping[int, bytes]) -> np.ndarray:
        rb = self.row_nbytes
        out = np.empty((len(self.seg_of), *self.row_shape), dtype=self.dtype)
        if rb == 0 or out.size == 0:
            return out
        dst = out.reshape(-1).view(np.uint8).data
        for a, b, s, p in self.runs():
            seg = self.segs[s]
            cb = seg.chunk_bytes
            lo, hi = p * rb, (p + b - a) * rb
            d = a * rb
            for k in range(lo // cb, (hi - 1) // cb + 1):
                c0 = k * cb
                data = chunks[seg.seqs[k]]
                want = min(cb, seg.nbytes - c0)
                if len(data) != want:
                    raise InvalidMessage(
                        f"chunk {seg.seqs[k]} of field {self.field!r} has {len(data)} bytes, "
                        f"its index says {want}"
                    )
                x0, x1 = max(lo, c0), min(hi, c0 + cb)
                dst[d:d + x1 - x0] = memoryview(data)[x0 - c0:x1 - c0]
                d += x1 - x0
        return out
