"""Stopping asyncio tasks so that a stop always returns.

On Python 3.11 ``asyncio.wait_for`` can lose a cancel that lands just as its
inner awaitable finishes (bpo-42130, fixed in 3.12): the task goes on as if never
cancelled. A stop written as ``task.cancel(); await task`` then waits forever, and
one wrapped in ``suppress(BaseException)`` also swallows the caller's own cancel.
A CI teardown once hung 300 s that way. :func:`cancel_and_wait` cancels again
every ``repeat_s`` until the tasks end, gives up after ``bound_s`` (logging each
task still running, with its stack), and never swallows a cancel aimed at the
caller.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]

log = logging.getLogger(__name__)


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None, bound_s: float = 10.0,
                          repeat_s: float = 1.0) -> None:
    """Cancel ``tasks`` (``None`` entries are skipped) and wait until they end, at most
    ``bound_s``. Their results and errors are consumed (a stop does not re-raise a
    loop's failure). A cancel of the caller propagates: the tasks stay cancelled."""
    await _wait(tasks, bound_s, repeat_s)


async def _wait(tasks: Iterable[asyncio.Future[Any] | None], bound_s: float, repeat_s: float) -> None:
    all_ = [t for t in tasks if t is not None]
    pending = {t for t in all_ if not t.done()}
    for t in pending:
        t.cancel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while pending:
        left = deadline - loop.time()
        if left <= 0:
            for t in pending:
                log.error("a task did not stop within %.0f s of its cancel; left running: %s", bound_s, _stack(t))
            break
        _, pending = await asyncio.wait(pending, timeout=min(repeat_s, left))
        for t in pending:
            t.cancel()  # a cancel lost by wait_for on 3.11: send it again
    for t in all_:
        if t.done() and not t.cancelled():
            t.exception()  # consumed: no "exception was never retrieved"


def _stack(t: asyncio.Future[Any]) -> str:
    if not isinstance(t, asyncio.Task):
        return repr(t)
    buf = io.StringIO()
    t.print_stack(file=buf)
    return f"{t.get_name()}\n{buf.getvalue()}"
