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

from joynexus.agents.schedcore import Refused, SchedulerCore
from joynexus.broker import kvwatch
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

__all__ = ["LEASE_VERBS", "MAX_WAIT_S", "REQUEST_TYPES", "Journal", "SchedulerVerbs", "snapshot"]

#: The longest a long poll (``lease_next``, ``wait_for_ready``) waits.
MAX_WAIT_S = 25.0
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

    async def on_reserve(self, req: ReserveRequest) -> Reply:
        async with self.journal.job_lock(req.job_id):
            decided = self.core.decide_reserve(req, at=time.time(), by=req.by)
            if isinstance(decided, Refused):
                return Reply(refused=decided.reason, refusal=decided.code)
            if isinstance(decided, TrainingJob):
                return Reply(job=decided)
            return Reply(job=await self.journal.append(decided))

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
            job = self.core.next_ready(req.consumer_role, busy)
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
        return Reply()

    async def on_set_limits(self, req: SetLimitsRequest) -> Reply:
        await self.kv.put(GLOBAL_LIMITS_KEY, encode(req.limits))
        self.core.limits = req.limits
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
        states = set(req.states)
        return Reply(
            jobs=[
                job
                for job in self.core.jobs.values()
                if job.tenant_id == req.tenant_id
                and (not req.workload or job.workload == req.workload)
                and (not req.generation or job.generation == req.generation)
                and (not states or job.state in states)
            ]
        )

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
    )
