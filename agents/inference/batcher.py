"""The pending queue's entries and the batcher's choice, a pure function.

Adaptive batching (issue 15): an idle engine runs what it has at once; while a
batch runs, requests accumulate and form the next one (up to ``max_batch``) the
moment it ends; ``max_wait`` only bounds how long a request that arrived at a
busy engine may then still wait for company, counted from when the engine could
first have run it. Tenants take turns, each in FIFO order, so a tenant that
queues a thousand requests waits behind itself; a batch is bounded by rows as
well as requests (``max_rows``: a forward's cost grows with its rows), so a
tenant sending large requests fills a batch of its own and one with 1-row
requests waits at most about one batch behind it (issue 24); while more than one
tenant sends, that bound is halved (:func:`row_bound`), so the batch a newcomer waits
behind is a half one. :func:`choose` decides "which
prefix now" from the pending requests' keys and arrival times alone; the engine
only runs what it says. See docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from nats.micro.request import Request

    from joynexus.agents.inference.policies import LoadedPolicy
    from joynexus.agents.models.features import FeatureBatch
    from joynexus.schemas.inference import InferRequest


class Waiting(Protocol):
    """What the choice reads of a pending request."""

    @property
    def tenant(self) -> str: ...
    @property
    def key(self) -> str: ...  # backbone key: who may share a forward
    @property
    def enqueued(self) -> float: ...  # when it joined the queue (perf_counter)
    @property
    def busy(self) -> bool: ...  # it arrived while a batch was running
    @property
    def rows(self) -> int: ...  # observations in it: what its forward costs


@dataclass(frozen=True)
class Arrival:
    """A pending request as the choice sees it (a row of the batcher's tables)."""

    tenant: str
    key: str
    enqueued: float = 0.0
    busy: bool = False
    rows: int = 1


@dataclass
class Whole:
    """A request split into parts (:func:`split`): what its parts' forwards gave so
    far. It is answered once, when its last part is decoded (the parts' actions in
    order) or at its first part's error (the parts still queued are then dropped)."""

    parts: int
    outcomes: list[Any]
    done: int = 0
    failed: bool = False
    #: when its first part's batch began (perf_counter), and its parts' forward ms
    started: float | None = None
    forward_ms: float = 0.0

    @property
    def complete(self) -> bool:
        return self.done == self.parts


@dataclass
class Pending:
    """A validated request waiting for (or in) a batch; or one part of a request
    larger than the engine's batch rows (``part``: its whole and its index)."""

    request: Request
    req: InferRequest
    policy: LoadedPolicy
    batch: FeatureBatch
    noise: torch.Tensor | None
    key: str  # backbone key: who may share a forward
    span: Any
    received: float
    enqueued: float = 0.0
    answered: bool = False
    #: arrived while a batch was running (only such a request may wait for company)
    busy: bool = False
    part: tuple[Whole, int] | None = None

    @property
    def tenant(self) -> str:
        return self.req.tenant_id

    @property
    def rows(self) -> int:
        return self.batch.batch_size


def split(p: Pending, rows: int) -> list[Pending]:
    """``p`` as parts of at most ``rows`` rows each, in order (``p`` itself if it has no
    more): a large request then shares the engine in forwards no larger than a batch,
    in turn with other tenants' requests, instead of running as one long forward that
    every other tenant's request waits behind."""
    n = p.rows
    if n <= rows:
        return [p]
    bounds = [(a, min(a + rows, n)) for a in range(0, n, rows)]
    whole = Whole(parts=len(bounds), outcomes=[None] * len(bounds))
    b = p.batch
    return [
        replace(
            p,
            batch=replace(
                b,
                images={slot: x[lo:hi] for slot, x in b.images.items()},
                instructions=b.instructions[lo:hi],
                state_B_S=b.state_B_S[lo:hi],
                history_B_H_S=None if b.history_B_H_S is None else b.history_B_H_S[lo:hi],
            ),
            noise=None if p.noise is None else p.noise[lo:hi],
            part=(whole, i),
        )
        for i, (lo, hi) in enumerate(bounds)
    ]


def part_rows(max_rows: int) -> int:
    """The rows of a large request's parts for batches of at most ``max_rows``: half of
    it. A tenant alone still fills a batch (two parts), but a batch that a 1-row
    request shares with a large one's part holds about half the rows, so the small
    request's forward costs about half a full batch: it waits for the batch running
    when it came plus about half of one, not two whole ones."""
    return max(1, max_rows // 2)


#: A tenant that sent a request this recently (seconds) shares the engine: while two
#: or more do, batches hold at most :func:`part_rows` rows (:func:`row_bound`).
SHARING_WINDOW_S = 2.0


def row_bound(max_rows: int, sharing: int) -> int:
    """The row bound of the next batch while ``sharing`` tenants send requests: the
    engine's ``max_rows`` for a tenant alone (its large requests fill whole batches:
    throughput), half of it (a large request's part, :func:`part_rows`) while more than
    one does. The batch running when a tenant's request arrives is what that request
    waits for first, so the bound must already hold when it comes: a tenant that sent a
    request within :data:`SHARING_WINDOW_S` counts as sharing, and the others' batches
    stay small in between its requests. A 1-row request then waits for at most one
    half-batch and runs in its own turn (a part does not fit beside it), instead of a
    full batch and then one that a part and it share (issue 24)."""
    return max_rows if sharing <= 1 else part_rows(max_rows)


def sharing(last_seen: dict[str, float], now: float, window_s: float = SHARING_WINDOW_S) -> int:
    """How many tenants sent a request within ``window_s`` of ``now`` (``last_seen``:
    tenant -> its latest request's arrival); the others are forgotten (``last_seen`` is
    pruned in place, so it holds only the recent senders)."""
    stale = [t for t, at in last_seen.items() if now - at > window_s]
    for t in stale:
        del last_seen[t]
    return len(last_seen)


@dataclass(frozen=True)
class Choice:
    """Run ``take`` (indices into the queue, in batch order) now, or wait until ``until``
    (perf_counter) or an arrival, whichever comes first, and choose again."""

    take: tuple[int, ...] = ()
    until: float | None = None


def plan(
    queue: Sequence[Waiting], last_served: Mapping[str, int], max_batch: int,
    max_rows: int | None = None,
) -> list[int]:
    """The next batch (indices into ``queue``): tenants take turns (the one served longest
    ago first, then arrival), one request per tenant per round, each tenant's own requests
    in FIFO order; a tenant whose next request cannot share the batch's backbone forward,
    or would take the batch past ``max_rows`` rows, sits the rest of this batch out (the
    batch's first request always runs, however large). With one tenant this is the
    largest FIFO-compatible prefix within the bounds."""
    if not queue:
        return []
    lines: dict[str, deque[int]] = {}
    for i, p in enumerate(queue):
        lines.setdefault(p.tenant, deque()).append(i)
    order = sorted(lines, key=lambda t: last_served.get(t, -1))  # stable: arrival
    key = queue[lines[order[0]][0]].key
    out: list[int] = []
    rows = 0
    out_of_turn: set[str] = set()
    while len(out) < max_batch:
        took = False
        for t in order:
            line = lines[t]
            if t in out_of_turn or not line or len(out) >= max_batch:
                continue
            head = queue[line[0]]
            if head.key != key:
                continue
            if out and max_rows is not None and rows + head.rows > max_rows:
                out_of_turn.add(t)  # FIFO: its later requests wait behind this one
                continue
            out.append(line.popleft())
            rows += head.rows
            took = True
        if not took:
            break
    return out


def choose(
    queue: Sequence[Waiting],
    last_served: Mapping[str, int],
    *,
    now: float,
    freed_at: float,
    max_batch: int,
    max_wait_s: float,
    max_rows: int | None = None,
) -> Choice:
    """Which batch to run now from an idle engine's queue, or how long to wait for company.

    Runs at once when the batch is full (requests or rows), when an incompatible request behind it blocks
    it from growing, or when the head did not arrive at a busy engine. A head that did
    may wait until ``max_wait_s`` after the engine could first have run it (``freed_at``:
    when the last batch ended): waiting behind the running batch is not waiting for
    company. An empty queue gives an empty choice with nothing to wait for."""
    take = plan(queue, last_served, max_batch, max_rows)
    if not take:
        return Choice()
    head = queue[0]
    deadline = max(head.enqueued, freed_at) + max_wait_s if head.busy else head.enqueued
    full = len(take) >= max_batch or (
        max_rows is not None and sum(queue[i].rows for i in take) >= max_rows
    )
    if full or len(take) < len(queue) or deadline - now <= 0:
        return Choice(take=tuple(take))
    return Choice(until=deadline)


def served(
    last_served: dict[str, int], tenants: Sequence[str], turn: int, forget_above: int
) -> dict[str, int]:
    """``last_served`` after batch number ``turn`` served ``tenants``; past
    ``forget_above`` tenants, only this batch's are remembered (long-gone ones forgotten)."""
    for t in tenants:
        last_served[t] = turn
    if len(last_served) > forget_above:
        return dict.fromkeys(tenants, turn)
    return last_served
