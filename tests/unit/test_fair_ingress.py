"""The control plane's fair ingress (agents/control/door.py, ``FairIngress``): each
tenant's requests in a line of their own, served round robin, each line FIFO. No
server: the items are labels and ``serve`` records the order it is called in."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from joynexus.agents.control.door import FairIngress
from joynexus.broker.tasks import cancel_and_wait


async def _served_after(ingress: FairIngress, order: list[str], n: int) -> None:
    await _until(lambda: len(order) >= n, f"served {len(order)} of {n}")


async def _run_until_served(ingress: FairIngress, order: list[str], n: int) -> None:
    """Run the ingress until ``n`` requests were served, then stop it."""
    task = asyncio.ensure_future(ingress.run())
    try:
        await _served_after(ingress, order, n)
    finally:
        await cancel_and_wait(task)


async def _until(done: Callable[[], bool], what: str, turns: int = 5000) -> None:
    for _ in range(turns):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError(what)


async def test_a_request_filed_behind_a_burst_is_served_in_the_next_round() -> None:
    order: list[str] = []
    ingress = FairIngress(order.append, per_turn=8)
    for i in range(2000):
        ingress.put("mallory", f"m{i}")
    ingress.put("vera", "v0")
    await _run_until_served(ingress, order, 2001)
    # Round robin: vera's one request after mallory's first, not after its 2,000.
    assert order.index("v0") == 1
    assert [x for x in order if x != "v0"] == [f"m{i}" for i in range(2000)]  # FIFO


async def test_requests_filed_while_a_burst_is_served_wait_at_most_one_turn() -> None:
    """A burst is being served when vera's requests arrive one by one: each is served
    within ``per_turn`` + the other lines' one request each of being filed (the loop
    turns every ``per_turn`` requests)."""
    order: list[str] = []
    ingress = FairIngress(order.append, per_turn=8)
    for i in range(3000):
        ingress.put("mallory", f"m{i}")
    task = asyncio.ensure_future(ingress.run())
    waits = []
    try:
        for k in range(20):
            for _ in range(3):
                await asyncio.sleep(0)
            before = len(order)
            ingress.put("vera", f"v{k}")
            await _served_after(ingress, order, before + 1)
            await _until(lambda k=k: f"v{k}" in order, f"v{k} not served")
            waits.append(order.index(f"v{k}") - before)
    finally:
        await cancel_and_wait(task)
    assert max(waits) <= 8 + 2, waits
    assert len(order) < 3000  # vera was served while the burst was still going


async def test_a_full_line_refuses_and_other_lines_still_take_requests() -> None:
    order: list[str] = []
    ingress = FairIngress(order.append, max_queued=3)
    assert all(ingress.put("mallory", i) for i in range(3))
    assert not ingress.put("mallory", 3) and ingress.dropped == 1
    assert ingress.put("vera", "v")
    assert (ingress.waiting("mallory"), ingress.waiting("vera")) == (3, 1)


async def test_a_request_whose_serving_raises_fails_alone() -> None:
    order: list[str] = []

    def serve(item: str) -> None:
        if item == "bad":
            raise RuntimeError("a bug")
        order.append(item)

    ingress = FairIngress(serve)
    for item in ("a1", "bad", "a2"):
        ingress.put("mallory", item)
    ingress.put("vera", "v")
    await _run_until_served(ingress, order, 3)
    assert order == ["a1", "v", "a2"]
