"""The Training Queue: a sample-oriented tensor store on JetStream (TransferQueue-style).

Producers put fields (tensors with a leading row dimension) into a tenant's
partition; consumers claim rows whose requested fields are all produced,
per task. Everything is in one stream, so any agent in any process can use a
partition and it survives restarts of either side. The invariants: an index
record is written after its chunks (the commit point); row ids and claims are
compare-and-append, so producers never share ids and two consumers of a task
never get the same row; tensors travel as raw bytes with dtype and shape in a
header, never pickle.

Field checks, index folding and read plans, pure, are in broker/tqrows.py. See
docs/ARCHITECTURE.md, "The Training Queue" (subjects, TTLs, clearing).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import numpy as np
from nats.js.errors import APIError, NotFoundError

from joynexus.broker import tracing
from joynexus.broker.connection import Broker
from joynexus.broker.direct import read_subject
from joynexus.broker.errcodes import WRONG_LAST_SEQUENCE
from joynexus.broker.headers import EXPECTED_LAST_SUBJECT_SEQ
from joynexus.broker.tqrows import (
    ArrayLike,
    Partition,
    Prepared,
    check_against,
    check_field,
    prepare,
    put_partition,
    read_plan,
)
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import (
    Conflict,
    InvalidSpec,
    PayloadTooLarge,
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

T = TypeVar("T")


@dataclass
class _Records:
    """Records read from one subject: (stream seq, payload) in order, and the last seq seen."""

    items: list[tuple[int, bytes]]
    last_seq: int


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
        at_row: int | None = None,
    ) -> BatchMeta:
        """Store fields for new rows (``partition_id``) or for ``metadata``'s rows (derived fields).

        ``at_row`` (new rows only): the first new row's id, so a put repeated after a
        lost reply adds nothing: rows ``at_row ..`` already there are not written again
        (the returned meta lists them, without fields), and a partition with fewer
        rows than ``at_row`` refuses the put (``Conflict``: rows before it are missing).
        The compare-and-append commits the new rows only at ``at_row``.

        Returns a BatchMeta of the rows written and where the new data lives.
        Raises ShapeMismatch (batch dims, or dtype/row shape against earlier
        puts of a field), PayloadTooLarge (partition cap) before publishing
        anything, InvalidSpec for bad names.
        """
        partition_id = put_partition(tenant_id, partition_id, metadata)
        if not data:
            raise InvalidSpec("async_put got no fields")
        prepared = prepare(data, metadata, self.chunk_bytes)
        n_rows = len(prepared[0].arr)

        part = await self._read_index(tenant_id, partition_id)
        if at_row is not None and metadata is None:
            if part.next_row >= at_row + n_rows:  # put before (its reply was lost): done
                return BatchMeta(tenant_id=tenant_id, partition_id=partition_id,
                                 rows=list(range(at_row, at_row + n_rows)), fields={})
            if part.next_row != at_row:
                raise Conflict(
                    f"partition {partition_id!r} of tenant {tenant_id!r} has {part.next_row} "
                    f"rows; a put at row {at_row} of {n_rows} rows fits neither after them "
                    "nor over an earlier put"
                )
        check_against(part, prepared, tenant_id, partition_id, self.max_partition_bytes)
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
                                                 prepared, at_row)
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

    async def _publish_fields(self, tenant_id: str, partition_id: str,
                              prepared: list[Prepared]) -> dict[str, TqFieldData]:
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

    async def _append_rows(self, tenant_id: str, partition_id: str, part: Partition, n_rows: int,
                           stored: dict[str, TqFieldData], prepared: list[Prepared],
                           at_row: int | None = None) -> RowRanges:
        """Commit new rows: ids after the partition's last row, by compare-and-append
        (with ``at_row``: only there; another put committed first: ``Conflict``)."""
        subject = self.broker.names.tq_index(tenant_id, partition_id)
        for _ in range(MAX_APPEND_ATTEMPTS):
            start = part.next_row
            if at_row is not None and start != at_row:
                raise Conflict(
                    f"partition {partition_id!r} of tenant {tenant_id!r}: another put committed "
                    f"rows from {at_row} first"
                )
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
            check_against(part, prepared, tenant_id, partition_id, self.max_partition_bytes)
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
        owner = part.owners(data_fields)
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

        return BatchMeta(tenant_id=tenant_id, partition_id=partition_id, task_name=task_name,
                         rows=rows, fields=part.segments(owner, rows))

    async def async_get_data(self, meta: BatchMeta) -> dict[str, np.ndarray]:
        """The tensors of ``meta``'s fields for ``meta.rows``, in that order (writable arrays).

        Raises UnknownPartition when a chunk is gone (partition cleared or expired).
        """
        plans = {f: read_plan(meta, f, segs) for f, segs in meta.fields.items()}
        seqs = sorted({s for plan in plans.values() for s in plan.needed_seqs()})
        fetched = await self._gather_limited([self._fetch_factory(meta, s) for s in seqs])
        chunks = dict(zip(seqs, fetched, strict=True))
        return {f: plan.assemble(chunks) for f, plan in plans.items()}

    def _fetch_factory(self, meta: BatchMeta, seq: int) -> Callable[[], Awaitable[bytes]]:
        return lambda: self._fetch_chunk(meta, seq)

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

    async def _read_index(self, tenant_id: str, partition_id: str) -> Partition:
        recs = await self._read_records(self.broker.names.tq_index(tenant_id, partition_id), 1)
        return Partition([(s, decode(d, TqIndexRecord)) for s, d in recs.items], recs.last_seq)

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
