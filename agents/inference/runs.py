"""Where an engine's batch runs and what it reports after: :class:`BatchRuns`.

The batch's shared forward runs on the event loop when forwards of its size are
measured short and nothing waits behind it (:data:`INLINE_FORWARD_MS`), else on
the engine's forward thread; a failed shared forward falls back to one forward per
request. Each batch's busy interval (the utilization and usage metering read it)
is published :data:`BUSY_DELAY_S` after its replies. :mod:`.engine` runs the loop
around it. See docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from typing import Any

from opentelemetry import trace

from joynexus.agents.inference.batcher import Pending
from joynexus.agents.inference.compute import (
    ForwardThread,
    ForwardTimes,
    Outcome,
    forward_each,
    forward_grouped,
)
from joynexus.agents.inference.intake import EngineStats
from joynexus.agents.models.backbone import Backbone
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.responder import Server

log = logging.getLogger(__name__)

#: A batch's busy metric is published this long after its replies, off their path. Sent
#: at once (in the same turn of the event loop) its encoding and nats-py's flusher write
#: ran before the loop read a reply for a client in this process, and the server took
#: it in (a JetStream subject) while it should have been forwarding the reply: issue 15
#: measured 0.24-0.41 ms of the in-process round trip. The events of batches that end
#: within the delay go out together, in order.
BUSY_DELAY_S = 0.002

#: A batch whose forward is expected (the median of the last ones of its backbone key
#: and power of two of rows) to take at most this long runs on the event loop instead
#: of the forward thread. The hop to the thread and back cost 0.4-1.3 ms per batch on
#: the 2-core machine (issue 15; more when it is loaded), 3-9% of a 15 ms forward. While
#: the loop is held no request is taken in, but none could join the running batch
#: anyway: what a request arriving meanwhile loses is its intake (decode, checks,
#: ~0.1-0.3 ms) overlapping the forward, so the loop wins while fewer than a few
#: requests arrive per forward - the light load where a round trip is all latency. A
#: tiny-backbone forward of 1-4 rows takes 3-7 ms here, the bench backbone's 15-25 ms;
#: batches of many rows stay on the thread. A size not measured yet runs on the thread.
INLINE_FORWARD_MS = 15.0


class BatchRuns:
    """One engine's forward thread, its measured forward times and its busy metric."""

    def __init__(self, broker: Broker, rpc: Server, backbone: Backbone, stats: EngineStats, *,
                 instance: str, inline_forward_ms: float = INLINE_FORWARD_MS) -> None:
        self.b, self.rpc, self.backbone, self.stats = broker, rpc, backbone, stats
        self.instance = instance
        self.inline_forward_ms = inline_forward_ms
        self.times = ForwardTimes()
        self.thread = ForwardThread(instance)
        # Busy intervals not published yet (metrics.busy's arguments) and the timer that will.
        self._busy: deque[tuple[float, float, dict[str, Any]]] = deque()
        self._busy_timer: asyncio.TimerHandle | None = None

    def runs_inline(self, key: tuple[str, int], *, queued: bool) -> bool:
        """Short and nothing waiting: a request queued behind this batch would have its
        intake (decode, checks) overlap the forward on the thread, which the loop cannot."""
        if queued:
            return False
        est = self.times.estimate_ms(key)
        return est is not None and est <= self.inline_forward_ms

    async def forward(
        self, items: list[Pending], rows: int, batch_id: str, *, queued: bool
    ) -> tuple[list[Outcome], float, bool, bool]:
        """The batch's shared forward (inline when its size is known short), or one
        forward per request if that fails: (outcomes, forward ms, inline, fallback)."""
        fkey = ForwardTimes.key(items, rows)
        inline = self.runs_inline(fkey, queued=queued)
        # Only recorded (sampled) spans are linked: a link to a no-op span exports nothing.
        links = [trace.Link(p.span.get_span_context()) for p in items if p.span.is_recording()]
        with tracing.tracer.start_as_current_span(
            "inference.batch",
            links=links,
            attributes={"joynexus.batch_id": batch_id, "joynexus.batch_size": len(items),
                        "joynexus.inline": inline},
        ):
            try:
                (outcomes, forward_ms), took_ms = await self.thread.call(
                    functools.partial(forward_grouped, self.backbone), items, inline
                )
                self.times.note(fkey, took_ms)
                return outcomes, forward_ms, inline, False
            except Exception as e:
                log.warning(
                    "engine %s: shared forward of %s failed (%s); serving each request alone",
                    self.instance,
                    batch_id,
                    e,
                )
                self.stats.fallbacks += 1
                (outcomes, forward_ms), _ = await self.thread.call(
                    functools.partial(forward_each, self.backbone), items, False
                )
                return outcomes, forward_ms, inline, True

    def note_busy(self, start: float, end: float, **fields: Any) -> None:
        self._busy.append((start, end, fields))
        if self._busy_timer is None:
            self._busy_timer = asyncio.get_running_loop().call_later(BUSY_DELAY_S, self._busy_due)

    def _busy_due(self) -> None:
        self._busy_timer = None
        self.rpc.spawn(self.publish_busy())

    async def publish_busy(self) -> None:
        """Publish the busy intervals noted so far, oldest first (metrics.busy never raises)."""
        while self._busy:
            start, end, fields = self._busy.popleft()
            await metrics.busy(self.b, "infer", start, end, **fields)

    async def close(self) -> None:
        """Stop the thread; publish what the timer had not sent yet."""
        self.thread.shutdown()
        if self._busy_timer is not None:
            self._busy_timer.cancel()
            self._busy_timer = None
        await self.publish_busy()


__all__ = ["BUSY_DELAY_S", "INLINE_FORWARD_MS", "BatchRuns"]
