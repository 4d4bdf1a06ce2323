"""The Training Queue's rows, pure (no I/O): field names and arrays as they travel
(:func:`check_field`, :func:`to_numpy`), what a partition's index says
(:class:`Partition`), one field of a put ready to publish (:class:`Prepared`), and
how to rebuild a field for some rows from its chunks (:func:`read_plan`,
:class:`ReadPlan`). broker/tq.py, the :class:`joynexus.broker.tq.TrainingQueue`,
does the reading and writing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from joynexus.schemas.errors import InvalidMessage, InvalidSpec, PayloadTooLarge, ShapeMismatch
from joynexus.schemas.jobs import check_name
from joynexus.schemas.tq import BatchMeta, TqIndexRecord, TqSegment

#: Kinds of numpy dtypes that travel as raw bytes (bool, ints, floats, complex).
_RAW_KINDS = "biufc"
_FIELD = re.compile(r"^[a-z0-9_]{1,64}$")

ArrayLike = Any


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


@dataclass
class Partition:
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

    def owners(self, data_fields: list[str]) -> dict[str, np.ndarray]:
        """Per field, which index record owns each row (-1: not produced); later records win."""
        n = self.next_row
        owner = {f: np.full(n, -1, dtype=np.int64) for f in dict.fromkeys(data_fields)}
        for i, (_, rec) in enumerate(self.records):
            for f, arr in owner.items():
                if f in rec.fields:
                    for a, b in rec.rows:
                        arr[a:b] = i
        return owner

    def segments(self, owner: dict[str, np.ndarray], rows: list[int]) -> dict[str, list[TqSegment]]:
        """The segments holding ``rows`` of each field of ``owner`` (:meth:`owners`)."""
        fields: dict[str, list[TqSegment]] = {}
        idx = np.asarray(rows, dtype=np.int64)
        for f, arr in owner.items():
            used = np.unique(arr[idx]).tolist()  # sorted = commit order, as later wins
            fields[f] = [
                TqSegment(rows=self.records[i][1].rows,
                          **msgspec.structs.asdict(self.records[i][1].fields[f]))
                for i in used
            ]
        return fields


@dataclass
class Prepared:
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


@dataclass
class ReadPlan:
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


def read_plan(meta: BatchMeta, field: str, segs: list[TqSegment]) -> ReadPlan:
    """How to rebuild ``field`` for ``meta.rows`` from the chunks of its segments."""
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
    return ReadPlan(field, np.dtype(dtype), row_shape, segs, seg_of, pos_of)


def put_partition(tenant_id: str, partition_id: str | None, metadata: BatchMeta | None) -> str:
    """The partition a put writes to: ``partition_id`` (new rows) or ``metadata``'s
    (derived fields), the names checked."""
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
    return partition_id


def prepare(data: Mapping[str, ArrayLike], metadata: BatchMeta | None, chunk_bytes: int) -> list[Prepared]:
    """The fields of a put, checked (names, dtypes, one row per metadata row) and ready."""
    prepared = [Prepared(check_field(k), to_numpy(k, v), chunk_bytes)
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


def check_against(part: Partition, prepared: list[Prepared], tenant_id: str, partition_id: str,
                  max_partition_bytes: int) -> None:
    """A put against what its partition holds: each field's dtype and row shape, the size cap."""
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
    if part.nbytes + new > max_partition_bytes:
        raise PayloadTooLarge(
            f"partition {partition_id!r} of tenant {tenant_id!r} would hold "
            f"{part.nbytes + new} bytes ({part.nbytes} stored + {new} in this put), "
            f"over the limit of {max_partition_bytes} bytes; split the batch "
            "into several partitions"
        )
