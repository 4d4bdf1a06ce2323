"""Control-plane work bounded by its cost (issue 24 item 2): a slice of a version's
weights does not read the whole object each time. 32 concurrent ``get_policy``
calls of one byte each read the object once (they made the control plane 13-20x
slower for the other tenants); the cache stays within its bytes."""

from __future__ import annotations

import asyncio

import pytest

from joynexus.broker.policy import WeightsCache


async def test_the_cache_reads_once_for_all_who_ask_at_once_and_stays_bounded() -> None:
    cache = WeightsCache(max_bytes=10)
    reads = 0

    async def load(n: int) -> bytes:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.01)
        return b"x" * n

    got = await asyncio.gather(*(cache.get("a", lambda: load(4)) for _ in range(32)))
    assert reads == 1 and all(g == b"xxxx" for g in got)
    await cache.get("b", lambda: load(4))
    await cache.get("a", lambda: load(4))  # hit: a is now the most recent
    await cache.get("c", lambda: load(4))  # 12 > 10 bytes: b (least recent) goes
    assert reads == 3 and cache.bytes == 8
    await cache.get("b", lambda: load(4))
    assert reads == 4
    await cache.get("big", lambda: load(11))  # larger than the cache: served, not kept
    assert cache.bytes <= 10 and "big" not in cache._items

    async def fail() -> bytes:
        raise OSError("object store away")

    with pytest.raises(OSError):
        await cache.get("d", fail)
    assert await cache.get("d", lambda: load(2)) == b"xx"  # a failure is not cached


async def test_slices_of_a_version_read_its_weights_once(broker, tmp_path) -> None:
    from test_positions import control_and_client

    from joynexus.schemas.workloads import PolicyQuery, WorkloadSpec

    async with control_and_client(broker, tmp_path) as (control, acme):
        await acme.create_workload(WorkloadSpec(name="rl", task_type="rl", env="PickCube-v1"))
        replies = await asyncio.gather(*(
            acme._api("get_policy", PolicyQuery(workload="rl", version=1, offset=i, limit=1))
            for i in range(32)
        ))
        whole = await acme._weights(replies[0].policy)
        assert [r.data for r in replies] == [whole[i : i + 1] for i in range(32)]
        assert control._weights.loads == 1
