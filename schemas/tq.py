"""Wire records of the Training Queue (stream ``<NS>_TQ``).

Rows exist for readers only once their :class:`TqIndexRecord` does (written
after the field's chunks, each described by a :class:`TqChunkHeader`);
:class:`TqClaimRecord` claims rows per task. :class:`BatchMeta` is plain data
(rows plus the chunk references to read them), so it can travel inside other
messages. Row ranges are half-open ``(start, stop)`` pairs, in the order the
rows appear along the tensor's leading dimension.

See docs/ARCHITECTURE.md, "The Training Queue".
"""

from __future__ import annotations

from joynexus.schemas.base import WIRE_VERSION, Wire

#: NATS header carrying a chunk's :class:`TqChunkHeader` (JSON).
CHUNK_HEADER = "Jnx-Tq-Chunk"

RowRanges = list[tuple[int, int]]


class TqChunkHeader(Wire, kw_only=True):
    """Self-description of one data chunk: enough to rebuild its tensor without the index."""

    v: int = WIRE_VERSION
    field: str
    #: numpy ``dtype.str``, byte order included (``<f4``, ``|b1``, ``|u1``).
    dtype: str
    #: Shape of the whole tensor this chunk is a slice of (leading dim = rows).
    shape: list[int]
    #: Byte offset of this chunk in the tensor's C-contiguous bytes.
    offset: int
    part: int
    parts: int


class TqFieldData(Wire, kw_only=True):
    """Where one field's tensor of one put lives: its chunks, by stream sequence."""

    dtype: str
    #: Shape of one row (the tensor's shape without its leading dim).
    row_shape: list[int]
    #: Total bytes of the tensor; chunk ``k`` holds bytes ``[k*chunk_bytes, (k+1)*chunk_bytes)``.
    nbytes: int
    chunk_bytes: int
    seqs: list[int]


class TqSegment(TqFieldData, kw_only=True):
    """One field of one put as a BatchMeta references it: the chunks plus the rows they hold."""

    rows: RowRanges


class TqIndexRecord(Wire, kw_only=True):
    """The commit point of one put: these rows now have these fields."""

    v: int = WIRE_VERSION
    rows: RowRanges
    #: True when the put created these rows (allocated with compare-and-append);
    #: False for derived fields written onto existing rows.
    appended: bool
    fields: dict[str, TqFieldData]


class TqClaimRecord(Wire, kw_only=True):
    """Rows one task took from a partition (appended with compare-and-append)."""

    v: int = WIRE_VERSION
    rows: RowRanges


class BatchMeta(Wire, kw_only=True):
    """A batch of rows of one partition and, per field, where their data lives.

    ``fields[name]`` lists segments in commit order; when two segments hold the
    same row (a field rewritten), the later one wins.
    """

    v: int = WIRE_VERSION
    tenant_id: str
    partition_id: str
    #: The task that claimed these rows ("" for the meta a put returns).
    task_name: str = ""
    rows: list[int] = []
    fields: dict[str, list[TqSegment]] = {}

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def field_names(self) -> list[str]:
        return list(self.fields)


def row_ranges(rows: list[int]) -> RowRanges:
    """Compress rows (in their given order) into runs of consecutive ids."""
    out: RowRanges = []
    start = prev = -2
    for r in rows:
        if r == prev + 1:
            prev = r
            continue
        if start >= 0:
            out.append((start, prev + 1))
        start = prev = r
    if start >= 0:
        out.append((start, prev + 1))
    return out


def ranges_len(ranges: RowRanges) -> int:
    return sum(b - a for a, b in ranges)
