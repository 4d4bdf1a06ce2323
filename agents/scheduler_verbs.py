"""The Training Scheduler's verbs: each request decided by the core, then appended.

:class:`SchedulerVerbs` answers every verb of the scheduler API (``REQUEST_TYPES``
says what each decodes): a verb that changes a job takes the job's lock, asks
:class:`~joynexus.agents.schedcore.SchedulerCore` for the event (or the job as it
is, for a retried call) and has the agent append it (:class:`Journal`); the
policy verbs write the tenants bucket (read back at start: ``load_policies``);
``lease_next`` and ``wait_for_ready`` long-poll on the ready events the agent
wakes. ``agents.scheduler`` serves them as the NATS micro service.

See docs/ARCHITECTURE.md, "The Training Scheduler: one decider, many callers".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, Protocol

from joynexus.agents.admission import WAITABLE
from joynexus.agents.schedcore import Refused, SchedulerCore
from joynexus.broker import kvwatch, slots
from joynexus.broker.subjects import GLOBAL_LIMITS_KEY, SCHEDULER_VERBS, VERSION_KEYS, Names
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import Conflict
from joynexus.schemas.jobs import GlobalLimits, JobEvent, JobState, TrainingJob, WorkloadPolicy
from joynexus.schemas.scheduler import (
    CompleteRequest,
    EndRequest,
    GetJobRequest,
    LeaseNextRequest,
    LeaseStageRequest,
    ListJobsRequest,
    MarkRequest,
    Reply,
    ReserveRequest,
    SchedulerSnapshot,
    SetLimitsRequest,
    SetPolicyRequest,
    SetVersionRequest,
    TouchRequest,
    WaitReadyRequest,
)

__all__ = ["LEASE_VERBS", "MAX_RESERVE_WAIT_S", "MAX_WAIT_S", "REQUEST_TYPES", "Journal", "SchedulerVerbs", "snapshot"]

#: The longest a long poll (``lease_next``, ``wait_for_ready``) waits.
MAX_WAIT_S = 25.0
#: The longest a reserve waits in the admission queue (one long poll; its producer
#: asks again, and sees its stop, after each).
MAX_RESERVE_WAIT_S = 10.0
#: Verbs whose reply holds a lease, and so says its TTL.
LEASE_VERBS = frozenset({"lease_stage", "lease_next", "touch"})

#: What each verb's request decodes to.
REQUEST_TYPES: dict[str, type[Any]] = {
    "reserve": ReserveRequest,
    "mark": MarkRequest,
    "lease_stage": LeaseStageRequest,
    "lease_next": LeaseNextRequest,
    "touch": TouchRequest,
    "complete": CompleteRequest,
    "drop": EndRequest,
    "fail": EndRequest,
    "set_policy": SetPolicyRequest,
    "set_limits": SetLimitsRequest,
    "set_version": SetVersionRequest,
    "wait_for_ready": WaitReadyRequest,
    "get_job": GetJobRequest,
    "list_jobs": ListJobsRequest,
    "snapshot": WaitReadyRequest,  # no fields needed; any empty object decodes
}
assert set(REQUEST_TYPES) == set(SCHEDULER_VERBS)


class Journal(Protocol):
    """What the verbs need of the agent: the core, per-job locks, and the append
    (apply, compare-and-append, commit or revert) of a decided event."""

    core: SchedulerCore

    def job_lock(self, job_id: str) -> AbstractAsyncContextManager[None]: ...

    def busy_jobs(self) -> set[str]: ...

    async def append(self, event: JobEvent) -> TrainingJob: ...


class SchedulerVerbs:
    """The scheduler API's verbs (``on_<verb>``), over a :class:`Journal`."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.core = journal.core
        #: The tenants bucket (policies, limits, version counters): ``load_policies``.
        self.kv: Any = None
        self.ready_events: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        #: Each waiting reserve's wake-up (``wake_admission`` sets the ones that may fit).
        self.waiter_events: dict[str, asyncio.Event] = {}
        self.lease_requests: dict[str, str] = {}

    async def load_policies(self, kv: Any) -> None:
        """Take the tenants bucket ``kv`` (which the policy verbs write) and load its
        policies, global limits and version counters into the core."""
        self.kv = kv
        # Every key: a part of them would start the scheduler without some tenants'
        # limits or version counters (nats-py's kv.keys() can stop short).
        keys = await kvwatch.keys(kv)
        for key in keys:
            entry = await kv.get(key)
            if key == GLOBAL_LIMITS_KEY:
                self.core.limits = decode(entry.value, GlobalLimits)
            elif key.startswith(VERSION_KEYS):
                _, tenant, workload = key.split(".", 2)
                self.core.versions[f"{tenant}.{workload}"] = int(entry.value)
            else:
                self.core.set_policy(decode(entry.value, WorkloadPolicy))

    def wake(self, role: str) -> None:
        """A job became ready for ``role``: answer its long polls."""
        ev = self.ready_events.pop(role, None)
        if ev is not None:
            ev.set()

    def wake_admission(self, key: str = "*", *, every: bool = False) -> None:
        """Capacity may have freed for workload ``key`` (its first waiting reserve, or
        ``every`` one: its end, a new policy, decides again) or, with "*", a global
        rollout slot (the waiters first in fair order, as many as slots are free):
        not all of them, each woken one decides again."""
        if key != "*":
            for job_id in self.core.queue.of_workload(key):
                ev = self.waiter_events.pop(job_id, None)  # None: woken already
                if ev is not None:
                    ev.set()
                    if not every:
                        return
            return
        free = self.core.limits.max_active_rollouts - self.core.active_rollouts["*"]
        for job_id in self.core.first_waiters(free, now=time.monotonic()):
            ev = self.waiter_events.pop(job_id, None)
            if ev is not None:
                ev.set()

    async def on_reserve(self, req: ReserveRequest) -> Reply:
        """Admit, or refuse; with ``wait_s``, a refusal that will lift waits in the
        admission queue (``agents.admission``) until admitted in fair order, or
        until the wait ends (the refusal, with the place it had)."""
        t0 = time.monotonic()
        deadline = t0 + min(max(req.wait_s, 0.0), MAX_RESERVE_WAIT_S)
        position, code = 0, ""
        try:
            while True:
                async with self.journal.job_lock(req.job_id):
                    now = time.monotonic()
                    decided = self.core.decide_reserve(req, at=time.time(), by=req.by, now=now)
                    if not isinstance(decided, Refused):
                        self._leave_queue(req.job_id)  # before the append: no slot counted twice
                        if isinstance(decided, TrainingJob):
                            return Reply(job=decided)
                        try:
                            job = await self.journal.append(decided)
                        except BaseException:
                            self.wake_admission()  # the slot it took is free again
                            raise
                        return Reply(job=job, position=position, waited_s=round(now - t0, 3))
                    if code and decided.code != code:  # woken for room it cannot take
                        self.wake_admission(wake_key(code, req))
                    code = decided.code
                    place = self.core.wait(req, code, now=now) if now < deadline else 0
                if not place:
                    return Reply(refused=self._not_queued(req, decided, now < deadline),
                                 refusal=decided.code, position=position,
                                 waited_s=round(now - t0, 3))
                position = place
                ev = self.waiter_events[req.job_id] = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    async with slots.waiting():  # a long poll holds no working slot
                        await asyncio.wait_for(ev.wait(), deadline - now)
        finally:
            self.waiter_events.pop(req.job_id, None)
            self._leave_queue(req.job_id)

    def _not_queued(self, req: ReserveRequest, decided: Refused, asked: bool) -> str:
        """The refusal's words; a reserve that asked to wait and found its tenant's
        queue full says so (it did not queue: ``position`` 0)."""
        q = self.core.queue
        if asked and decided.code in WAITABLE and req.job_id not in q.waiters:
            n = q.by_tenant.get(req.tenant_id, 0)
            if n >= q.per_tenant:
                return (f"{decided.reason}; not queued: tenant {req.tenant_id!r} already has "
                        f"{n} reserves waiting for admission (at most {q.per_tenant})")
        return decided.reason

    def _leave_queue(self, job_id: str) -> None:
        w = self.core.queue.remove(job_id)
        if w is not None and w.code == "global_rollouts" and self.core.queue.waiters:
            self.wake_admission()  # a place ahead of others is free

    async def on_mark(self, req: MarkRequest) -> Reply:
        async with self.journal.job_lock(req.job_id):
            decided = self.core.decide_mark(
                req.job_id,
                req.state,
                attempt=req.attempt,
                sample_count=req.sample_count,
                at=time.time(),
                by=req.by,
            )
            if isinstance(decided, TrainingJob):
                return Reply(job=decided)
            return Reply(job=await self.journal.append(decided))

    async def on_lease_stage(self, req: LeaseStageRequest) -> Reply:
        async with self.journal.job_lock(req.job_id):
            decided = self.core.decide_lease_stage(
                req.job_id, req.stage, now=time.monotonic(), at=time.time(), by=req.by
            )
            if isinstance(decided, TrainingJob):
                return Reply(job=decided)
            return Reply(job=await self.journal.append(decided))

    async def on_lease_next(self, req: LeaseNextRequest) -> Reply:
        if req.request_id:
            job_id = self.lease_requests.get(req.request_id)
            job = self.core.jobs.get(job_id) if job_id else None
            if job is not None and job.state is JobState.LEASED and job.holder == req.by:
                return Reply(job=job)
        deadline = time.monotonic() + min(max(req.wait_s, 0.0), MAX_WAIT_S)
        while True:
            busy = self.journal.busy_jobs()
            job = self.core.next_ready(req.consumer_role, busy, now=time.monotonic())
            if job is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return Reply(
                        refused=f"no ready job for {req.consumer_role!r}", refusal="no_ready"
                    )
                ev = self.ready_events[req.consumer_role]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ev.wait(), remaining)
                continue
            async with self.journal.job_lock(job.job_id):
                if self.core.jobs[job.job_id].state is not JobState.READY:
                    continue
                try:
                    leased = await self.journal.append(
                        self.core.decide_lease(job, at=time.time(), by=req.by)
                    )
                except Conflict:
                    continue
            if leased.state is JobState.LEASED:
                if req.request_id:
                    self.lease_requests[req.request_id] = leased.job_id
                    if len(self.lease_requests) > 10_000:
                        self.lease_requests.pop(next(iter(self.lease_requests)))
                return Reply(job=leased)
            # dropped as stale: look for the next one

    async def on_touch(self, req: TouchRequest) -> Reply:
        return Reply(job=self.core.touch(req.job_id, req.attempt, now=time.monotonic()))

    async def on_complete(self, req: CompleteRequest) -> Reply:
        async with self.journal.job_lock(req.job_id):
            decided = self.core.decide_complete(
                req.job_id, req.attempt, result_version=req.result_version, at=time.time(), by=req.by
            )
            if isinstance(decided, TrainingJob):
                return Reply(job=decided)
            return Reply(job=await self.journal.append(decided))

    async def end(self, req: EndRequest, kind: Literal["drop", "fail"]) -> Reply:
        async with self.journal.job_lock(req.job_id):
            decided = self.core.decide_end(
                req.job_id,
                kind,
                req.reason,
                attempt=req.attempt,
                at=time.time(),
                by=req.by,  # type: ignore[arg-type]
            )
            if isinstance(decided, TrainingJob):
                return Reply(job=decided)
            return Reply(job=await self.journal.append(decided))

    async def on_drop(self, req: EndRequest) -> Reply:
        return await self.end(req, "drop")

    async def on_fail(self, req: EndRequest) -> Reply:
        return await self.end(req, "fail")

    async def on_set_policy(self, req: SetPolicyRequest) -> Reply:
        if self.core.is_superseded(req.policy):
            return Reply()  # a late retry for a generation since replaced
        await self.kv.put(req.policy.key, encode(req.policy))
        self.core.set_policy(req.policy)
        self.wake_admission(req.policy.key, every=True)
        return Reply()

    async def on_set_limits(self, req: SetLimitsRequest) -> Reply:
        await self.kv.put(GLOBAL_LIMITS_KEY, encode(req.limits))
        self.core.limits = req.limits
        self.wake_admission()
        return Reply()

    async def on_set_version(self, req: SetVersionRequest) -> Reply:
        key = f"{req.tenant_id}.{req.workload}"
        version = max(self.core.versions.get(key, 0), req.version)
        await self.kv.put(Names.version_key(req.tenant_id, req.workload), str(version).encode())
        self.core.versions[key] = version
        return Reply(count=version)

    async def on_wait_for_ready(self, req: WaitReadyRequest) -> Reply:
        deadline = time.monotonic() + min(max(req.wait_s, 0.0), MAX_WAIT_S)
        while True:
            n = self.core.count_ready(req.consumer_role)
            remaining = deadline - time.monotonic()
            if n or remaining <= 0:
                return Reply(count=n)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready_events[req.consumer_role].wait(), remaining)

    async def on_get_job(self, req: GetJobRequest) -> Reply:
        return Reply(job=self.core.get(req.job_id))

    async def on_list_jobs(self, req: ListJobsRequest) -> Reply:
        """The tenant's jobs that match, in the order they were reserved; only the
        tenant's own are looked at (``jobs_of``), however many others hold."""
        states = set(req.states)
        jobs = [
            job
            for job in self.core.jobs_of(req.tenant_id)
            if (not req.workload or job.workload == req.workload)
            and (not req.generation or job.generation == req.generation)
            and (not states or job.state in states)
            and all(job.metadata.extra.get(k) == v for k, v in req.extra.items())
        ]
        jobs.sort(key=lambda j: (j.created_seq, j.job_id))
        return Reply(jobs=jobs)

    async def on_snapshot(self, _req: Any) -> Reply:
        return Reply(snapshot=snapshot(self.core))


def snapshot(c: SchedulerCore) -> SchedulerSnapshot:
    """What the ``snapshot`` verb answers: counts, policies, limits, versions, leases."""
    return SchedulerSnapshot(
        jobs_by_state={k: v for k, v in c.by_state.items() if v},
        jobs_by_tenant_state={
            t: {k: v for k, v in states.items() if v} for t, states in c.by_tenant_state.items()
        },
        policies=sorted(c.policies.values(), key=lambda p: p.key),
        limits=c.limits,
        versions=dict(c.versions),
        active_rollouts=c.active_rollouts["*"],
        leases=sum(1 for j in c.deadlines if j in c.jobs),
        last_seq=c.max_seq,
        shares=c.share_rows(time.monotonic()),
    )


def wake_key(code: str, req: ReserveRequest) -> str:
    """Whom a waiter's room belongs to: "*" (a global rollout slot) or its workload."""
    return "*" if code == "global_rollouts" else f"{req.tenant_id}.{req.workload}"
