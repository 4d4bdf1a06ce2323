"""The engine: the loop around the batcher's choice, one forward per batch, the replies.

An :class:`InferenceEngine` holds the shared frozen backbone and the heads of the
tenants it serves; it is one endpoint of the NATS micro service ``<ns>-infer``
(``Names.infer(base_model)``, in a queue group, so engines share the load). The
handler decodes, checks (:mod:`.admission`) and enqueues, never waits; the batch
loop runs what :func:`.batcher.choose` says, ONE backbone forward over the
batch's rows (on the event loop when forwards of its size are measured short,
else on the engine's forward thread), each tenant's head, the replies, then the
batch's busy metric. A batch whose shared forward fails falls back to one forward
per request. See docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from nats.micro import add_service
from nats.micro.request import Request
from opentelemetry import trace

from joynexus.agents.inference import admission, batcher
from joynexus.agents.inference.batcher import Pending
from joynexus.agents.inference.policies import LoadedPolicy, PolicyCache
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.features import TokenFeatures, concat_batches
from joynexus.agents.models.grouped import ActRequest, features_for, needs_tokens, serial_forward
from joynexus.agents.models.policyio import PolicyStore
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.fastpath import FastResponder, enabled_by_env
from joynexus.broker.quotas import QuotaBook
from joynexus.broker.rpc import Server, error_headers
from joynexus.broker.subjects import model_token
from joynexus.schemas.errors import (
    InvalidSpec,
    PermissionDenied,
    Unavailable,
)
from joynexus.schemas.inference import (
    BatchInfo,
    InferError,
    InferRequest,
    InferResult,
    InferTimings,
    TensorBytes,
    decode_msgpack,
    encode_msgpack,
)

log = logging.getLogger(__name__)


@dataclass
class _Outcome:
    actions: torch.Tensor | None = None
    error: Exception | None = None
    decode_ms: float = 0.0


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


class InferenceEngine:
    """One batching engine for one base model. ``start()`` = ``prepare()`` + ``join()``."""

    def __init__(
        self,
        broker: Broker,
        backbone: Backbone,
        *,
        base_model: str | None = None,
        max_batch: int = 16,
        max_wait_ms: float = 5.0,
        instance: str = "infer-0",
        retain_versions: int = 4,
        policies: PolicyStore | None = None,
        load_timeout_s: float = 60.0,
        max_queue: int = 4096,
        quotas: QuotaBook | None = None,
        inline_forward_ms: float = INLINE_FORWARD_MS,
    ) -> None:
        if max_batch < 1:
            raise InvalidSpec(f"max_batch={max_batch}: must be >= 1")
        if not max_wait_ms >= 0:
            raise InvalidSpec(f"max_wait_ms={max_wait_ms}: must be >= 0")
        if retain_versions < 1:
            raise InvalidSpec(f"retain_versions={retain_versions}: must be >= 1")
        if not inline_forward_ms >= 0:
            raise InvalidSpec(f"inline_forward_ms={inline_forward_ms}: must be >= 0")
        self.b = broker
        self.backbone = backbone
        self.base_model = base_model or backbone.config.base_model
        model_token(self.base_model)  # fails early on a name that cannot be a subject token
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1e3
        self.instance = instance
        self.retain_versions = retain_versions
        self.policies = policies or PolicyStore(broker)
        self.load_timeout_s = load_timeout_s
        self.max_queue = max_queue
        #: a batch whose forward is expected to take at most this long runs on the event
        #: loop; longer ones (and any of a size not measured yet) on the forward thread
        self.inline_forward_ms = inline_forward_ms
        self.stats = EngineStats()
        self.state = "new"  # new -> prepared -> serving -> draining -> stopped

        self.cache = PolicyCache(
            self.policies,
            backbone,
            base_model=self.base_model,
            retain_versions=retain_versions,
            instance=instance,
        )
        self._queue: deque[Pending] = deque()
        self._wake = asyncio.Event()
        self._inflight = 0
        self._running = False  # a batch is in its forward
        self._freed_at = 0.0  # when the last batch ended (perf_counter)
        self._idle = asyncio.Event()
        self._idle.set()
        # The last forward times measured (ms) by (backbone key, rows' power of two).
        self._forward_ms: dict[tuple[str, int], deque[float]] = {}
        # One thread for this engine's long forwards (always the same OS thread, so
        # torch's intra-op pool is made once; a batch at a time, as the batcher runs them).
        self._executor: ThreadPoolExecutor | None = None
        self._batch_ids = itertools.count(1)
        self._batch_ids_served = itertools.count(1)
        self._watcher: asyncio.Task[None] | None = None
        self._batcher: asyncio.Task[None] | None = None
        self._service: Any = None
        self._own_quotas = quotas is None
        self.quotas = quotas or QuotaBook(broker)
        # Replies are msgpack; an error is an InferError (its message clipped).
        self.rpc = Server(
            broker,
            "inference",
            error_reply=lambda code, message: InferError(code=code, message=message),
            encode=encode_msgpack,
            internal="internal error (reference {ref} in the inference engine's log)",
            limit=lambda t: self.quotas.get(t).max_requests_in_flight,
            respond=FastResponder() if enabled_by_env() else None,
        )
        # Request (by id) -> the tenant it was counted against; released when answered.
        self._admitted: dict[int, str] = {}
        # Batch number in which each tenant was last served (turn-taking).
        self._last_served: dict[str, int] = {}

    # ------------------------------------------------------------ lifecycle
    async def prepare(self) -> None:
        """Load every tenant's current weights (for this base model) and start the
        batcher; the engine does not take requests yet. Raises if a load fails."""
        if self.state != "new":
            raise InvalidSpec(f"engine {self.instance} is {self.state}; prepare() runs once")
        if self._own_quotas:
            await self.quotas.start()
        ready = asyncio.Event()
        self._watcher = asyncio.create_task(self.cache.watch(ready), name=f"{self.instance}-watch")
        self._watcher.add_done_callback(self._watch_ended)
        waiter = asyncio.create_task(ready.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, self._watcher},
                timeout=self.load_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self._watcher in done:
                self._watcher.result()  # raises the load error
                raise Unavailable(f"engine {self.instance}: the policy watch ended before loading")
            if not done:
                raise Unavailable(
                    f"engine {self.instance}: policies not loaded within {self.load_timeout_s:.0f}s"
                )
        except BaseException:
            waiter.cancel()
            await self.close()
            raise
        self._batcher = asyncio.create_task(self._batch_loop(), name=f"{self.instance}-batch")
        self.state = "prepared"

    async def join(self) -> None:
        """Join the queue group: from here on requests arrive."""
        if self.state != "prepared":
            raise InvalidSpec(f"engine {self.instance} is {self.state}; call prepare() first")
        n = self.b.names
        nc = await self.rpc.connection()
        self._service = await add_service(
            nc,
            name=n.inference_service,
            version="0.1.0",
            description="JoyNexus Inference Queue: batched multi-tenant action decoding",
            metadata={
                "instance": self.instance,
                "base_model": self.base_model,
                "max_batch": str(self.max_batch),
                "max_wait_ms": f"{self.max_wait_s * 1e3:g}",
            },
            queue_group=n.inference_service,
        )
        await self._service.add_endpoint(
            name=model_token(self.base_model),
            subject=n.infer(self.base_model),
            handler=self._on_request,
            metadata={"base_model": self.base_model},
        )
        await nc.flush()
        self.state = "serving"

    async def start(self) -> None:
        await self.prepare()
        await self.join()

    async def stop(self) -> None:
        """Drain: stop taking requests, answer every request already taken, then stop."""
        if self.state in ("stopped", "draining"):
            return
        self.state = "draining"
        if self._service is not None:
            await _drain_service(self._service)
            self._service = None
        await self._idle.wait()
        await self.close()

    async def close(self) -> None:
        """Stop at once (rollback of a failed prepare; after ``stop()``'s drain)."""
        tasks = [t for t in (self._watcher, self._batcher) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
            self._service = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        await self.rpc.stop()
        if self._own_quotas:
            await self.quotas.stop()
        self.state = "stopped"

    # ------------------------------------------------------------ policies
    def loaded_versions(self, tenant_id: str, policy_key: str = "default") -> list[int]:
        return self.cache.loaded_versions(tenant_id, policy_key)

    def latest_version(self, tenant_id: str, policy_key: str = "default") -> int | None:
        return self.cache.latest_version(tenant_id, policy_key)

    def _watch_ended(self, task: asyncio.Task[None]) -> None:
        if self.state in ("prepared", "serving") and not task.cancelled() and task.exception():
            log.error(
                "engine %s: policy watch failed, new versions load on demand only: %r",
                self.instance,
                task.exception(),
            )

    # ------------------------------------------------------------ requests
    def _begin(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _end(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def _on_request(self, request: Request) -> None:
        """The endpoint handler: decode and enqueue, never wait (nats-py runs one
        callback at a time per subscription). A tenant version that is not
        resident yet is loaded in a task of its own."""
        received = time.perf_counter()
        tenant = admission.subject_tenant(request.subject)
        if not self.rpc.allowed(request, tenant):
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
            if len(self._queue) >= self.max_queue:
                self.stats.rejected += 1
                raise Unavailable(
                    f"inference engine {self.instance} has {len(self._queue)} requests queued; "
                    "retry later or scale up (EnginePool.scale_up / another `joynexus agent inference`)"
                )
            if tenant is not None:
                self.rpc.admit(tenant)
                self._admitted[id(request)] = tenant
            req: InferRequest = decode_msgpack(request.data, InferRequest, what="inference request")
            self._check_tenant(request.subject, req)
            admission.check_quota(req, self.quotas.get(req.tenant_id))
            span.set_attribute("joynexus.tenant", req.tenant_id)
            lp = self.cache.lookup(req.tenant_id, req.policy_key, req.policy_version)
            if lp is None:
                self.rpc.spawn(self._admit_later(request, req, span, received))
                return
            self._admit(request, req, lp, span, received)
        except Exception as e:
            self.rpc.spawn(self._reply_error(request, e, span))

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
            lp = await self.cache.resolve(req.tenant_id, req.policy_key, req.policy_version)
            self._admit(request, req, lp, span, received)
        except Exception as e:
            await self._reply_error(request, e, span)

    def _admit(
        self, request: Request, req: InferRequest, lp: LoadedPolicy, span: Any, received: float
    ) -> None:
        """Validate one request against its tenant's policy; enqueue it (raises on bad input)."""
        batch, noise = admission.validate(req, lp)
        p = Pending(request, req, lp, batch, noise, lp.schema.backbone_key(), span, received)
        p.enqueued = time.perf_counter()
        p.busy = self._running
        self._queue.append(p)
        self._wake.set()

    async def _reply_error(self, request: Request, e: BaseException, span: Any) -> None:
        code, message = self.rpc.error_of(e)  # a bug is logged there, with a reference
        self.stats.errors += 1
        span.set_attribute("joynexus.error", code)
        try:
            await self._respond(request, InferError(code=code, message=message), span)
        finally:
            span.end()
            self._end()

    async def _respond(self, request: Request, reply: InferResult | InferError, span: Any) -> None:
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

    # ------------------------------------------------------------ the batcher
    async def _batch_loop(self) -> None:
        """Adaptive batching: an idle engine runs what it has at once; while a batch runs,
        requests accumulate and form the next one (up to ``max_batch``, tenants taking
        turns). Only a request that arrived while a batch ran may wait for company, and
        at most ``max_wait_ms`` after the engine could first have run it."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            # One turn of the event loop: requests already delivered to this connection
            # join (nats-py hands them to the handler one after another, without waiting).
            await asyncio.sleep(0)
            while True:
                now = time.perf_counter()
                queue = list(self._queue)
                choice = batcher.choose(
                    queue,
                    self._last_served,
                    now=now,
                    freed_at=self._freed_at,
                    max_batch=self.max_batch,
                    max_wait_s=self.max_wait_s,
                )
                if choice.until is None:
                    break
                self._wake.clear()
                waiter = loop.create_task(self._wake.wait())
                try:
                    await asyncio.wait({waiter}, timeout=choice.until - now)
                finally:
                    waiter.cancel()
            chosen = set(choice.take)
            items = [queue[i] for i in choice.take]
            self._queue = deque(p for i, p in enumerate(queue) if i not in chosen)
            turn = next(self._batch_ids_served)
            self._last_served = batcher.served(
                self._last_served, [p.tenant for p in items], turn, 4 * self.max_queue
            )
            self._running = True
            try:
                await self._run_batch(items)
            except Exception as e:  # a bug: answer the batch with it, keep batching
                log.exception("engine %s: batch failed", self.instance)
                for p in items:
                    if not p.answered:
                        p.answered = True
                        await self._reply_error(p.request, e, p.span)
            finally:
                self._running = False
                self._freed_at = time.perf_counter()

    def _forward_key(self, items: Sequence[Pending], rows: int) -> tuple[str, int]:
        return (items[0].key, rows.bit_length())

    def forward_estimate_ms(self, key: tuple[str, int]) -> float | None:
        """The median of the last forwards of this size measured (None: not measured yet):
        one stall from elsewhere on the machine does not move it."""
        seen = self._forward_ms.get(key)
        return statistics.median(seen) if seen else None

    def _runs_inline(self, key: tuple[str, int]) -> bool:
        est = self.forward_estimate_ms(key)
        return est is not None and est <= self.inline_forward_ms

    def _note_forward(self, key: tuple[str, int], ms: float) -> None:
        seen = self._forward_ms.get(key)
        if seen is None:
            if len(self._forward_ms) >= 1024:  # bounded: many schemas seen
                self._forward_ms.clear()
            seen = self._forward_ms[key] = deque(maxlen=9)
        seen.append(ms)

    async def _call(
        self, fn: Callable[[Sequence[Pending]], tuple[list[_Outcome], float]],
        items: Sequence[Pending], inline: bool,
    ) -> tuple[tuple[list[_Outcome], float], float]:
        """``fn(items)`` on the event loop or on the forward thread, and its wall time (ms)
        where it ran (the hop to the thread and back not counted)."""

        def timed() -> tuple[tuple[list[_Outcome], float], float]:
            t0 = time.perf_counter()
            out = fn(items)
            return out, (time.perf_counter() - t0) * 1e3

        if inline:
            return timed()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.instance}-forward")
        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    async def _run_batch(self, items: list[Pending]) -> None:
        batch_id = f"{self.instance}-{next(self._batch_ids)}"
        rows = sum(p.batch.batch_size for p in items)
        started = time.perf_counter()
        wall_start = time.time()
        cpu_start = time.process_time()  # CPU seconds of this process: compute, not waiting
        # Only recorded (sampled) spans are linked: a link to a no-op span exports nothing.
        links = [trace.Link(p.span.get_span_context()) for p in items if p.span.is_recording()]
        fkey = self._forward_key(items, rows)
        inline = self._runs_inline(fkey)
        with tracing.tracer.start_as_current_span(
            "inference.batch",
            links=links,
            attributes={"joynexus.batch_id": batch_id, "joynexus.batch_size": len(items),
                        "joynexus.inline": inline},
        ):
            fallback = False
            try:
                (outcomes, forward_ms), took_ms = await self._call(
                    self._forward_grouped, items, inline
                )
                self._note_forward(fkey, took_ms)
            except Exception as e:
                log.warning(
                    "engine %s: shared forward of %s failed (%s); serving each request alone",
                    self.instance,
                    batch_id,
                    e,
                )
                fallback = True
                self.stats.fallbacks += 1
                (outcomes, forward_ms), _ = await self._call(self._forward_each, items, False)
        wall_end, cpu_s = time.time(), time.process_time() - cpu_start
        self.stats.batches += 1
        self.stats.rows += rows
        self.stats.batch_sizes.append(len(items))
        if inline:
            self.stats.inline_batches += 1
        info = BatchInfo(
            batch_id=batch_id, size=len(items), rows=rows, instance=self.instance, fallback=fallback
        )
        tenant_rows: dict[str, int] = {}
        tenant_requests: dict[str, int] = {}
        for p in items:
            t = p.req.tenant_id
            tenant_rows[t] = tenant_rows.get(t, 0) + p.batch.batch_size
            tenant_requests[t] = tenant_requests.get(t, 0) + 1
        try:
            for p, out in zip(items, outcomes, strict=True):
                p.span.set_attribute("joynexus.batch_id", batch_id)
                p.answered = True
                if out.error is not None or out.actions is None:
                    await self._reply_error(
                        p.request, out.error or RuntimeError("no actions"), p.span
                    )
                    continue
                now = time.perf_counter()
                result = InferResult(
                    actions=TensorBytes.from_array(out.actions.detach().to(torch.float32).numpy()),
                    policy_version=p.policy.record.version,
                    batch=info,
                    timings=InferTimings(
                        queue_ms=round((started - p.enqueued) * 1e3, 3),
                        forward_ms=round(forward_ms, 3),
                        decode_ms=round(out.decode_ms, 3),
                        total_ms=round((now - p.received) * 1e3, 3),
                    ),
                )
                try:
                    await self._respond(p.request, result, p.span)
                finally:
                    p.span.end()
                    self._end()
        finally:
            # The busy interval is published after the replies: it is not on their path.
            await metrics.busy(
                self.b,
                "infer",
                wall_start,
                wall_end,
                instance=self.instance,
                requests=len(items),
                rows=rows,
                tenants=len(tenant_rows),
                cpu_s=cpu_s,
                # rows and requests per tenant (usage metering splits the batch's time by rows)
                tenant_rows=tenant_rows,
                tenant_requests=tenant_requests,
            )

    @staticmethod
    def _decode(p: Pending, feats: TokenFeatures) -> _Outcome:
        t0 = time.perf_counter()
        try:
            kw = {} if p.noise is None else {"noise": p.noise}
            actions = p.policy.module.act(features_for(p.policy.module, feats), p.batch.state_B_S, **kw)
            return _Outcome(actions=actions, decode_ms=(time.perf_counter() - t0) * 1e3)
        except Exception as e:
            return _Outcome(error=e)

    def _forward_grouped(self, items: Sequence[Pending]) -> tuple[list[_Outcome], float]:
        """ONE backbone forward over every request's rows, then each head on its own rows
        (pooled features, or token features for heads that read tokens: one forward)."""
        t0 = time.perf_counter()
        shared = concat_batches([p.batch for p in items])
        feats = self.backbone.encode_tokens(shared, tokens=needs_tokens([p.policy.module for p in items]))
        forward_ms = (time.perf_counter() - t0) * 1e3
        parts = feats.split(shared.slices)
        return [self._decode(p, f) for p, f in zip(items, parts, strict=True)], forward_ms

    def _forward_each(self, items: Sequence[Pending]) -> tuple[list[_Outcome], float]:
        """Fallback: one forward per request; a failure stays with its request."""
        t0 = time.perf_counter()
        outs = []
        for p in items:
            t1 = time.perf_counter()
            try:
                req = ActRequest(p.policy.module, p.batch, p.noise)
                (actions,) = serial_forward(self.backbone, [req])
                outs.append(_Outcome(actions=actions, decode_ms=(time.perf_counter() - t1) * 1e3))
            except Exception as e:
                outs.append(_Outcome(error=e))
        return outs, (time.perf_counter() - t0) * 1e3


async def _drain_service(service: Any) -> None:
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
