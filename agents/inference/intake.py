"""The engine's door: a request decoded, checked (:mod:`.admission`) and queued
as a :class:`.batcher.Pending`, or answered with its error; the replies and the
count of requests taken but not yet answered (what a drain waits for).

The endpoint handler never waits (nats-py runs one callback at a time per
subscription): a tenant version not resident yet is loaded in a task of its
own. The loop of :mod:`.engine` takes from ``queue``. See docs/ARCHITECTURE.md
("The Inference Queue").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from nats.micro.request import Request
from opentelemetry import trace

from joynexus.agents.inference import admission
from joynexus.agents.inference.batcher import Pending, split
from joynexus.agents.inference.policies import LoadedPolicy, PolicyCache
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.quotas import QuotaBook
from joynexus.broker.responder import Server, error_headers
from joynexus.schemas.errors import PermissionDenied, Unavailable
from joynexus.schemas.inference import (
    InferError,
    InferRequest,
    InferResult,
    decode_msgpack,
    encode_msgpack,
)

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    requests: int = 0
    errors: int = 0
    batches: int = 0
    rows: int = 0
    fallbacks: int = 0
    rejected: int = 0
    #: batches whose forward ran on the event loop (short ones; the rest on the forward thread)
    inline_batches: int = 0
    #: sizes of the most recent batches (bounded)
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=4096))


class Intake:
    """Requests in, errors and results out, for one engine."""

    def __init__(
        self,
        broker: Broker,
        rpc: Server,
        cache: PolicyCache,
        quotas: QuotaBook,
        stats: EngineStats,
        *,
        instance: str,
        max_queue: int,
        part_rows: int | None = None,
    ) -> None:
        self.b = broker
        self.rpc = rpc
        self.cache = cache
        self.quotas = quotas
        self.stats = stats
        self.instance = instance
        self.max_queue = max_queue
        #: a request with more rows is queued as parts of at most this many (None: whole)
        self.part_rows = part_rows
        self.queue: deque[Pending] = deque()
        #: tenant -> when its latest request was queued (perf_counter): who shares the engine
        self.last_seen: dict[str, float] = {}
        self.wake = asyncio.Event()
        #: a batch is in its forward (a request queued meanwhile is marked busy)
        self.running = False
        #: requests taken and not yet answered (a drain waits for none)
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        # Request (by id) -> the tenant it was counted against; released when answered.
        self._admitted: dict[int, str] = {}

    def _begin(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def end(self) -> None:
        """One request answered."""
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    async def on_request(self, request: Request) -> None:
        """The endpoint handler: decode and enqueue, never wait."""
        received = time.perf_counter()
        tenant = admission.subject_tenant(request.subject)
        if not self.rpc.allowed(request, tenant, service=admission.service_subject(request.subject)):
            self.stats.rejected += 1
            return  # dropped, unanswered: the reply subject is not the requester's
        self._begin()
        self.stats.requests += 1
        span = tracing.tracer.start_span(
            "inference.act",
            context=tracing.extract(request.headers),
            attributes={"joynexus.instance": self.instance},
        )
        try:
            if len(self.queue) >= self.max_queue:
                self.stats.rejected += 1
                raise Unavailable(
                    f"inference engine {self.instance} has {len(self.queue)} requests queued; "
                    "retry later or scale up (EnginePool.scale_up / another `joynexus agent inference`)"
                )
            if tenant is not None:
                self.rpc.admit(tenant)
                self._admitted[id(request)] = tenant
            req: InferRequest = decode_msgpack(request.data, InferRequest, what="inference request")
            self._check_tenant(request.subject, req)
            admission.check_quota(req, self.quotas.get(req.tenant_id))
            span.set_attribute("joynexus.tenant", req.tenant_id)
            lp = self.cache.lookup(req.tenant_id, req.workload, req.policy_version)
            if lp is None:
                self.rpc.spawn(self._admit_later(request, req, span, received))
                return
            self._admit(request, req, lp, span, received)
        except Exception as e:
            self.rpc.spawn(self.reply_error(request, e, span))

    def _check_tenant(self, subject: str, req: InferRequest) -> None:
        """The tenant is the subject's last token (the broker fences who may publish
        there); a payload that claims another tenant is refused, to its requester
        alone, and reported as a security event (never awaited here)."""
        claim = admission.tenant_claim(subject, req)
        if claim is None:
            return
        tenant, reason = claim
        self.rpc.spawn(
            metrics.security(
                self.b,
                tenant,
                action="claim_tenant",
                subject=subject,
                reason=reason,
                source="inference",
            )
        )
        raise PermissionDenied(reason)

    async def _admit_later(
        self, request: Request, req: InferRequest, span: Any, received: float
    ) -> None:
        try:
            lp = await self.cache.resolve(req.tenant_id, req.workload, req.policy_version)
            self._admit(request, req, lp, span, received)
        except Exception as e:
            await self.reply_error(request, e, span)

    def _admit(
        self, request: Request, req: InferRequest, lp: LoadedPolicy, span: Any, received: float
    ) -> None:
        """Validate one request against its tenant's policy; enqueue it (raises on bad input)."""
        batch, noise = admission.validate(req, lp)
        p = Pending(request, req, lp, batch, noise, lp.schema.backbone_key(), span, received)
        p.enqueued = time.perf_counter()
        p.busy = self.running
        self.last_seen[p.tenant] = p.enqueued
        self.queue.extend(split(p, self.part_rows) if self.part_rows else [p])
        self.wake.set()

    async def reply_error(self, request: Request, e: BaseException, span: Any) -> None:
        """Answer with the error (a bug is logged by the rpc layer, with a reference)."""
        code, message = self.rpc.error_of(e)
        self.stats.errors += 1
        span.set_attribute("joynexus.error", code)
        try:
            await self.respond(request, InferError(code=code, message=message), span)
        finally:
            span.end()
            self.end()

    async def respond(self, request: Request, reply: InferResult | InferError, span: Any) -> None:
        headers: dict[str, str] = {}
        if span.get_span_context().is_valid:  # tracing off and no caller's trace: nothing to carry
            with trace.use_span(span, end_on_exit=False):
                tracing.inject(headers)
        if isinstance(reply, InferError):
            error_headers(reply.code, reply.message, headers)
        try:
            await self.rpc.respond_to(request, encode_msgpack(reply), headers)
        except Exception as e:  # the caller is gone or the connection dropped
            log.warning("engine %s: reply not sent: %s", self.instance, e)
        finally:
            tenant = self._admitted.pop(id(request), None)
            if tenant is not None:
                self.rpc.release(tenant)


async def drain_service(service: Any) -> None:
    """Leave the queue group but answer what was already delivered.

    nats-py's ``Service.stop()`` unsubscribes endpoints, which discards
    messages already delivered to this client; draining the subscription
    instead tells the server to stop routing here, then runs the handler for
    every pending message. The control subjects ($SRV.*) are stopped after.
    """
    endpoints = list(getattr(service, "_endpoints", []))
    for ep in endpoints:
        sub = getattr(ep, "_subscription", None)
        if sub is not None:
            with contextlib.suppress(Exception):  # connection closed: nothing to drain
                await sub.drain()
            ep._subscription = None
    service._endpoints = []
    with contextlib.suppress(Exception):
        await service.stop()
