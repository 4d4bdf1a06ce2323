"""The world the capacity planner simulates: the plan (:class:`DeploymentPlan`,
its :class:`TenantSpec` s) and the :class:`Costs` it is run with, the
discrete-event loop (:class:`Sim`, processes as generators, :class:`Signal`), and
the services around the real scheduler core: :class:`SimScheduler` (the
:class:`SchedulerCore` as the agent drives it, each decision costing time) and
:class:`Inference` (engines with adaptive batching). ops/plan/sim.py runs a
window in it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass
from typing import Any

from joynexus.agents.lifecycle import ROLLOUT_STATES
from joynexus.agents.schedcore import Refused, SchedulerCore
from joynexus.schemas.jobs import (
    Dropped,
    GlobalLimits,
    JobEvent,
    JobState,
    Leased,
    TrainingJob,
    WorkloadPolicy,
)
from joynexus.schemas.scheduler import ReserveRequest

S = JobState


@dataclass
class Costs:
    """Seconds per operation (fitted from a run, or of the paper's order)."""

    train_step_s: float = 0.03
    train_per_job_s: float = 0.0
    train_per_row_s: float = 0.0
    actor_overhead_s: float = 0.02
    infer_batch_s: float = 0.008
    infer_per_row_s: float = 0.0
    infer_rpc_s: float = 0.0
    batcher_s: float = 0.0
    sim_per_call_s: float = 0.17
    #: Extra simulator seconds per call for each other rollout running at the same
    #: time (environment workers sharing cores, as on a CPU machine; 0 on accelerators).
    sim_contention_s: float = 0.0
    rollout_overhead_s: float = 0.0
    advantages_s: float = 0.01
    sft_produce_s: float = 0.08
    #: Relative spread (uniform +-) of every cost (0: every operation takes its mean).
    jitter: float = 0.0
    sched_decisions_per_s: float = 0.0  # 0: decisions take no time

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        known = {k: float(v) for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class TenantSpec:
    name: str
    task: str = "rl"  # rl | sft
    updates: int = 10
    workers: int = 1
    max_in_flight: int = 2
    max_active_rollouts: int = 1
    max_policy_staleness: int | None = 2
    num_envs: int = 2
    horizon: int = 8
    action_horizon: int = 2
    sft_batch: int = 16
    startup_s: float = 0.0
    priority: int = 0
    #: The tenant's share weight (its quota's ``share_weight``).
    weight: int = 1

    @property
    def calls(self) -> int:
        return max(1, math.ceil(self.horizon / max(1, self.action_horizon)))

    @property
    def rows(self) -> int:
        return self.num_envs * self.horizon if self.task == "rl" else self.sft_batch


@dataclass
class DeploymentPlan:
    tenants: list[TenantSpec]
    trainers: int = 1
    max_group: int = 4
    engines: int = 1
    max_batch: int = 128
    max_wait_s: float = 0.005
    #: Rows per training microbatch (0: a group is one step whatever its rows).
    microbatch: int = 0
    global_max_active_rollouts: int = 3
    poll_s: float = 0.5
    #: Stop at this simulated time even if tenants have not finished (0: no limit).
    horizon_s: float = 0.0
    seed: int = 0
    #: Refused reserves wait in the scheduler's admission queue (the service's
    #: producers); False: they poll with backoff (before issue 29).
    queued_admission: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeploymentPlan:
        tenants = [TenantSpec(**t) for t in d.get("tenants", [])]
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "tenants"}
        return cls(tenants=tenants, **kw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- the event loop

Proc = Generator[Any, Any, None]


class Signal:
    """Something processes wait for (``yield signal``); ``fire`` wakes them all."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.waiters: list[Proc] = []
        self.value: Any = None
        self.fired = False

    def fire(self, value: Any = None) -> None:
        self.fired, self.value = True, value
        waiters, self.waiters = self.waiters, []
        for p in waiters:
            self.sim.resume(p, value)


class Sim:
    def __init__(self, seed: int = 0) -> None:
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0
        self.rng = random.Random(seed)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._q, (t, self._n, fn))

    def start(self, proc: Proc) -> None:
        self.resume(proc, None)

    def resume(self, proc: Proc, value: Any) -> None:
        self.at(self.now, lambda: self._step(proc, value))

    def _step(self, proc: Proc, value: Any) -> None:
        try:
            cmd = proc.send(value)
        except StopIteration:
            return
        if isinstance(cmd, Signal):
            if cmd.fired:
                self.resume(proc, cmd.value)
            else:
                cmd.waiters.append(proc)
        else:
            self.at(self.now + max(0.0, float(cmd)), lambda: self._step(proc, None))

    def run(self, until: Callable[[], bool], limit_s: float = 0.0) -> None:
        while self._q and not until():
            t, _, fn = heapq.heappop(self._q)
            if limit_s and t > limit_s:
                self.now = limit_s
                return
            self.now = t
            fn()


# ---------------------------------------------------------------- the scheduler


class SimScheduler:
    """The real core, driven as ``agents.scheduler.SchedulerAgent`` drives it."""

    def __init__(self, sim: Sim, costs: Costs, limits: GlobalLimits) -> None:
        self.sim = sim
        self.core = SchedulerCore(lease_ttl_s=1e12, limits=limits)
        self.seq = 0
        self.decisions = 0
        self.busy_s = 0.0
        self._free_at = 0.0
        self.service_s = 1.0 / costs.sched_decisions_per_s if costs.sched_decisions_per_s else 0.0
        self.ready = Signal(sim)
        self.history: dict[str, dict[str, float]] = defaultdict(dict)
        self.drops: Counter[str] = Counter()
        self.refusals = 0
        self._ids = 0
        #: Waiting reserves' wake-ups: per job (a global rollout slot), per workload.
        self.slot_waits: dict[str, Signal] = {}
        self.own_waits: dict[str, Signal] = {}

    def delay(self) -> float:
        """Time until a request sent now is decided (the scheduler decides one at a time)."""
        if not self.service_s:
            return 0.0
        start = max(self.sim.now, self._free_at)
        self._free_at = start + self.service_s
        self.busy_s += self.service_s
        return self._free_at - self.sim.now

    def _append(self, ev: JobEvent) -> TrainingJob:
        now = self.sim.now
        self.core.apply(ev, now)
        self.seq += 1
        job = self.core.commit(ev.job.job_id, self.seq)
        self.decisions += 1
        self.history[job.job_id].setdefault(job.state.value, now)
        if job.state is S.READY:
            ready, self.ready = self.ready, Signal(self.sim)
            ready.fire()
        if job.state not in ROLLOUT_STATES and self.core.queue.waiters:
            self._wake(f"{job.tenant_id}.{job.workload}")
        return job

    def _wake(self, key: str) -> None:
        """As the agent's ``wake_admission``: the workload's waiters, and the waiters
        first in fair order for the free global rollout slots."""
        sig = self.own_waits.pop(key, None)
        if sig is not None:
            sig.fire()
        free = self.core.limits.max_active_rollouts - self.core.active_rollouts["*"]
        for job_id in self.core.first_waiters(free, now=self.sim.now):
            sig = self.slot_waits.pop(job_id, None)
            if sig is not None:
                sig.fire()

    def wait(self, job_id: str, tenant: str, task: str, code: str) -> Signal | None:
        """Queue a refused reserve (None: it may not wait); the signal it waits for."""
        req = ReserveRequest(job_id=job_id, tenant_id=tenant, task_type=task,  # type: ignore[arg-type]
                             workload=task)
        old = self.core.queue.waiters.get(job_id)
        queued = self.core.wait(req, code, now=self.sim.now)
        if old is not None and old.code == "global_rollouts" and code != old.code:
            self._wake("")  # it was woken for a slot it cannot take
        if not queued:
            return None
        if code == "global_rollouts":
            sig = self.slot_waits[job_id] = Signal(self.sim)
            return sig
        key = f"{tenant}.{task}"
        if key not in self.own_waits:
            self.own_waits[key] = Signal(self.sim)
        return self.own_waits[key]

    def leave(self, job_id: str) -> None:
        self.slot_waits.pop(job_id, None)
        if self.core.queue.remove(job_id) is not None and self.core.queue.waiters:
            self._wake("")

    def set_policy(self, p: WorkloadPolicy) -> None:
        self.core.policies[p.key] = p

    def new_id(self) -> str:
        self._ids += 1
        return f"j{self._ids}"

    def reserve(
        self, tenant: str, task: str, version: int, rows: int, job_id: str = ""
    ) -> TrainingJob | Refused:
        req = ReserveRequest(job_id=job_id or self.new_id(), tenant_id=tenant,
                             task_type=task, workload=task,  # type: ignore[arg-type]
                             sample_count=rows, behavior_policy_version=version)
        decided = self.core.decide_reserve(req, at=self.sim.now, by="sim", now=self.sim.now)
        self.decisions += 1
        if isinstance(decided, Refused):
            self.refusals += 1
            return decided
        self.leave(req.job_id)
        if isinstance(decided, TrainingJob):
            return decided
        return self._append(decided)

    def mark(self, job_id: str, state: JobState) -> TrainingJob:
        ev = self.core.decide_mark(job_id, state, attempt=0, sample_count=None,
                                   at=self.sim.now, by="sim")
        return ev if isinstance(ev, TrainingJob) else self._append(ev)

    def lease_stage(self, job_id: str, stage: str) -> TrainingJob:
        ev = self.core.decide_lease_stage(job_id, stage, now=self.sim.now, at=self.sim.now, by="sim")
        return ev if isinstance(ev, TrainingJob) else self._append(ev)

    def mark_stage_done(self, job: TrainingJob, state: JobState) -> TrainingJob:
        ev = self.core.decide_mark(job.job_id, state, attempt=job.attempt, sample_count=None,
                                   at=self.sim.now, by="sim")
        return ev if isinstance(ev, TrainingJob) else self._append(ev)

    def lease_next(self, skip: set[str]) -> TrainingJob | None:
        """The next job in lease order (ready RL before SFT, then FIFO), dropping stale ones."""
        while True:
            job = self.core.next_ready("actor", skip, now=self.sim.now)
            if job is None:
                return None
            ev = self.core.decide_lease(job, at=self.sim.now, by="sim")
            leased = self._append(ev)
            if isinstance(ev, Dropped):
                self.drops[job.tenant_id] += 1
                continue
            assert isinstance(ev, Leased)
            return leased

    def complete(self, job: TrainingJob, version: int) -> None:
        ev = self.core.decide_complete(job.job_id, job.attempt, result_version=version,
                                       at=self.sim.now, by="sim")
        if not isinstance(ev, TrainingJob):
            self._append(ev)


# ---------------------------------------------------------------- the services


@dataclass
class Request:
    tenant: str
    rows: int
    at: float
    done: Signal


class Inference:
    """Engines with adaptive batching (cap ``max_batch`` rows, ``max_wait_s``)."""

    def __init__(self, sim: Sim, dep: DeploymentPlan, costs: Costs, jit: Callable[[float], float]):
        self.sim, self.dep, self.costs, self.jit = sim, dep, costs, jit
        self.queue: list[Request] = []
        self.idle = dep.engines
        self.intervals: list[tuple[float, float]] = []
        self.batches: list[tuple[int, int]] = []  # (tenants, requests)
        self.rows_by_tenant: Counter[str] = Counter()
        self.busy_by_tenant: defaultdict[str, float] = defaultdict(float)
        self._batcher_free = 0.0
        self.batcher_busy_s = 0.0
        self._waiting_engine = False

    def submit(self, tenant: str, rows: int) -> Signal:
        done = Signal(self.sim)
        prep = 0.0
        if self.costs.batcher_s:  # the batcher prepares requests one at a time
            start = max(self.sim.now, self._batcher_free)
            self._batcher_free = start + self.costs.batcher_s
            self.batcher_busy_s += self.costs.batcher_s
            prep = self._batcher_free - self.sim.now
        req = Request(tenant, rows, self.sim.now, done)
        self.sim.at(self.sim.now + prep + self.costs.infer_rpc_s / 2, lambda: self._arrive(req))
        return done

    def _arrive(self, req: Request) -> None:
        self.queue.append(req)
        if self.idle and not self._waiting_engine:
            self._dispatch()

    def _take(self) -> list[Request]:
        batch: list[Request] = []
        rows = 0
        while self.queue and (not batch or rows + self.queue[0].rows <= self.dep.max_batch):
            r = self.queue.pop(0)
            batch.append(r)
            rows += r.rows
        return batch

    def _dispatch(self) -> None:
        if not self.idle or not self.queue:
            return
        self.idle -= 1
        self._run(self._take())

    def _run(self, batch: list[Request]) -> None:
        rows = sum(r.rows for r in batch)
        d = self.jit(self.costs.infer_batch_s + self.costs.infer_per_row_s * rows)
        t0 = self.sim.now
        self.intervals.append((t0, t0 + d))
        self.batches.append((len({r.tenant for r in batch}), len(batch)))
        for r in batch:
            self.rows_by_tenant[r.tenant] += r.rows
            self.busy_by_tenant[r.tenant] += d * r.rows / rows

        def finish() -> None:
            for r in batch:
                self.sim.at(self.sim.now + self.costs.infer_rpc_s / 2, r.done.fire)
            self._freed()

        self.sim.at(t0 + d, finish)

    def _freed(self) -> None:
        if not self.queue:
            self.idle += 1
            return
        rows = sum(r.rows for r in self.queue)
        if rows >= self.dep.max_batch or not self.dep.max_wait_s:
            self._run(self._take())
            return
        # Under load a freed engine waits for company (up to max_wait_s from now).
        self._waiting_engine = True

        def go() -> None:
            self._waiting_engine = False
            if self.queue:
                self._run(self._take())
            else:
                self.idle += 1

        self.sim.at(self.sim.now + self.dep.max_wait_s, go)
