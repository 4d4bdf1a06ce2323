"""The control plane's door count: each tenant's messages a second, and who is paused.

A tenant that publishes as fast as it can and never reads its replies stalls the
control plane: every message crosses its one connection and is parsed in Python,
and NATS has no per-user publish rate. So the door counts each tenant's messages
in one-second windows (a dict update per message, before any parsing); past the
tenant's ``max_requests_per_s`` the tenant is paused: the control plane drops its
messages unanswered from then on and writes a ``Penalty`` record, which the auth
sync of every server turns into the tenant's user being taken off the server for
the pause (ops/runtime/penaltybox.py). Then the server drops the flood, and the
other tenants' requests stop queueing behind it. A pause that ends with the flood
still going earns the next a doubled length, up to 16x.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_STRIKES", "DoorCount", "FairIngress", "IngressPace"]

log = logging.getLogger(__name__)

#: Pauses in a row double up to 2^(MAX_STRIKES - 1) times ``penalty_s``.
MAX_STRIKES = 5
#: A tenant quiet (no pause) for this many pause lengths starts again at one strike.
FORGIVE_AFTER = 4.0


@dataclass
class _Tenant:
    window: int = -1
    count: int = 0
    paused_until: float = 0.0
    strikes: int = 0
    last_pause_s: float = 0.0


@dataclass
class DoorCount:
    """Pure bookkeeping (no I/O): the clock is passed in."""

    tenants: dict[str, _Tenant] = field(default_factory=dict)

    def paused(self, tenant: str, now: float) -> bool:
        t = self.tenants.get(tenant)
        return t is not None and now < t.paused_until

    def hit(self, tenant: str, now: float, limit: int, penalty_s: float) -> tuple[float, int, int] | None:
        """Count one message of ``tenant`` at ``now``. None, or ``(until, rate, strikes)``
        the first time its count this second passes ``limit`` (0: no limit): it is
        paused until ``until`` from now on."""
        if limit <= 0:
            return None
        t = self.tenants.get(tenant)
        if t is None:
            if len(self.tenants) > 100_000:  # bounded: forget the quiet ones
                self.tenants = {k: v for k, v in self.tenants.items() if v.paused_until > now}
            t = self.tenants[tenant] = _Tenant()
        window = int(now)
        if window != t.window:
            t.window, t.count = window, 0
        t.count += 1
        if t.count <= limit or now < t.paused_until:
            return None
        quiet = now - t.paused_until
        t.strikes = 1 if quiet > FORGIVE_AFTER * max(t.last_pause_s, penalty_s) else min(t.strikes + 1, MAX_STRIKES)
        t.last_pause_s = penalty_s * 2 ** (t.strikes - 1)
        t.paused_until = now + t.last_pause_s
        return t.paused_until, t.count, t.strikes


@dataclass
class IngressPace:
    """Each tenant's Training Queue bytes paced to its ``tq_bytes_per_s``: a token
    bucket holding at most one second's bytes. ``delay`` reserves a put's bytes and
    says how long to wait before storing them (0: at once). A push of a whole quota
    at once (the stream persists every byte) is spread over seconds, so the other
    tenants' calls do not all land in the same moment of storage work; the wait
    holds only the pushing tenant's own working slots."""

    tenants: dict[str, tuple[float, float]] = field(default_factory=dict)

    def delay(self, tenant: str, size: int, now: float, rate: int) -> float:
        if rate <= 0:
            return 0.0
        tokens, last = self.tenants.get(tenant, (float(rate), now))
        tokens = min(float(rate), tokens + (now - last) * rate) - size
        self.tenants[tenant] = (tokens, now)
        return 0.0 if tokens >= 0 else -tokens / rate


class FairIngress:
    """Each tenant's requests in a line of its own, served round robin.

    nats-py runs one subscription's callbacks one at a time, in arrival order: a
    tenant's burst of 2,000 requests put a request of another tenant behind all of
    them, each costing its checks and its refusal (issue 24, ``request_flood``). The
    subscription's callback now only files the request under its tenant
    (:meth:`put`: a deque append), and :meth:`run` serves the lines in turn, one
    request per tenant per round, each tenant's own in FIFO order, letting the event
    loop turn every ``per_turn`` requests so that requests just received are filed
    before the next ones are served. A request of a tenant with an empty line then
    waits for the filing of what came before it and at most one request of each
    other tenant, not for their work. The door counts a tenant's filed requests as in
    flight (:meth:`waiting`), so a line holds at most the tenant's in-flight bound;
    ``max_queued`` is a backstop past which :meth:`put` refuses (the caller drops the
    request, as the door drops a flood's)."""

    def __init__(self, serve: Callable[[Any], None], *, per_turn: int = 8,
                 max_queued: int = 4096) -> None:
        self._serve = serve
        self.per_turn = per_turn
        self.max_queued = max_queued
        self._lines: OrderedDict[str, deque[Any]] = OrderedDict()
        self._wake = asyncio.Event()
        self.dropped = 0

    def put(self, tenant: str, item: Any) -> bool:
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = deque()
        elif len(line) >= self.max_queued:
            self.dropped += 1
            if self.dropped % 1000 == 1:
                log.warning("%d requests dropped unanswered: tenant %r has %d filed (the "
                            "backstop, max_queued)", self.dropped, tenant[:64], len(line))
            return False
        line.append(item)
        self._wake.set()
        return True

    def waiting(self, tenant: str) -> int:
        """``tenant``'s requests filed and not yet served."""
        line = self._lines.get(tenant)
        return 0 if line is None else len(line)

    async def run(self) -> None:
        while True:
            if not self._lines:
                self._wake.clear()
                await self._wake.wait()
            served = 0
            while self._lines and served < self.per_turn:
                tenant, line = next(iter(self._lines.items()))
                item = line.popleft()
                if line:
                    self._lines.move_to_end(tenant)  # its next request after the others'
                else:
                    del self._lines[tenant]
                served += 1
                try:
                    self._serve(item)
                except Exception:  # a bug: this request's, never the other tenants'
                    log.exception("serving a request of tenant %r failed", tenant[:64])
            await asyncio.sleep(0)  # let the requests received meanwhile be filed
