"""A tenant's working slots on a request server (broker/responder.py, ``Budget``):
a request takes its verb's cost in slots, in arrival order; cancelling gives back
what it held or was about to get (issue 24: expensive verbs cost more of a
tenant's share of the control plane)."""

from __future__ import annotations

import asyncio

from joynexus.broker.slots import Budget


async def test_an_expensive_request_waits_for_all_slots_and_is_not_overtaken() -> None:
    b = Budget(2)
    await b.acquire(1)
    await b.acquire(1)
    big = asyncio.create_task(b.acquire(2))
    await asyncio.sleep(0)
    cheap = asyncio.create_task(b.acquire(1))  # arrived after the expensive one
    await asyncio.sleep(0)
    assert not big.done() and not cheap.done()
    b.release(1)
    await asyncio.sleep(0)
    assert not big.done() and not cheap.done(), "one free slot: neither runs yet (FIFO)"
    b.release(1)
    await asyncio.sleep(0)
    assert big.done() and not cheap.done() and b.free == 0
    b.release(2)
    await asyncio.sleep(0)
    assert cheap.done() and b.free == 1


async def test_a_cost_past_the_slots_takes_them_all() -> None:
    b = Budget(2)
    assert b.cost(5) == 2 and b.cost(0) == 1
    await b.acquire(5)
    assert b.free == 0
    b.release(5)
    assert b.free == 2


async def test_cancelled_waiters_leak_nothing() -> None:
    b = Budget(2)
    await b.acquire(2)
    waiting = asyncio.create_task(b.acquire(1))
    behind = asyncio.create_task(b.acquire(2))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    b.release(2)
    await asyncio.sleep(0)
    assert behind.done() and b.free == 0
    # granted just as it was cancelled: its slots come back
    late = asyncio.create_task(b.acquire(1))
    await asyncio.sleep(0)
    b.release(2)  # grants `late`
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)
    assert b.free == 2
