"""A tenant's working slots on a request server: how many of its requests work at once.

:class:`Budget` holds a tenant's slots (its quota's ``max_requests_working`` on the
control plane); a request takes its verb's cost in slots (``VERB_COST``: reading
weights or videos, writing rows, creating a workload take all of the default two),
granted in arrival order. :class:`Held` (in :data:`HELD`, per request task) says
which slots a request holds, so that :func:`waiting` gives them back while a
long poll waits. :class:`joynexus.broker.responder.Server` uses them. See
docs/ARCHITECTURE.md ("Request/reply: one layer").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections import deque
from collections.abc import AsyncIterator


class Budget:
    """A tenant's working slots: a request takes ``n`` of them at once (its verb's cost,
    at most all of them), granted in arrival order (a costly request is not passed
    over forever by cheap ones behind it)."""

    def __init__(self, units: int) -> None:
        self.units = max(1, units)
        self.free = self.units
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def cost(self, n: int) -> int:
        return max(1, min(n, self.units))

    async def acquire(self, n: int) -> None:
        n = self.cost(n)
        if not self._waiters and self.free >= n:
            self.free -= n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled
                self.release(n)
            else:
                fut.cancel()
                self._grant()
            raise

    def release(self, n: int) -> None:
        self.free = min(self.units, self.free + self.cost(n))
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if self.free < n:
                return
            self.free -= n
            self._waiters.popleft()
            fut.set_result(None)


class Held:
    """The slots a request works in (``n`` of its tenant's budget), and whether it
    holds them now."""

    def __init__(self, slot: Budget, n: int) -> None:
        self.slot = slot
        self.n = n
        self.held = False


HELD: contextvars.ContextVar[Held | None] = contextvars.ContextVar("rpc_slot", default=None)


@contextlib.asynccontextmanager
async def waiting() -> AsyncIterator[None]:
    """Inside a handler: give the tenant's working slot back while waiting (a long
    poll waits for events, it does no work), take it again, in turn, after."""
    h = HELD.get()
    if h is None or not h.held:
        yield
        return
    h.slot.release(h.n)
    h.held = False
    try:
        yield
    finally:
        await h.slot.acquire(h.n)
        h.held = True


__all__ = ["HELD", "Budget", "Held", "waiting"]
