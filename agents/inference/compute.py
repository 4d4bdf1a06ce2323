"""The engine's compute: ONE backbone forward over a batch's rows, each tenant's
head on its own rows, the per-request fallback, and the replies' payloads.
Torch only, no connection: the engine's loop (:mod:`.engine`) decides when and
where (event loop or forward thread) these run; :class:`ForwardTimes` is what it
decides "where" from. See docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from joynexus.agents.inference.batcher import Pending
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.features import TokenFeatures, concat_batches
from joynexus.agents.models.grouped import (
    ActRequest,
    features_for,
    for_base,
    needs_tokens,
    serial_forward,
)
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.stacked import arch_key, stackable, stacked_act
from joynexus.schemas.inference import BatchInfo, InferResult, InferTimings, TensorBytes


@dataclass
class Outcome:
    """One request's part of a batch: its actions, or the error that kept it from them."""

    actions: torch.Tensor | None = None
    error: Exception | None = None
    decode_ms: float = 0.0


#: What a forward function returns: each request's outcome, and the backbone's ms.
Forward = Callable[[Sequence[Pending]], tuple[list[Outcome], float]]


def decode_one(p: Pending, feats: TokenFeatures) -> Outcome:
    """A tenant's head on its rows' features (its error stays with its request)."""
    t0 = time.perf_counter()
    try:
        kw = {} if p.noise is None else {"noise": p.noise}
        actions = p.policy.module.act(features_for(p.policy.module, feats), p.batch.state_B_S, **kw)
        return Outcome(actions=actions, decode_ms=(time.perf_counter() - t0) * 1e3)
    except Exception as e:
        return Outcome(error=e)


#: A policy's rows in a batch beyond which its head decodes on its own, not stacked
#: (the stacked call pads every policy's rows to its largest). Four heads with one of
#: them at 16 rows took 1.3-1.6x their call at 1-2 rows; at 64 (the default quota),
#: 2.2-3.6x (OFT MLP, flow matching).
STACK_MAX_ROWS = 16


def _unit_inputs(
    module: TenantModule, group: Sequence[Pending], parts: Sequence[TokenFeatures]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One policy's requests as one head input: features, states and (if they gave it,
    all of them or none) noise, their rows in the requests' order."""
    x = torch.cat([features_for(module, f) for f in parts])
    state = torch.cat([p.batch.state_B_S for p in group])
    noise = None if group[0].noise is None else torch.cat([p.noise for p in group if p.noise is not None])
    return x, state, noise


def _split(actions: torch.Tensor, group: Sequence[Pending], ms: float) -> list[Outcome]:
    rows = [p.batch.batch_size for p in group]
    if actions.shape[0] != sum(rows):
        raise RuntimeError(f"head returned {actions.shape[0]} rows for {sum(rows)}")
    return [Outcome(actions=a, decode_ms=ms) for a in actions.split(rows)]


def decode_many(group: Sequence[Pending], parts: Sequence[TokenFeatures]) -> list[Outcome]:
    """One head call for all the rows of a batch's requests that share one policy (a
    call on a few rows costs nearly what one on a single row does: at 16 requests of 8
    tenants this halves the head calls), split back per request. If it fails, each
    request is decoded alone, so an error stays with the request that caused it."""
    if len(group) == 1:
        return [decode_one(group[0], parts[0])]
    t0 = time.perf_counter()
    module = group[0].policy.module
    try:
        x, state, noise = _unit_inputs(module, group, parts)
        actions = module.act(x, state, **({} if noise is None else {"noise": noise}))
        return _split(actions, group, (time.perf_counter() - t0) * 1e3)
    except Exception:
        return [decode_one(p, f) for p, f in zip(group, parts, strict=True)]


def decode_stacked(
    items: Sequence[Pending], parts: Sequence[TokenFeatures], units: Sequence[Sequence[int]]
) -> list[Outcome] | None:
    """Several policies' heads of one architecture in ONE batched call
    (:func:`stacked.stacked_act`), each unit (one policy's requests, by index) on its
    own rows; the outcomes in ``units``' order, request by request. None if it fails:
    the caller then decodes each unit alone (and each request alone if that fails)."""
    t0 = time.perf_counter()
    try:
        groups = [[items[i] for i in u] for u in units]
        modules = [g[0].policy.module for g in groups]
        inputs = [
            _unit_inputs(m, g, [parts[i] for i in u])
            for m, g, u in zip(modules, groups, units, strict=True)
        ]
        acts = stacked_act([m.head for m in modules], *(list(col) for col in zip(*inputs, strict=True)))
        ms = (time.perf_counter() - t0) * 1e3
        return [out for g, a in zip(groups, acts, strict=True) for out in _split(a, g, ms)]
    except Exception:
        return None


