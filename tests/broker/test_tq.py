"""The Training Queue against a real nats-server: round trips, chunking, derived
fields, per-task claims under races, validation, clearing, TTL and tracing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider

from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import (
    Conflict,
    InvalidSpec,
    PayloadTooLarge,
    ShapeMismatch,
    UnknownPartition,
)
from joynexus.schemas.tq import CHUNK_HEADER, BatchMeta, TqChunkHeader, row_ranges

T = "acme"


def sample(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n, 3, 5)).astype(np.float32),
        "tokens": rng.integers(-(2**40), 2**40, size=(n, 7), dtype=np.int64),
        "done": rng.random(n) > 0.5,
        "image": rng.integers(0, 256, size=(n, 8, 8, 3), dtype=np.uint8),
    }


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()


async def stream_msgs(broker: Broker, filt: str) -> int:
    info = await broker.js.stream_info(broker.names.tq_stream, subjects_filter=filt)
    return sum((info.state.subjects or {}).values())


def test_row_ranges() -> None:
    assert row_ranges([]) == []
    assert row_ranges([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 7), (9, 10)]
    assert row_ranges([3, 2]) == [(3, 4), (2, 3)]


async def test_round_trip_bit_exact(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    data = sample(10)
    put = await tq.async_put(data, tenant_id=T, partition_id="p1")
    assert put.rows == list(range(10))
    meta = await tq.async_get_meta(list(data), 100, tenant_id=T, partition_id="p1",
                                   task_name="train")
    assert meta.rows == list(range(10))
    got = await tq.async_get_data(meta)
    assert set(got) == set(data)
    for k in data:
        assert_same(got[k], data[k])
    # The meta a put returns reads back too, and BatchMeta survives the wire.
    again = await tq.async_get_data(decode(encode(put), BatchMeta))
    assert_same(again["image"], data["image"])


async def test_a_put_at_its_row_is_written_once(broker: Broker) -> None:
    """A put repeated after a lost reply (the same rows at the same ``at_row``) adds
    nothing and stores nothing; a put past the rows there is refused; order holds."""
    tq = TrainingQueue(broker)
    a, b = sample(4, seed=1), sample(3, seed=2)
    first = await tq.async_put(a, tenant_id=T, partition_id="once", at_row=0)
    msgs = await stream_msgs(broker, broker.names.tq_partition(T, "once"))
    again = await tq.async_put(a, tenant_id=T, partition_id="once", at_row=0)
    assert first.rows == again.rows == [0, 1, 2, 3] and first.fields and not again.fields
    assert await stream_msgs(broker, broker.names.tq_partition(T, "once")) == msgs
    with pytest.raises(Conflict, match="has 4 rows"):
        await tq.async_put(b, tenant_id=T, partition_id="once", at_row=5)
    assert (await tq.async_put(b, tenant_id=T, partition_id="once", at_row=4)).rows == [4, 5, 6]
    meta = await tq.async_get_meta(list(a), 100, tenant_id=T, partition_id="once", task_name="t")
    got = await tq.async_get_data(meta)
    assert meta.rows == list(range(7))
    assert_same(got["obs"], np.concatenate([a["obs"], b["obs"]]))


async def test_rows_continue_and_objects_with_array(broker: Broker) -> None:
    class Wrapped:  # anything with __array__
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            return self.a

    tq = TrainingQueue(broker)
    a = np.arange(12, dtype=np.float64).reshape(4, 3)
    m1 = await tq.async_put({"x": a}, tenant_id=T, partition_id="p")
    m2 = await tq.async_put({"x": Wrapped(a[:2] + 100)}, tenant_id=T, partition_id="p")
    assert m1.rows == [0, 1, 2, 3]
    assert m2.rows == [4, 5]
    meta = await tq.async_get_meta(["x"], 10, tenant_id=T, partition_id="p", task_name="t")
    got = await tq.async_get_data(meta)
    assert_same(got["x"], np.concatenate([a, a[:2] + 100]))
    assert len(meta.fields["x"]) == 2


async def test_large_partition_is_chunked(broker: Broker) -> None:
    tq = TrainingQueue(broker, chunk_bytes=100_000)
    big = np.random.default_rng(1).standard_normal((50, 1000)).astype(np.float32)  # 200 kB
    put = await tq.async_put({"big": big}, tenant_id=T, partition_id="big")
    seg = put.fields["big"][0]
    assert len(seg.seqs) == 2
    msg = await broker.js.get_msg(broker.names.tq_stream, seq=seg.seqs[1], direct=True)
    hdr = decode(msg.headers[CHUNK_HEADER], TqChunkHeader)
    assert (hdr.part, hdr.parts, hdr.offset, hdr.shape) == (1, 2, 100_000, [50, 1000])
    meta = await tq.async_get_meta(["big"], 50, tenant_id=T, partition_id="big", task_name="t")
    assert_same((await tq.async_get_data(meta))["big"], big)


async def test_default_chunking_above_one_message(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    n = (broker.max_payload * 2) // 4 // 1000 + 1  # rows of 1000 float32: > 2 messages
    big = np.arange(n * 1000, dtype=np.float32).reshape(n, 1000)
    put = await tq.async_put({"big": big}, tenant_id=T, partition_id="big")
    assert len(put.fields["big"][0].seqs) == 3
    meta = await tq.async_get_meta(["big"], n, tenant_id=T, partition_id="big", task_name="t")
    assert_same((await tq.async_get_data(meta))["big"], big)


async def test_chunked_rows_read_in_small_batches(broker: Broker) -> None:
    # Rows straddle chunk boundaries (12-byte rows, 100-byte chunks).
    tq = TrainingQueue(broker, chunk_bytes=100)
    a = np.arange(90, dtype=np.int32).reshape(30, 3)
    await tq.async_put({"a": a}, tenant_id=T, partition_id="p")
    seen = []
    for _ in range(4):
        meta = await tq.async_get_meta(["a"], 8, tenant_id=T, partition_id="p", task_name="t")
        got = await tq.async_get_data(meta)
        assert_same(got["a"], a[meta.rows])
        seen += meta.rows
    assert seen == list(range(30))


async def test_derived_fields_against_metadata(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    data = sample(6)
    await tq.async_put(data, tenant_id=T, partition_id="p")
    meta = await tq.async_get_meta(["obs"], 3, tenant_id=T, partition_id="p", task_name="adv")
    assert meta.rows == [0, 1, 2]
    adv = np.array([[0.5], [1.5], [2.5]], dtype=np.float32)
    out = await tq.async_put({"adv": adv}, tenant_id=T, metadata=meta)
    assert out.rows == [0, 1, 2]
    # Only rows with both fields are offered to a task that needs both.
    m2 = await tq.async_get_meta(["obs", "adv"], 10, tenant_id=T, partition_id="p",
                                 task_name="actor")
    assert m2.rows == [0, 1, 2]
    got = await tq.async_get_data(m2)
    assert_same(got["adv"], adv)
    assert_same(got["obs"], data["obs"][:3])
    # Nothing more ready for the actor until the rest get advantages.
    m3 = await tq.async_get_meta(["obs", "adv"], 10, tenant_id=T, partition_id="p",
                                 task_name="actor")
    assert m3.rows == []
    assert m3.fields == {}
    rest = await tq.async_get_meta(["obs"], 10, tenant_id=T, partition_id="p", task_name="adv")
    assert rest.rows == [3, 4, 5]
    adv2 = np.array([[3.5], [4.5], [5.5]], dtype=np.float32)
    await tq.async_put({"adv": adv2}, tenant_id=T, metadata=rest)
    m4 = await tq.async_get_meta(["adv"], 10, tenant_id=T, partition_id="p", task_name="actor")
    assert m4.rows == [3, 4, 5]
    assert_same((await tq.async_get_data(m4))["adv"], adv2)


async def test_derived_fields_for_scattered_rows(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    await tq.async_put({"x": np.arange(10, dtype=np.int64)}, tenant_id=T, partition_id="p")
    meta = BatchMeta(tenant_id=T, partition_id="p", rows=[7, 2, 3])
    await tq.async_put({"y": np.array([70, 20, 30], dtype=np.int16)}, tenant_id=T, metadata=meta)
    got_meta = await tq.async_get_meta(["x", "y"], 10, tenant_id=T, partition_id="p",
                                       task_name="t")
    assert got_meta.rows == [2, 3, 7]
    got = await tq.async_get_data(got_meta)
    assert got["y"].tolist() == [20, 30, 70]
    assert got["x"].tolist() == [2, 3, 7]


async def test_tasks_consume_independently(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    await tq.async_put({"x": np.arange(10, dtype=np.int64)}, tenant_id=T, partition_id="p")
    a1 = await tq.async_get_meta(["x"], 4, tenant_id=T, partition_id="p", task_name="a")
    b1 = await tq.async_get_meta(["x"], 6, tenant_id=T, partition_id="p", task_name="b")
    a2 = await tq.async_get_meta(["x"], 100, tenant_id=T, partition_id="p", task_name="a")
    a3 = await tq.async_get_meta(["x"], 100, tenant_id=T, partition_id="p", task_name="a")
    assert a1.rows == [0, 1, 2, 3]
    assert b1.rows == [0, 1, 2, 3, 4, 5]
    assert a2.rows == [4, 5, 6, 7, 8, 9]
    assert a3.rows == []
    # New rows become available to a task that drained the partition.
    await tq.async_put({"x": np.arange(2, dtype=np.int64)}, tenant_id=T, partition_id="p")
    a4 = await tq.async_get_meta(["x"], 100, tenant_id=T, partition_id="p", task_name="a")
    assert a4.rows == [10, 11]


async def test_racing_consumers_of_one_task_get_disjoint_rows(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    await tq.async_put({"x": np.arange(40, dtype=np.int64)}, tenant_id=T, partition_id="p")
    # Separate connections, as separate agents would have.
    others = [await Broker.connect(broker.nc.connected_url.geturl(), name=f"c{i}",  # type: ignore[union-attr]
                                   namespace=broker.names.namespace) for i in range(3)]
    try:
        queues = [tq] + [TrainingQueue(b) for b in others]

        async def drain(q: TrainingQueue) -> list[int]:
            got: list[int] = []
            while True:
                m = await q.async_get_meta(["x"], 3, tenant_id=T, partition_id="p",
                                           task_name="train")
                if not m.rows:
                    return got
                data = await q.async_get_data(m)
                assert data["x"].tolist() == m.rows
                got += m.rows

        results = await asyncio.gather(*(drain(q) for q in queues))
    finally:
        for b in others:
            await b.close()
    flat = [r for rs in results for r in rs]
    assert sorted(flat) == list(range(40))
    assert len(flat) == len(set(flat))


async def test_concurrent_producers_get_distinct_rows(broker: Broker) -> None:
    tq = TrainingQueue(broker)

    async def put(i: int) -> BatchMeta:
        return await tq.async_put({"x": np.full(3, i, dtype=np.int32)}, tenant_id=T,
                                  partition_id="p")

    metas = await asyncio.gather(*(put(i) for i in range(6)))
    rows = [r for m in metas for r in m.rows]
    assert sorted(rows) == list(range(18))
    meta = await tq.async_get_meta(["x"], 100, tenant_id=T, partition_id="p", task_name="t")
    x = (await tq.async_get_data(meta))["x"]
    for i, m in enumerate(metas):
        assert x[m.rows].tolist() == [i] * 3


async def test_shape_and_dtype_mismatches(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    with pytest.raises(ShapeMismatch, match=r"obs: 4.*act: 5"):
        await tq.async_put({"obs": np.zeros((4, 2)), "act": np.zeros((5, 2))}, tenant_id=T,
                           partition_id="p")
    await tq.async_put({"obs": np.zeros((4, 2), np.float32)}, tenant_id=T, partition_id="p")
    with pytest.raises(ShapeMismatch, match=r"'obs'.*float32.*\[2\].*float64"):
        await tq.async_put({"obs": np.zeros((4, 2), np.float64)}, tenant_id=T, partition_id="p")
    with pytest.raises(ShapeMismatch, match=r"'obs'.*shape \[2\].*shape \[3\]"):
        await tq.async_put({"obs": np.zeros((4, 3), np.float32)}, tenant_id=T, partition_id="p")
    meta = await tq.async_get_meta(["obs"], 2, tenant_id=T, partition_id="p", task_name="t")
    with pytest.raises(ShapeMismatch, match=r"\(2\).*adv: 3"):
        await tq.async_put({"adv": np.zeros(3)}, tenant_id=T, metadata=meta)
    with pytest.raises(ShapeMismatch, match="scalar"):
        await tq.async_put({"s": np.float32(1.0)}, tenant_id=T, partition_id="p")
    # None of the failed puts left rows behind.
    left = await tq.async_get_meta(["obs"], 100, tenant_id=T, partition_id="p", task_name="u")
    assert left.rows == [0, 1, 2, 3]


async def test_bad_names(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    for bad in ("Obs", "a.b", "x-y", "", "a*"):
        with pytest.raises(InvalidSpec, match="field name"):
            await tq.async_put({bad: np.zeros(2)}, tenant_id=T, partition_id="p")
    with pytest.raises(InvalidSpec, match="partition_id"):
        await tq.async_put({"x": np.zeros(2)}, tenant_id=T, partition_id="a.b")
    with pytest.raises(InvalidSpec, match="tenant_id"):
        await tq.async_put({"x": np.zeros(2)}, tenant_id="A B", partition_id="p")
    with pytest.raises(InvalidSpec, match="dtype"):
        await tq.async_put({"x": np.array(["a", "b"], dtype=object)}, tenant_id=T,
                           partition_id="p")
    with pytest.raises(InvalidSpec, match="partition_id"):
        await tq.async_put({"x": np.zeros(2)}, tenant_id=T)
    assert await stream_msgs(broker, broker.names.all_tq) == 0


async def test_oversized_put_publishes_nothing(broker: Broker) -> None:
    tq = TrainingQueue(broker, max_partition_bytes=1000)
    with pytest.raises(PayloadTooLarge, match=r"1600 bytes.*1000 bytes"):
        await tq.async_put({"x": np.zeros(200, np.float64)}, tenant_id=T, partition_id="p")
    assert await stream_msgs(broker, broker.names.all_tq) == 0
    await tq.async_put({"x": np.zeros(100, np.float64)}, tenant_id=T, partition_id="p")
    before = await stream_msgs(broker, broker.names.all_tq)
    with pytest.raises(PayloadTooLarge, match=r"800 stored \+ 800"):
        await tq.async_put({"x": np.zeros(100, np.float64)}, tenant_id=T, partition_id="p")
    assert await stream_msgs(broker, broker.names.all_tq) == before


async def test_unknown_partition(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    with pytest.raises(UnknownPartition, match="'nope' of tenant 'acme' has no data"):
        await tq.async_get_meta(["x"], 1, tenant_id=T, partition_id="nope", task_name="t")


async def test_clear_partition(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    await tq.async_put(sample(5), tenant_id=T, partition_id="p")
    await tq.async_put(sample(2), tenant_id=T, partition_id="keep")
    meta = await tq.async_get_meta(["obs"], 5, tenant_id=T, partition_id="p", task_name="t")
    assert await tq.partition_bytes(T, "p") > 0
    assert set(await tq.list_partitions(T)) == {(T, "p"), (T, "keep")}
    total = await tq.partition_bytes(T)
    await tq.async_clear_partition(T, "p")
    assert await tq.partition_bytes(T, "p") == 0
    assert await stream_msgs(broker, broker.names.tq_partition(T, "p")) == 0
    assert set(await tq.list_partitions()) == {(T, "keep")}
    assert 0 < await tq.partition_bytes(T) < total
    with pytest.raises(UnknownPartition, match="cleared"):
        await tq.async_get_data(meta)
    with pytest.raises(UnknownPartition):
        await tq.async_get_meta(["obs"], 5, tenant_id=T, partition_id="p", task_name="t")


async def test_messages_carry_traceparent_and_ttl(broker: Broker) -> None:
    tq = TrainingQueue(broker, ttl_s=90)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("put") as span:
        put = await tq.async_put({"x": np.arange(4, dtype=np.int32)}, tenant_id=T,
                                 partition_id="p")
        meta = await tq.async_get_meta(["x"], 4, tenant_id=T, partition_id="p", task_name="t")
        trace_id = format(span.get_span_context().trace_id, "032x")
    assert meta.rows == [0, 1, 2, 3]
    stream = broker.names.tq_stream
    subjects = [broker.names.tq_index(T, "p"), broker.names.tq_consumed(T, "p", "t")]
    msgs = [await broker.js.get_msg(stream, seq=put.fields["x"][0].seqs[0], direct=True)]
    msgs += [await broker.js.get_last_msg(stream, s, direct=True) for s in subjects]
    for m in msgs:
        assert m.headers is not None
        assert m.headers["Nats-TTL"] == "90"
        assert m.headers["traceparent"].split("-")[1] == trace_id


async def test_zero_rows_and_empty_requests(broker: Broker) -> None:
    tq = TrainingQueue(broker)
    with pytest.raises(InvalidSpec, match="no fields"):
        await tq.async_put({}, tenant_id=T, partition_id="p")
    await tq.async_put({"x": np.zeros((3, 0), np.float32)}, tenant_id=T, partition_id="p")
    meta = await tq.async_get_meta(["x"], 5, tenant_id=T, partition_id="p", task_name="t")
    assert meta.rows == [0, 1, 2]
    assert (await tq.async_get_data(meta))["x"].shape == (3, 0)
    with pytest.raises(InvalidSpec, match="batch_size"):
        await tq.async_get_meta(["x"], 0, tenant_id=T, partition_id="p", task_name="t")


async def test_reads_page_through_many_records(broker: Broker,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import joynexus.broker.tq as tq_module

    monkeypatch.setattr(tq_module, "READ_BATCH", 2)  # force several batched direct gets
    tq = TrainingQueue(broker)
    for i in range(5):
        await tq.async_put({"x": np.full(2, i, np.int8)}, tenant_id=T, partition_id="p")
    for _ in range(5):
        await tq.async_get_meta(["x"], 1, tenant_id=T, partition_id="p", task_name="t")
    meta = await tq.async_get_meta(["x"], 100, tenant_id=T, partition_id="p", task_name="t")
    assert meta.rows == [5, 6, 7, 8, 9]
    assert (await tq.async_get_data(meta))["x"].tolist() == [2, 3, 3, 4, 4]
