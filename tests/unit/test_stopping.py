"""Stops always return (broker/tasks.py ``cancel_and_wait``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from joynexus.broker.tasks import cancel_and_wait

#: Set at the end of a test: the stubborn tasks take their next cancel (the loop's teardown).
_release = {"now": False}


async def _swallows(n: int, started: asyncio.Event) -> str:
    """Loses ``n`` cancels, as a 3.11 ``wait_for`` can, then ends on the next."""
    started.set()
    lost = 0
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lost += 1
            if lost > n or _release["now"]:
                raise


@pytest.fixture(autouse=True)
def _end_stubborn_tasks() -> Iterator[None]:
    _release["now"] = False
    yield
    _release["now"] = True


async def test_a_task_that_swallows_two_cancels_still_stops() -> None:
    started = asyncio.Event()
    t = asyncio.create_task(_swallows(2, started))
    await started.wait()
    await asyncio.wait_for(cancel_and_wait(t, repeat_s=0.05), 5)
    assert t.cancelled()


async def test_a_task_that_never_stops_is_logged_and_left(caplog: pytest.LogCaptureFixture) -> None:
    started = asyncio.Event()
    t = asyncio.create_task(_swallows(10**9, started), name="stubborn")
    await started.wait()
    with caplog.at_level(logging.ERROR, logger="joynexus.broker.tasks"):
        await asyncio.wait_for(cancel_and_wait(t, bound_s=0.3, repeat_s=0.05), 5)
    assert not t.done()
    _release["now"] = True
    await cancel_and_wait(t)
    assert "stubborn" in caplog.text and "did not stop" in caplog.text


async def test_the_callers_cancel_goes_through_and_errors_are_consumed() -> None:
    started = asyncio.Event()
    slow = asyncio.create_task(_swallows(10**9, started))
    await started.wait()

    async def failing() -> None:
        raise ValueError("loop failed")

    bad = asyncio.create_task(failing())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(slow, bad, None, bound_s=60, repeat_s=0.05))
    await asyncio.sleep(0.2)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert bad.done() and isinstance(bad.exception(), ValueError)
    assert not slow.done()
    _release["now"] = True
    await cancel_and_wait(slow)
    assert slow.cancelled()