def decode_grouped(items: Sequence[Pending], parts: Sequence[TokenFeatures]) -> list[Outcome]:
    """Each policy's head once over its requests' rows (:func:`decode_many`), and the
    heads of one architecture (:func:`stacked.arch_key`) of several policies, each of at
    most ``STACK_MAX_ROWS`` rows, in one stacked call (:func:`decode_stacked`); outcomes
    in the batch's order. Requests group by the loaded policy (tenant, key and version)
    and by whether they gave their own noise."""
    units: dict[tuple[int, bool], list[int]] = {}
    for i, p in enumerate(items):
        units.setdefault((id(p.policy), p.noise is None), []).append(i)
    # A unit of more than STACK_MAX_ROWS rows decodes alone: the stacked call pads every
    # unit to its largest, so one tenant's many rows (up to its quota's max_infer_rows)
    # would make the others' heads compute as many; a unit that large amortises its
    # own call anyway.
    by_arch: dict[object, list[list[int]]] = {}
    for idx in units.values():
        head = items[idx[0]].policy.module.head
        rows = sum(items[i].batch.batch_size for i in idx)
        key = arch_key(head) if stackable(head) and rows <= STACK_MAX_ROWS else id(idx)
        by_arch.setdefault(key, []).append(idx)
    outs: list[Outcome | None] = [None] * len(items)
    for group in by_arch.values():
        stacked = decode_stacked(items, parts, group) if len(group) > 1 else None
        if stacked is None:
            stacked = [o for idx in group for o in decode_many([items[i] for i in idx], [parts[i] for i in idx])]
        for i, out in zip([i for u in group for i in u], stacked, strict=True):
            outs[i] = out
    return [o for o in outs if o is not None]


def forward_grouped(backbone: Backbone, items: Sequence[Pending]) -> tuple[list[Outcome], float]:
    """ONE backbone forward over every request's rows, then each policy's head once on
    its requests' rows (pooled features, or token features for heads that read tokens)."""
    t0 = time.perf_counter()
    shared = concat_batches([for_base(backbone, p.batch, p.policy.module) for p in items])
    feats = backbone.encode_tokens(shared, tokens=needs_tokens([p.policy.module for p in items]))
    forward_ms = (time.perf_counter() - t0) * 1e3
    return decode_grouped(items, feats.split(shared.slices)), forward_ms


def forward_each(backbone: Backbone, items: Sequence[Pending]) -> tuple[list[Outcome], float]:
    """Fallback: one forward per request; a failure stays with its request."""
    t0 = time.perf_counter()
    outs = []
    for p in items:
        t1 = time.perf_counter()
        try:
            req = ActRequest(p.policy.module, p.batch, p.noise)
            (actions,) = serial_forward(backbone, [req])
            outs.append(Outcome(actions=actions, decode_ms=(time.perf_counter() - t1) * 1e3))
        except Exception as e:
            outs.append(Outcome(error=e))
    return outs, (time.perf_counter() - t0) * 1e3


def result_of(
    p: Pending, out: Outcome, info: BatchInfo, *, started: float, forward_ms: float, now: float
) -> InferResult:
    """The reply to one request whose actions were decoded (times from perf_counter)."""
    assert out.actions is not None
    return InferResult(
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


def joined(
    p: Pending, out: Outcome, started: float, forward_ms: float
) -> tuple[Outcome | None, float, float]:
    """Note one decoded part of a split request; once every part is in, the whole
    request's outcome (the parts' actions in order), when its first part's batch
    began and its parts' forward ms; before that (None, ...)."""
    assert p.part is not None
    whole, i = p.part
    whole.outcomes[i] = out
    whole.done += 1
    whole.forward_ms += forward_ms
    whole.started = started if whole.started is None else min(whole.started, started)
    if not whole.complete:
        return None, started, forward_ms
    parts: list[Outcome] = whole.outcomes
    actions = torch.cat([o.actions for o in parts if o.actions is not None], dim=0)
    decode_ms = sum(o.decode_ms for o in parts)
    return Outcome(actions=actions, decode_ms=decode_ms), whole.started, whole.forward_ms


def tally(items: Sequence[Pending]) -> tuple[dict[str, int], dict[str, int]]:
    """Rows and requests per tenant in a batch (usage metering splits its time by rows;
    a split request counts as a request in the batch of its first part)."""
    tenant_rows: dict[str, int] = {}
    tenant_requests: dict[str, int] = {}
    for p in items:
        t = p.req.tenant_id
        tenant_rows[t] = tenant_rows.get(t, 0) + p.batch.batch_size
        if p.part is None or p.part[1] == 0:
            tenant_requests[t] = tenant_requests.get(t, 0) + 1
    return tenant_rows, tenant_requests


class ForwardTimes:
    """The last forward times measured (ms) by (backbone key, rows' power of two),
    bounded; the median of a key's last ones is its estimate (one stall from
    elsewhere on the machine does not move it)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], deque[float]] = {}

    @staticmethod
    def key(items: Sequence[Pending], rows: int) -> tuple[str, int]:
        return (items[0].key, rows.bit_length())

    def estimate_ms(self, key: tuple[str, int]) -> float | None:
        """None: this size was not measured yet."""
        seen = self.seen.get(key)
        return statistics.median(seen) if seen else None

    def note(self, key: tuple[str, int], ms: float) -> None:
        seen = self.seen.get(key)
        if seen is None:
            if len(self.seen) >= 1024:  # bounded: many schemas seen
                self.seen.clear()
            seen = self.seen[key] = deque(maxlen=9)
        seen.append(ms)


class ForwardThread:
    """One thread for an engine's long forwards (always the same OS thread, so torch's
    intra-op pool is made once; a batch at a time, as the batcher runs them)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor: ThreadPoolExecutor | None = None

    async def call(
        self, fn: Forward, items: Sequence[Pending], inline: bool
    ) -> tuple[tuple[list[Outcome], float], float]:
        """``fn(items)`` on the event loop or on the thread, and its wall time (ms)
        where it ran (the hop to the thread and back not counted)."""

        def timed() -> tuple[tuple[list[Outcome], float], float]:
            t0 = time.perf_counter()
            out = fn(items)
            return out, (time.perf_counter() - t0) * 1e3

        if inline:
            return timed()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-forward")
        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
