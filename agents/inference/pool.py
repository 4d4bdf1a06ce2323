"""Engines by the number: :class:`EnginePool` scales engines inside one process, and
``joynexus agent inference`` runs one pool until told to stop.

``scale_up`` loads every tenant's weights before an engine joins the queue group;
``scale_down`` drains (nothing taken is lost). Across processes the same holds:
each ``joynexus agent inference`` process joins only after it loaded the weights
and drains on SIGTERM before it exits. See docs/ARCHITECTURE.md ("The Inference
Queue").
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from joynexus.agents.inference.engine import InferenceEngine
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.families import (
    KV_BUDGET_ENV,
    build_base,
    cache_row_cap,
    kv_budget_bytes,
)
from joynexus.broker.connection import Broker
from joynexus.broker.layout import LayoutOptions, ensure_layout
from joynexus.broker.quotas import QuotaBook
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.inference import DEFAULT_MAX_ROWS

log = logging.getLogger(__name__)

#: The torch intra-op threads of ``joynexus agent inference`` (else the cores less one).
THREADS_ENV = "JOYNEXUS_INFER_THREADS"


def serving_threads(
    threads: int | None = None, *, environ: Mapping[str, str] = os.environ, cores: int | None = None
) -> int:
    """The torch intra-op threads an inference engine's process runs its forwards with:
    ``threads`` if given, else ``$JOYNEXUS_INFER_THREADS``, else the cores this process
    may use less one, at least 1. The engine's event loop (the network, each request's
    intake and reply) needs a core beside the forward: on the 2-core machine two torch
    threads made the engine's 15-16-row tiny forward take 15.3 ms instead of 7.8-8.2 (a
    parallel region waits for whichever of its threads the loop, the server or a client
    took the core from), and one thread served 1.31x [1.13, 1.39] the requests a second
    at concurrency 32 (issue 15, ``joynexus bench engines``)."""
    if threads is None:
        raw = environ.get(THREADS_ENV, "").strip()
        if raw:
            try:
                threads = int(raw)
            except ValueError:
                raise InvalidSpec(f"${THREADS_ENV}={raw!r}: expected a whole number >= 1") from None
    if threads is None:
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores - 1)
    if threads < 1:
        raise InvalidSpec(f"torch threads {threads}: must be >= 1 (or unset: the cores less one)")
    return threads


class EnginePool:
    """Elastic engines in one process, sharing one backbone (each engine has its own heads).

    Scale operations are serialized. ``scale_up`` loads every tenant's current
    weights before the new engine joins the queue group, and rolls back (the
    engine never joined) if that fails. ``scale_down`` drains the newest
    engine: it stops taking requests, answers every request it took, stops.
    """

    def __init__(
        self, broker: Broker, backbone: Backbone, *, instance_prefix: str = "infer",
        **engine: Any,
    ) -> None:
        """``engine``: each engine's settings, :class:`InferenceEngine`'s keyword
        arguments (``base_model``, ``max_batch``, ``max_rows``, ``max_wait_ms``,
        ``retain_versions``, ...); a name it does not take is refused here."""
        unknown = set(engine) - set(inspect.signature(InferenceEngine).parameters) | (
            set(engine) & {"instance", "quotas"})
        if unknown:
            raise TypeError(f"EnginePool: not an engine setting: {sorted(unknown)}")
        self.b = broker
        self.backbone = backbone
        self.kw: dict[str, Any] = engine
        self.instance_prefix = instance_prefix
        self.engines: list[InferenceEngine] = []
        self._lock = asyncio.Lock()
        self._seq = itertools.count()
        self.quotas = QuotaBook(broker)  # one watcher for all the pool's engines
        self._quotas_started = False

    def __len__(self) -> int:
        return len(self.engines)

    async def scale_up(self) -> InferenceEngine:
        async with self._lock:
            if not self._quotas_started:
                await self.quotas.start()
                self._quotas_started = True
            engine = InferenceEngine(
                self.b,
                self.backbone,
                instance=f"{self.instance_prefix}-{next(self._seq)}",
                quotas=self.quotas,
                **self.kw,
            )
            try:
                await engine.prepare()
                await engine.join()
            except BaseException:
                await engine.close()
                raise
            self.engines.append(engine)
            return engine

    async def scale_down(self) -> InferenceEngine | None:
        async with self._lock:
            if not self.engines:
                return None
            engine = self.engines.pop()
            await engine.stop()
            return engine

    async def scale_to(self, n: int) -> None:
        while len(self.engines) < n:
            await self.scale_up()
        while len(self.engines) > n:
            await self.scale_down()

    async def close(self) -> None:
        await self.scale_to(0)
        await self.quotas.stop()
        self._quotas_started = False


async def run_inference_agent(
    broker: Broker,
    stop: asyncio.Event,
    *,
    base_model: str | None = None,
    size: str = "tiny",
    max_batch: int = 16,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_wait_ms: float = 5.0,
    instance: str = "infer-0",
    engines: int = 1,
    backbone_path: str | None = None,
    threads: int | None = None,
    layout: LayoutOptions | None = None,
    family: str = "qwen2_5_vl",
) -> None:
    """``joynexus agent inference``: build the backbone, serve until ``stop`` is set, then drain.

    ``family`` is the base family (``agents.models.families``: ``qwen2_5_vl``, ``pi05``, ``smolvla``);
    ``base_model`` defaults to the backbone's name (``qwen2.5-vl-<size>``, ``pi05-<size>``, ``smolvla-<size>``); ``threads``
    (torch's intra-op threads, for this process) to :func:`serving_threads`.
    """
    await ensure_layout(broker, layout)
    threads = serving_threads(threads)
    # On this (the event loop's) thread too: a batch whose forward is short runs here, and
    # torch's OpenMP keeps a thread count per thread.
    torch.set_num_threads(threads)
    backbone = await asyncio.to_thread(build_base, family, size, backbone_path, threads)
    capped = cache_row_cap(backbone, max_rows, kv_budget_bytes())
    if capped < max_rows:  # a π0.5 base: each row's prefix cache counts against the batch's memory
        log.info("inference %s: max_rows %d -> %d (prefix caches within $%s)", instance, max_rows, capped,
                 KV_BUDGET_ENV)
        max_rows = capped
    pool = EnginePool(
        broker,
        backbone,
        base_model=base_model,
        max_batch=max_batch,
        max_rows=max_rows,
        max_wait_ms=max_wait_ms,
        instance_prefix=instance,
    )
    try:
        await pool.scale_to(engines)
        log.info(
            "inference %s serving %s on %s (B=%d, T=%gms, %d engine(s))",
            instance,
            pool.engines[0].base_model,
            broker.names.infer(pool.engines[0].base_model),
            max_batch,
            max_wait_ms,
            engines,
        )
        await stop.wait()
    finally:
        await pool.close()
