"""The admission queue: reserves that wait for a slot instead of polling (pure).

A ``reserve`` refused for a limit that will lift (``WAITABLE``) may wait: it is
a :class:`Waiter` here while its long poll lasts (the scheduler's verb holds
it; a scheduler restart forgets it and the client asks again, which costs it
nothing: its place is its tenant's lag, not its arrival). Each tenant has at
most ``per_tenant`` waiters; past it the reserve gets the plain refusal at once.

The only limit tenants share is the global one on active rollouts
(``global_rollouts``): a free rollout slot goes to the waiter of the tenant
furthest behind its weighted share (``agents.fairshare.admission_key``), a
fresh reserve included, so a tenant that asks ten times as often does not get
ten times the slots. ``SchedulerCore`` counts the waiters ranked ahead of a
request (:meth:`AdmissionQueue.ahead`) and admits it only while a slot is left
for it. The other limits (``in_flight``, ``rollouts``, ``completion_target``)
are a workload's own: its waiters take turns in arrival order.

See docs/ARCHITECTURE.md, "Fair shares of the trainer".
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from joynexus.agents.fairshare import Past, admission_key, lease_key, replay
from joynexus.agents.lifecycle import JobBook, ready_key
from joynexus.schemas.jobs import TERMINAL_STATES, JobEvent, JobState, TrainingJob
from joynexus.schemas.scheduler import Refusal, ReserveRequest, TenantShare

S = JobState
#: States a tenant's job counts as under way in (its admission lag counts them).
OPEN_STATES = tuple(s.value for s in JobState if s not in TERMINAL_STATES)

#: Refusals a reserve may wait out in the queue (the others answer at once).
WAITABLE = frozenset({"in_flight", "rollouts", "global_rollouts", "completion_target"})
#: Waiting reserves per tenant (its producers and env workers); past it: refused.
MAX_WAITING_PER_TENANT = 32


@dataclass
class Waiter:
    """One waiting reserve: whose, why it waits (a refusal code), since when."""

    job_id: str
    tenant: str
    workload_key: str
    priority: int
    weight: int
    code: str
    since: float


GLOBAL = "global_rollouts"


@dataclass
class AdmissionQueue:
    per_tenant: int = MAX_WAITING_PER_TENANT
    waiters: dict[str, Waiter] = field(default_factory=dict)
    by_tenant: Counter[str] = field(default_factory=Counter)
    #: Per workload key: its waiters for its own limits, in arrival order.
    by_workload: dict[str, dict[str, Waiter]] = field(default_factory=dict)
    #: Waiters for a global rollout slot.
    n_global: int = 0

    def add(self, w: Waiter) -> bool:
        """Queue ``w`` (or update why it waits, if queued); False when its tenant's
        queue is full."""
        old = self.waiters.get(w.job_id)
        if old is not None:
            if (old.code == GLOBAL) != (w.code == GLOBAL):  # else it keeps its place
                self._index(old, -1)
                old.code = w.code
                self._index(old, +1)
            old.code = w.code
            return True
        if self.by_tenant[w.tenant] >= self.per_tenant:
            return False
        self.waiters[w.job_id] = w
        self.by_tenant[w.tenant] += 1
        self._index(w, +1)
        return True

    def remove(self, job_id: str) -> Waiter | None:
        w = self.waiters.pop(job_id, None)
        if w is not None:
            self._index(w, -1)
            self.by_tenant[w.tenant] -= 1
            if self.by_tenant[w.tenant] <= 0:
                del self.by_tenant[w.tenant]
        return w

    def _index(self, w: Waiter, sign: int) -> None:
        if w.code == GLOBAL:
            self.n_global += sign
            return
        own = self.by_workload.setdefault(w.workload_key, {})
        if sign > 0:
            own[w.job_id] = w
        else:
            own.pop(w.job_id, None)
            if not own:
                del self.by_workload[w.workload_key]

    def ahead(
        self, job_id: str, key: tuple[int, float, float], lag: Callable[[Waiter], float]
    ) -> int:
        """Waiters for a global rollout slot, other than ``job_id``, whose admission
        key (``lag``: their tenant's) is lower than ``key``."""
        n = 0
        if not self.n_global:
            return 0
        for w in self.waiters.values():
            if w.code == GLOBAL and w.job_id != job_id:
                if admission_key(w.priority, lag(w), w.since) < key:
                    n += 1
        return n

    def position(self, job_id: str, lag: Callable[[Waiter], float]) -> int:
        """1 + the waiters served before ``job_id`` (0: not queued)."""
        w = self.waiters.get(job_id)
        if w is None:
            return 0
        if w.code == GLOBAL:
            return 1 + self.ahead(job_id, admission_key(w.priority, lag(w), w.since), lag)
        return 1 + list(self.by_workload[w.workload_key]).index(job_id)

    def first(self, n: int, lag: Callable[[Waiter], float]) -> list[str]:
        """The ``n`` waiters for a global rollout slot first in fair order."""
        if n <= 0 or not self.n_global:
            return []
        ws = [w for w in self.waiters.values() if w.code == GLOBAL]
        ws.sort(key=lambda w: admission_key(w.priority, lag(w), w.since))
        return [w.job_id for w in ws[:n]]

    def of_workload(self, key: str) -> list[str]:
        """The waiters of workload ``key`` for its own limits, in arrival order."""
        return list(self.by_workload.get(key, ()))

    def depth(self) -> dict[str, int]:
        """Waiting reserves per tenant."""
        return dict(self.by_tenant)


@dataclass
class FairBook(JobBook):
    """The job book with fair shares: the admission queue, each tenant's lag, the
    fair lease order (``next_ready``). ``SchedulerCore`` decides on top of it."""

    #: Reserves waiting for admission (``agents.admission``); not in the log.
    queue: AdmissionQueue = field(default_factory=AdmissionQueue)

    # ------------------------------------------------------------ fair shares
    def weight_of(self, tenant_id: str, workload: str) -> int:
        p = self.policies.get(f"{tenant_id}.{workload}")
        return p.weight if p is not None else 1

    def tenant_weight(self, tenant_id: str) -> int:
        """The tenant's weight (its quota's, on each of its policies)."""
        return max((p.weight for p in self.policies.values() if p.tenant_id == tenant_id),
                   default=1)

    def share_rows(self, now: float) -> list[TenantShare]:
        """Each tenant with jobs under way, waiting, or trained lately: its share of
        the trainer against its weighted fair share, and its queue depth."""
        tenants = {t for t in self.by_tenant_state if self.open_jobs(t)}
        tenants |= set(self.queue.by_tenant)
        tenants |= {t for t in self.fair.shares if self.fair.served(t, now) > 1e-6}
        weights = {t: float(self.tenant_weight(t)) for t in tenants}
        report = self.fair.report(weights, now)
        return [
            TenantShare(tenant_id=t, weight=int(weights[t]), share=round(report[t][0], 4),
                        fair_share=round(report[t][1], 4),
                        trainer_s=round(self.fair.trainer_s(t, now), 3),
                        queued=self.queue.by_tenant.get(t, 0))
            for t in sorted(tenants)
        ]

    def _admitted(self, job: TrainingJob, now: float) -> None:
        """A tenant's first job under way (it was idle): lift its virtual time to the
        least of the tenants under way (``FairShare.lift``)."""
        if self.open_jobs(job.tenant_id) > 1:
            return
        floor = min((self.fair.vt(t) for t in self.by_tenant_state
                     if t != job.tenant_id and self.open_jobs(t)), default=None)
        if floor is not None:
            self.fair.lift(job.tenant_id, floor, now)

    def replay_shares(self, latest: list[tuple[JobEvent, int]], *, now: float, wall: float) -> None:
        """Rebuild the fair shares from the last event of every job in the log (with its
        sequence), as the scheduler's rebuild reads them: the same charges, virtual
        times and lifts as before the restart (``fairshare.replay``). ``now``: the
        clock of lease times; ``wall``: the wall clock then (events carry wall time)."""
        past = []
        for event, seq in latest:
            job = event.job
            ended = job.state in TERMINAL_STATES
            policy = self.policies.get(f"{job.tenant_id}.{job.workload}")
            past.append(Past(
                tenant=job.tenant_id,
                admitted=job.created_seq or seq,  # a Reserved event: its own sequence
                ended=seq if ended else 0,
                rows=job.sample_count if job.state is S.COMPLETED else None,
                weight=policy.weight if policy is not None else 1,
                at=now - max(wall - event.at, 0.0),
            ))
        self.fair = replay(past, now, self.fair.half_life_s)

    def open_jobs(self, tenant_id: str) -> int:
        states = self.by_tenant_state.get(tenant_id)
        return sum(states[s] for s in OPEN_STATES) if states else 0

    def _now(self, now: float | None) -> float:
        return self.fair_clock if now is None else now

    @property
    def fair_clock(self) -> float:
        """The latest time a charge was made (``now`` when a caller gives none)."""
        return max((s.t for s in self.fair.shares.values()), default=0.0)

    def admission_lag(self, tenant_id: str, weight: int, now: float) -> float:
        """The tenant's lag key counting its jobs under way as served."""
        return self.fair.lag_key(tenant_id, weight, self.open_jobs(tenant_id), now)

    def _waiter_lag(self, now: float) -> Callable[[Waiter], float]:
        return lambda w: self.admission_lag(w.tenant, w.weight, now)

    def lease_lag(self, job: TrainingJob, now: float) -> float:
        """The job's tenant's lag key counting its leased jobs as served."""
        states = self.by_tenant_state.get(job.tenant_id)
        leased = states[S.LEASED.value] if states else 0
        return self.fair.lag_key(job.tenant_id, self.weight_of(job.tenant_id, job.workload),
                                 leased, now)

    def wait(self, req: ReserveRequest, code: Refusal | str, *, now: float) -> int:
        """Queue a refused reserve to wait (its position, 1 first), or 0: it may not
        wait (a final refusal, or its tenant's queue is full)."""
        policy = self.policies.get(f"{req.tenant_id}.{req.workload}")
        if policy is None or code not in WAITABLE:
            return 0
        w = Waiter(job_id=req.job_id, tenant=req.tenant_id, workload_key=policy.key,
                   priority=policy.priority, weight=policy.weight, code=code, since=now)
        if not self.queue.add(w):
            return 0
        return self.queue.position(req.job_id, self._waiter_lag(now))

    def first_waiters(self, n: int, *, now: float) -> list[str]:
        """The ``n`` reserves waiting for a global rollout slot first in fair order."""
        return self.queue.first(n, self._waiter_lag(now))

    def position(self, job_id: str, *, now: float) -> int:
        return self.queue.position(job_id, self._waiter_lag(now))

    def next_ready(
        self,
        consumer_role: str,
        skip: set[str] | frozenset[str] = frozenset(),
        *,
        now: float | None = None,
    ) -> TrainingJob | None:
        """The job lease_next would take (``fairshare.lease_key``): priority, then the
        tenant furthest behind its weighted share, then RL before SFT, then ready order."""
        tenants = self.ready.get(consumer_role)
        if not tenants:
            return None
        t = self._now(now)
        best: TrainingJob | None = None
        best_key: tuple[int, float, int, int] | None = None
        for tenant in list(tenants):
            job = self._top(tenants[tenant], skip)
            if job is None:
                if not tenants[tenant]:
                    del tenants[tenant]
                continue
            key = lease_key(job.priority, self.lease_lag(job, t), job.task_type, job.ready_seq)
            if best_key is None or key < best_key:
                best, best_key = job, key
        return best

    def _top(
        self, heap: list[tuple[tuple[int, int, int], str]], skip: set[str] | frozenset[str]
    ) -> TrainingJob | None:
        """A tenant's first ready job not in ``skip`` (dropping stale heap entries)."""
        skipped: list[tuple[tuple[int, int, int], str]] = []
        found: TrainingJob | None = None
        while heap:
            key, job_id = heap[0]
            job = self.jobs.get(job_id)
            if job is None or job.state is not S.READY or ready_key(job) != key:
                heapq.heappop(heap)  # lazily deleted entry
                continue
            if job_id in skip:
                skipped.append(heapq.heappop(heap))
                continue
            found = job
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def count_ready(self, consumer_role: str) -> int:
        return sum(
            1
            for heap in self.ready.get(consumer_role, {}).values()
            for _, job_id in heap
            if (j := self.jobs.get(job_id)) is not None and j.state is S.READY
        )



__all__ = ["MAX_WAITING_PER_TENANT", "WAITABLE", "AdmissionQueue", "FairBook", "Waiter"]
