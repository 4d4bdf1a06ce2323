"""The engine: the loop around the batcher's choice, wired to the rpc Server.

An :class:`InferenceEngine` holds the shared frozen backbone and the heads of the
tenants it serves; it is one endpoint of the NATS micro service ``<ns>-infer``
(``Names.infer(base_model)``, in a queue group, so engines share the load). Its
jobs live apart: the door (:mod:`.intake`: decode, check, enqueue, reply), the
choice (:func:`.batcher.choose`) and the compute (:mod:`.compute`: ONE backbone
forward over the batch's rows, each tenant's head, torch only). This module is
the lifecycle and the loop: what to run and the replies; where a batch's forward
runs, its fallback to one forward per request and its busy metric are
:mod:`.runs`'. See docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from nats.micro import add_service

from joynexus.agents.inference import batcher
from joynexus.agents.inference.batcher import Pending, part_rows
from joynexus.agents.inference.compute import (
    Outcome,
    joined,
    result_of,
    tally,
)
from joynexus.agents.inference.intake import EngineStats, Intake, drain_service
from joynexus.agents.inference.policies import PolicyCache
from joynexus.agents.inference.runs import INLINE_FORWARD_MS, BatchRuns
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.policyio import PolicyStore
from joynexus.broker.connection import Broker
from joynexus.broker.fastpath import FastResponder, enabled_by_env, sync_server
from joynexus.broker.quotas import QuotaBook
from joynexus.broker.responder import Server
from joynexus.broker.subjects import model_token
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.errors import InvalidSpec, Unavailable
from joynexus.schemas.inference import DEFAULT_MAX_ROWS, BatchInfo, InferError, encode_msgpack

__all__ = ["InferenceEngine"]

log = logging.getLogger(__name__)


#: Before an idle engine chooses its batch, the loop turns while turns bring requests
#: already received (``InferenceEngine._take_in_received``), at most this long, and
#: until this many turns in a row bring none.
GATHER_MAX_S = 0.001
GATHER_IDLE_TURNS = 2


class InferenceEngine:
    """One batching engine for one base model. ``start()`` = ``prepare()`` + ``join()``."""

    def __init__(
        self,
        broker: Broker,
        backbone: Backbone,
        *,
        base_model: str | None = None,
        max_batch: int = 16,
        max_rows: int = DEFAULT_MAX_ROWS,
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
        if max_rows < 1:
            raise InvalidSpec(f"max_rows={max_rows}: must be >= 1")
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
        #: rows (observations) a batch may hold; a larger request runs in parts of this many
        self.max_rows = max_rows
        self.max_wait_s = max_wait_ms / 1e3
        self.instance = instance
        self.retain_versions = retain_versions
        self.policies = policies or PolicyStore(broker)
        self.load_timeout_s = load_timeout_s
        self.stats = EngineStats()
        self.state = "new"  # new -> prepared -> serving -> draining -> stopped

        self.cache = PolicyCache(
            self.policies,
            backbone,
            base_model=self.base_model,
            retain_versions=retain_versions,
            instance=instance,
        )
        self._freed_at = 0.0  # when the last batch ended (perf_counter)
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
        self.runs = BatchRuns(broker, self.rpc, backbone, self.stats, instance=instance,
                              inline_forward_ms=inline_forward_ms)
        self.intake = Intake(
            broker, self.rpc, self.cache, self.quotas, self.stats,
            instance=instance, max_queue=max_queue, part_rows=part_rows(max_rows),
        )
        # Batch number in which each tenant was last served (turn-taking).
        self._last_served: dict[str, int] = {}

    @property
    def max_queue(self) -> int:
        """Requests queued beyond which a new one is refused (``Unavailable``)."""
        return self.intake.max_queue

    @property
    def _queue(self) -> deque[Pending]:
        return self.intake.queue

    @property
    def _inflight(self) -> int:
        return self.intake.inflight

    @property
    def _forward_ms(self) -> dict[tuple[str, int], deque[float]]:
        return self.runs.times.seen

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
                "base_family": str(getattr(self.backbone, "family", "qwen2_5_vl")),
                "base_params": str(self.backbone.num_params()),
                "max_batch": str(self.max_batch),
                "max_rows": str(self.max_rows),
                "shared_rows": str(part_rows(self.max_rows)),  # the bound while tenants share
                "max_wait_ms": f"{self.max_wait_s * 1e3:g}",
            },
            queue_group=n.inference_service,
        )
        await self._service.add_endpoint(
            name=model_token(self.base_model),
            subject=n.infer(self.base_model),
            handler=self.intake.on_request,
            metadata={"base_model": self.base_model},
        )
        # The agents' requests for tenants (rollouts, evaluations): the same queue,
        # on a subject only the service may publish to (their replies go to its inboxes).
        await self._service.add_endpoint(
            name=f"svc-{model_token(self.base_model)}",
            subject=n.service_infer(self.base_model),
            handler=self.intake.on_request,
            metadata={"base_model": self.base_model},
        )
        await sync_server(nc)  # on the server before join() returns (one flush() does not promise it)
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
            await drain_service(self._service)
            self._service = None
        await self.intake.idle.wait()
        await self.close()

    async def close(self) -> None:
        """Stop at once (rollback of a failed prepare; after ``stop()``'s drain)."""
        tasks = [t for t in (self._watcher, self._batcher) if t is not None]
        await cancel_and_wait(*tasks)
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
            self._service = None
        await self.runs.close()
        await self.rpc.stop()
        if self._own_quotas:
            await self.quotas.stop()
        self.state = "stopped"

    # ------------------------------------------------------------ policies
    def loaded_versions(self, tenant_id: str, workload: str = "default") -> list[int]:
        return self.cache.loaded_versions(tenant_id, workload)

    def latest_version(self, tenant_id: str, workload: str = "default") -> int | None:
        return self.cache.latest_version(tenant_id, workload)

    def _watch_ended(self, task: asyncio.Task[None]) -> None:
        if self.state in ("prepared", "serving") and not task.cancelled() and task.exception():
            log.error(
                "engine %s: policy watch failed, new versions load on demand only: %r",
                self.instance,
                task.exception(),
            )

    # ------------------------------------------------------------ the batcher
    async def _batch_loop(self) -> None:
        """Adaptive batching: an idle engine runs what it has at once; while a batch runs,
        requests accumulate and form the next one (up to ``max_batch``, tenants taking
        turns). Only a request that arrived while a batch ran may wait for company, and
        at most ``max_wait_ms`` after the engine could first have run it."""
        intake = self.intake
        while True:
            items = await self._next_batch()
            intake.running = True
            try:
                await self._run_batch(items)
            except Exception as e:  # a bug: answer the batch with it, keep batching
                log.exception("engine %s: batch failed", self.instance)
                for p in items:
                    if not p.answered:
                        await self._fail(p, e)
            finally:
                intake.running = False
                self._freed_at = time.perf_counter()

    async def _next_batch(self) -> list[Pending]:
        """Wait for requests, then for what ``batcher.choose`` says; take its choice
        off the queue and note whose turn it was."""
        intake = self.intake
        loop = asyncio.get_running_loop()
        while not intake.queue:
            intake.wake.clear()
            await intake.wake.wait()
        await self._take_in_received()
        while True:
            now = time.perf_counter()
            queue = list(intake.queue)
            choice = batcher.choose(
                queue,
                self._last_served,
                now=now,
                freed_at=self._freed_at,
                max_batch=self.max_batch,
                max_wait_s=self.max_wait_s,
                max_rows=batcher.row_bound(self.max_rows, batcher.sharing(intake.last_seen, now)),
            )
            if choice.until is None:
                break
            intake.wake.clear()
            waiter = loop.create_task(intake.wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=choice.until - now)
            finally:
                waiter.cancel()
        chosen = set(choice.take)
        items = [queue[i] for i in choice.take]
        intake.queue = deque(p for i, p in enumerate(queue) if i not in chosen)
        turn = next(self._batch_ids_served)
        self._last_served = batcher.served(
            self._last_served, [p.tenant for p in items], turn, 4 * self.max_queue
        )
        return items

    async def _take_in_received(self) -> None:
        """Let the requests this connection has already received join before the batch is
        chosen: turn the event loop while turns bring requests (until ``GATHER_IDLE_TURNS``
        turns in a row bring none, the batch is full, or ``GATHER_MAX_S`` passed). A burst
        of requests spans several socket reads, and nats-py parses a read and hands its
        messages to the handler on later turns: one turn took in only the first read's
        requests, and the rest waited a whole forward. No request not yet received is
        waited for: an idle engine still runs at once what has come."""
        intake = self.intake
        seen, idle = len(intake.queue), 0
        deadline = time.perf_counter() + GATHER_MAX_S
        while idle < GATHER_IDLE_TURNS and seen < self.max_batch and time.perf_counter() < deadline:
            await asyncio.sleep(0)
            n = len(intake.queue)
            idle = idle + 1 if n == seen else 0
            seen = n

    def forward_estimate_ms(self, key: tuple[str, int]) -> float | None:
        """The median of the last forwards of this size measured (None: not measured yet)."""
        return self.runs.times.estimate_ms(key)

    @property
    def inline_forward_ms(self) -> float:
        """A batch whose forward is expected to take at most this long runs on the event
        loop; longer ones (and any of a size not measured yet) on the forward thread."""
        return self.runs.inline_forward_ms

    @inline_forward_ms.setter
    def inline_forward_ms(self, ms: float) -> None:
        self.runs.inline_forward_ms = ms

    async def _fail(self, p: Pending, e: BaseException) -> None:
        """Answer ``p``'s request with ``e`` (a split request: once, at its first failed
        part; its other parts are then dropped unrun)."""
        p.answered = True
        if p.part is not None:
            whole = p.part[0]
            if whole.failed:
                return
            whole.failed = True
        await self.intake.reply_error(p.request, e, p.span)

    async def _run_batch(self, items: list[Pending]) -> None:
        # The parts of a request that failed already have nothing left to answer.
        for p in items:
            if p.part is not None and p.part[0].failed:
                p.answered = True
        items = [p for p in items if not p.answered]
        if not items:
            return
        batch_id = f"{self.instance}-{next(self._batch_ids)}"
        rows = sum(p.batch.batch_size for p in items)
        started = time.perf_counter()
        wall_start = time.time()
        cpu_start = time.process_time()  # CPU seconds of this process: compute, not waiting
        outcomes, forward_ms, inline, fallback = await self.runs.forward(
            items, rows, batch_id, queued=bool(self.intake.queue))
        wall_end, cpu_s = time.time(), time.process_time() - cpu_start
        self.stats.batches += 1
        self.stats.rows += rows
        self.stats.batch_sizes.append(len(items))
        if inline:
            self.stats.inline_batches += 1
        info = BatchInfo(
            batch_id=batch_id, size=len(items), rows=rows, instance=self.instance, fallback=fallback
        )
        tenant_rows, tenant_requests = tally(items)
        try:
            await self._answer(items, outcomes, info, started=started, forward_ms=forward_ms)
        finally:
            # The busy interval goes out BUSY_DELAY_S after the replies, off their path.
            self.runs.note_busy(
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

    async def _answer(
        self, items: Sequence[Pending], outcomes: list[Outcome], info: BatchInfo, *,
        started: float, forward_ms: float,
    ) -> None:
        """Each request its actions or its own error, in the batch's order."""
        intake = self.intake
        for p, out in zip(items, outcomes, strict=True):
            p.span.set_attribute("joynexus.batch_id", info.batch_id)
            if out.error is not None or out.actions is None:
                await self._fail(p, out.error or RuntimeError("no actions"))
                continue
            p.answered = True
            if p.part is not None:  # one part of a split request: answered with its last
                whole_out, whole_started, whole_ms = joined(p, out, started, forward_ms)
                if whole_out is None:
                    continue
                out = whole_out
            else:
                whole_started, whole_ms = started, forward_ms
            result = result_of(
                p, out, info, started=whole_started, forward_ms=whole_ms, now=time.perf_counter()
            )
            try:
                await intake.respond(p.request, result, p.span)
            finally:
                p.span.end()
                intake.end()
