"""The KV watch's end-of-current-values marker (broker/kvwatch.py): one ``None``,
only after every current value, on a real nats-server."""

from __future__ import annotations

import asyncio
import time

from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker


async def _bucket(broker: Broker, n: int):  # type: ignore[no-untyped-def]
    kv = await broker.js.create_key_value(bucket=f"{broker.names.namespace.upper()}_W", history=4)
    for i in range(n):
        await kv.put(f"k{i}", b"v%d" % i)
    await kv.put("k0", b"again")  # a key with history: its last value only
    await kv.delete("k1")  # a delete is an entry too
    return kv


async def _until_marker(w) -> list:  # type: ignore[no-untyped-def]
    got = []
    while True:
        e = await w.updates(timeout=10.0)
        if e is None:
            return got
        got.append(e)


async def test_the_marker_comes_after_every_current_value(
    broker: Broker, early_kv_marker: list[int]
) -> None:
    kv = await _bucket(broker, 20)
    try:
        raw = await kv.watchall()
        assert await raw.updates(timeout=5) is None  # nats-py's marker first: the fault is on
        await raw.stop()

        w = await kvwatch.watch(kv)
        try:
            got = await _until_marker(w)
            assert sorted(e.key for e in got) == sorted(f"k{i}" for i in range(20))
            assert {e.key: e.value for e in got}["k0"] == b"again"
            assert [e.operation for e in got if e.key == "k1"] == ["DEL"]
            assert w.caught_up
            await kv.put("k5", b"new")  # after the marker: entries only, no second marker
            e = await w.updates(timeout=5)
            assert e is not None and (e.key, e.value) == ("k5", b"new")
        finally:
            await w.stop()
        assert early_kv_marker and early_kv_marker[-1] >= 0
    finally:
        await broker.js.delete_key_value(f"{broker.names.namespace.upper()}_W")


async def test_an_empty_watch_is_caught_up_at_once_and_iteration_ends_on_stop(broker: Broker) -> None:
    kv = await broker.js.create_key_value(bucket=f"{broker.names.namespace.upper()}_E")
    try:
        w = await kvwatch.watch(kv)
        assert await w.updates(timeout=1) is None
        await kv.put("a", b"1")

        async def drain() -> list[str]:
            return [e.key async for e in w]

        task = asyncio.ensure_future(drain())
        await asyncio.sleep(0.3)
        await w.stop()
        assert await asyncio.wait_for(task, 5) == ["a"]
    finally:
        await broker.js.delete_key_value(f"{broker.names.namespace.upper()}_E")


async def test_values_that_never_come_end_the_current_values_after_a_quiet_second(
    broker: Broker,
) -> None:
    """A counted value removed before it was delivered (a TTL, a purge) must not hold
    the marker for ever: the server has nothing pending and delivered no more than
    was taken, so the values taken are the current ones."""
    kv = await _bucket(broker, 3)
    try:
        inner = await kv.watchall()
        w = kvwatch.CaughtUpWatcher(inner, initial=3 + 5)  # 5 more than will ever come
        t0 = time.monotonic()
        got = await _until_marker(w)
        assert len(got) == 3 and w.caught_up
        assert kvwatch.RECHECK_S * 0.9 <= time.monotonic() - t0 < 5
        await w.stop()
    finally:
        await broker.js.delete_key_value(f"{broker.names.namespace.upper()}_W")



async def test_keys_and_history_are_whole_when_nats_py_stops_short(
    broker: Broker, early_kv_marker: list[int]
) -> None:
    import pytest
    from nats.js.errors import NoKeysError

    kv = await _bucket(broker, 12)
    try:
        with pytest.raises(NoKeysError):  # nats-py's own: its marker first, so "no keys"
            await kv.keys()
        assert sorted(await kvwatch.keys(kv)) == sorted(f"k{i}" for i in range(12) if i != 1)
        assert [e.value for e in await kvwatch.history(kv, "k0")] == [b"v0", b"again"]
        assert [e.operation for e in await kvwatch.history(kv, "k1")] == [None, "DEL"]
        assert await kvwatch.history(kv, "nobody") == []
    finally:
        await broker.js.delete_key_value(f"{broker.names.namespace.upper()}_W")
    empty = await broker.js.create_key_value(bucket=f"{broker.names.namespace.upper()}_E")
    try:
        assert await kvwatch.keys(empty) == []
    finally:
        await broker.js.delete_key_value(f"{broker.names.namespace.upper()}_E")


async def test_bench_races_counts_each_arm_and_the_guarded_ones_never_strike(nats_server) -> None:  # type: ignore[no-untyped-def]
    """`joynexus bench races` runs both parts on a real server; the figures (how often
    nats-py's arms strike) belong to the benchmark, the guarded arms' zero to the code."""
    from joynexus.ops.bench.races import bench_races

    out = await bench_races(nats_server.url, rounds=30, keys=20)
    kv, join = out["kv_marker"], out["join"]
    assert kv["keys"] == 20 and {k: v["rounds"] for k, v in kv.items() if k != "keys"} == {
        "nats_py_watch": 30, "kvwatch": 30}
    assert kv["kvwatch"]["struck"] == 0 and 0 <= kv["nats_py_watch"]["struck"] <= 30
    assert join["sync_server"] == {"struck": 0, "rounds": 30} and join["one_flush"]["rounds"] == 30
    assert out["load"]["after"]["cpus"] >= 1
