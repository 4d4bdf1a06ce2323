"""The agents' client of the Training Scheduler API.

Every verb is idempotent on the scheduler's side (reserve by job_id, marks
by target state, leases by holder or request_id, complete by attempt), so
this client retries a call that got no answer, until its deadline
(``broker.rpc.SCHEDULER``); errors the scheduler reports come back as the same
exception classes (by code). Lease replies carry the scheduler's lease TTL,
which the keep-alive (``agents.leases.keep_leases``) renews by.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from joynexus.broker import rpc, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import SCHEDULER_VERBS
from joynexus.schemas import jobs, scheduler
from joynexus.schemas.base import encode
from joynexus.schemas.errors import IllegalTransition, Unavailable, UnknownJob

#: How long a reserve made in this context waits in the admission queue when refused
#: (``reserve_until_admitted`` sets it around its ``attempt()``; 0: answer at once).
RESERVE_WAIT: contextvars.ContextVar[float] = contextvars.ContextVar("reserve_wait_s", default=0.0)


def new_job_id() -> str:
    return "j" + secrets.token_hex(10)


#: Each verb's reply decoder (an error reply raises its typed error).
_REPLY = {
    verb: rpc.checked(scheduler.Reply, f"scheduler reply to {verb}") for verb in SCHEDULER_VERBS
}


class SchedulerClient:
    def __init__(
        self, broker: Broker, *, by: str, call_timeout_s: float = 5.0, deadline_s: float = 60.0
    ) -> None:
        self.b = broker
        self.by = by
        self.call_timeout_s = call_timeout_s
        self.deadline_s = deadline_s
        self.retry = replace(rpc.SCHEDULER, deadline_s=deadline_s)
        #: The TTL of the scheduler's job leases, as its last lease reply said (replies
        #: of a scheduler that does not say keep the default): drives the keep-alive.
        self.lease_ttl_s = scheduler.DEFAULT_LEASE_TTL_S
        #: Why the last reserve was refused: in words, and as a ``Refusal`` code.
        self.last_refusal = ""
        self.last_refusal_code = ""
        #: The place the last reserve had in the scheduler's admission queue (0: none).
        self.last_position = 0

    async def _call(self, verb: str, req: Any, *, extra_wait: float = 0.0) -> scheduler.Reply:
        def unanswered(e: Unavailable) -> Unavailable:
            return Unavailable(
                f"scheduler did not answer {verb} within {self.deadline_s:.0f}s "
                f"({type(e.__cause__ or e).__name__}); is `joynexus agent scheduler` running?"
            )

        reply = await rpc.call(
            self.b,
            self.b.names.sched(verb),
            encode(req),
            _REPLY[verb],
            timeout_s=self.call_timeout_s + extra_wait,
            headers=tracing.inject(),
            retry=self.retry.within(extra_wait),
            unanswered=unanswered,
        )
        if reply.lease_ttl_s > 0:
            self.lease_ttl_s = reply.lease_ttl_s
        return reply

    # -- policies
    async def set_policy(self, policy: jobs.WorkloadPolicy) -> None:
        await self._call("set_policy", scheduler.SetPolicyRequest(policy=policy))

    async def set_limits(self, limits: jobs.GlobalLimits) -> None:
        await self._call("set_limits", scheduler.SetLimitsRequest(limits=limits))

    async def set_version(self, tenant_id: str, workload: str, version: int) -> int:
        r = await self._call(
            "set_version",
            scheduler.SetVersionRequest(tenant_id=tenant_id, workload=workload, version=version),
        )
        return r.count

    # -- the paper's API
    async def reserve(
        self,
        tenant_id: str,
        task_type: jobs.TaskType,
        *,
        workload: str = "default",
        generation: int = 1,
        domain: str = "",
        sample_count: int = 0,
        behavior_policy_version: int = 0,
        producer_role: str = "producer",
        consumer_role: str = "actor",
        metadata: jobs.JobMetadata | None = None,
        job_id: str | None = None,
        wait_s: float | None = None,
    ) -> jobs.TrainingJob | None:
        """Admit a new job, or None when admission refuses it: ``last_refusal`` then
        says why in words and ``last_refusal_code`` as a ``Refusal`` code (on the
        codes in ``FINAL_REFUSALS`` a producer stops, on the others it waits). A
        refusal that will lift first waits in the admission queue up to ``wait_s``
        (default: :data:`RESERVE_WAIT`, which ``reserve_until_admitted`` sets for its
        reserves); ``last_position`` is its place there."""
        self.last_refusal = self.last_refusal_code = ""
        self.last_position = 0
        r = await self.reserve_reply(
            tenant_id, task_type, workload=workload, generation=generation, domain=domain,
            sample_count=sample_count, behavior_policy_version=behavior_policy_version,
            producer_role=producer_role, consumer_role=consumer_role, metadata=metadata,
            job_id=job_id, wait_s=wait_s,
        )
        self.last_refusal, self.last_refusal_code = r.refused, r.refusal
        self.last_position = r.position
        return r.job

    async def reserve_reply(
        self,
        tenant_id: str,
        task_type: jobs.TaskType,
        *,
        workload: str = "default",
        generation: int = 1,
        domain: str = "",
        sample_count: int = 0,
        behavior_policy_version: int = 0,
        producer_role: str = "producer",
        consumer_role: str = "actor",
        metadata: jobs.JobMetadata | None = None,
        job_id: str | None = None,
        wait_s: float | None = None,
    ) -> scheduler.Reply:
        """:meth:`reserve`'s whole reply (the job, or the refusal with its code, place
        and wait), for callers that serve many reserves at once (the control plane):
        ``last_refusal`` is not touched."""
        wait = RESERVE_WAIT.get() if wait_s is None else wait_s
        req = scheduler.ReserveRequest(
            job_id=job_id or new_job_id(),
            tenant_id=tenant_id,
            task_type=task_type,
            workload=workload,
            generation=generation,
            domain=domain,
            sample_count=sample_count,
            behavior_policy_version=behavior_policy_version,
            producer_role=producer_role,
            consumer_role=consumer_role,
            metadata=metadata or jobs.JobMetadata(),
            by=self.by,
            wait_s=wait,
        )
        return await self._call("reserve", req, extra_wait=wait)

    async def mark(
        self, job_id: str, state: jobs.JobState, *, attempt: int = 0, sample_count: int | None = None
    ) -> jobs.TrainingJob:
        r = await self._call(
            "mark",
            scheduler.MarkRequest(
                job_id=job_id, state=state, attempt=attempt, sample_count=sample_count, by=self.by
            ),
        )
        assert r.job is not None
        return r.job

    async def lease_stage(self, job_id: str, stage: str) -> jobs.TrainingJob:
        r = await self._call(
            "lease_stage", scheduler.LeaseStageRequest(job_id=job_id, stage=stage, by=self.by)
        )
        assert r.job is not None
        return r.job

    async def lease_next(
        self, consumer_role: str = "actor", *, wait_s: float = 0.0
    ) -> jobs.TrainingJob | None:
        """The best ready job for this role (priority, RL first, FIFO), or None after ``wait_s``."""
        req = scheduler.LeaseNextRequest(
            consumer_role=consumer_role, by=self.by, wait_s=wait_s, request_id=secrets.token_hex(8)
        )
        r = await self._call("lease_next", req, extra_wait=wait_s)
        return r.job

    async def wait_for_ready(self, consumer_role: str = "actor", *, wait_s: float = 5.0) -> int:
        r = await self._call(
            "wait_for_ready",
            scheduler.WaitReadyRequest(consumer_role=consumer_role, wait_s=wait_s),
            extra_wait=wait_s,
        )
        return r.count

    async def touch(self, job: jobs.TrainingJob) -> jobs.TrainingJob:
        r = await self._call(
            "touch", scheduler.TouchRequest(job_id=job.job_id, attempt=job.attempt, by=self.by)
        )
        assert r.job is not None
        return r.job

    async def complete(self, job: jobs.TrainingJob, *, result_version: int | None = None) -> jobs.TrainingJob:
        r = await self._call(
            "complete",
            scheduler.CompleteRequest(
                job_id=job.job_id, attempt=job.attempt, result_version=result_version, by=self.by
            ),
        )
        assert r.job is not None
        return r.job

    async def drop(self, job_id: str, reason: str, *, attempt: int = 0) -> jobs.TrainingJob:
        r = await self._call(
            "drop", scheduler.EndRequest(job_id=job_id, reason=reason, attempt=attempt, by=self.by)
        )
        assert r.job is not None
        return r.job

    async def fail(self, job_id: str, reason: str, *, attempt: int = 0) -> jobs.TrainingJob:
        r = await self._call(
            "fail", scheduler.EndRequest(job_id=job_id, reason=reason, attempt=attempt, by=self.by)
        )
        assert r.job is not None
        return r.job

    async def get_job(self, job_id: str) -> jobs.TrainingJob:
        r = await self._call("get_job", scheduler.GetJobRequest(job_id=job_id))
        assert r.job is not None
        return r.job

    async def list_jobs(
        self,
        tenant_id: str,
        *,
        workload: str = "",
        generation: int = 0,
        states: list[jobs.JobState] | None = None,
        extra: dict[str, str] | None = None,
    ) -> list[jobs.TrainingJob]:
        """The tenant's jobs (of one workload, of one generation of it: 0 is any; with
        ``extra``, only those whose metadata's extra holds those items)."""
        r = await self._call(
            "list_jobs",
            scheduler.ListJobsRequest(
                tenant_id=tenant_id, workload=workload, generation=generation, states=states or [],
                extra=extra or {},
            ),
        )
        return r.jobs

    async def fail_open(
        self,
        tenant_id: str,
        workload: str,
        reason: str,
        *,
        states: tuple[jobs.JobState, ...] = (jobs.JobState.RESERVED, jobs.JobState.PRODUCING),
        owned: Callable[[jobs.TrainingJob], bool] = lambda _job: True,
        generation: int = 0,
    ) -> int:
        """Fail the jobs of a workload still in ``states`` that ``owned`` picks (a
        producer cleaning up after itself or after a dead worker); a job that
        ended meanwhile counts as done. Returns how many it failed; raises what
        the scheduler raised otherwise (the caller decides whether to retry)."""
        failed = 0
        listed = await self.list_jobs(
            tenant_id, workload=workload, generation=generation, states=list(states)
        )
        for job in listed:
            if not owned(job):
                continue
            try:
                await self.fail(job.job_id, reason)
                failed += 1
            except (IllegalTransition, UnknownJob):
                pass  # ended meanwhile: terminal either way
        return failed

    async def snapshot(self) -> scheduler.SchedulerSnapshot:
        r = await self._call("snapshot", scheduler.WaitReadyRequest())
        assert r.snapshot is not None
        return r.snapshot


# ---------------------------------------------------------------- waiting for admission
log = logging.getLogger(__name__)
T = TypeVar("T")

#: A wait for admission at least this long is logged (with the refusal that began it).
LOGGED_WAIT_S = 1.0
#: How long one reserve of ``reserve_until_admitted`` waits in the admission queue
#: (the longest a producer takes to see its stop while it waits there).
QUEUE_WAIT_S = 2.0


@dataclass(frozen=True)
class Backoff:
    """Waits between refused reservations: from ``first_s``, doubling to ``max_s``."""

    first_s: float = 0.05
    max_s: float = 1.0

    def next(self, wait_s: float) -> float:
        return min(wait_s * 2, self.max_s)


def ends_run(code: str, until_done: bool = True) -> bool:
    """Does a reservation refused with ``code`` end its producer's run? Only when the
    workload's generation ended (its completion target met) or was replaced, and the
    producer runs until done; every other refusal (limits on jobs at once, the last
    jobs of the target still in flight, one of which may fail) is waited out."""
    return until_done and code in scheduler.FINAL_REFUSALS


async def reserve_until_admitted(
    sched: SchedulerClient,
    attempt: Callable[[], Awaitable[T | None]],
    stop: asyncio.Event,
    *,
    backoff: Backoff = Backoff(),
    until_done: bool = True,
    who: str = "",
    queue_wait_s: float = QUEUE_WAIT_S,
) -> T | None:
    """``attempt()`` (one ``sched.reserve``, and whatever goes with it) until it
    admits. Each reserve waits in the scheduler's admission queue (up to
    ``queue_wait_s``, a long poll; admitted in fair order, :mod:`agents.admission`)
    and is asked again at once after a wait there; a refusal that did not queue
    (its tenant's queue full, a scheduler without one) is waited out ``backoff``
    apart, the wait cut short by ``stop``. None when stopped, or when a refusal
    ends the run (:func:`ends_run`; ``stop.is_set()`` tells the two apart). A wait
    of :data:`LOGGED_WAIT_S` or more is logged once it is over, with the refusal
    that began it. The producers' (SFT, RL, synthetic) one admission loop."""
    wait_s = backoff.first_s
    since: float | None = None
    first_refusal = ""
    token = RESERVE_WAIT.set(queue_wait_s)
    try:
        while not stop.is_set():
            got = await attempt()
            if got is not None:
                if since is not None and (waited := time.perf_counter() - since) >= LOGGED_WAIT_S:
                    log.info("%s: admitted after waiting %.1f s (%s)", who, waited, first_refusal)
                return got
            if ends_run(sched.last_refusal_code, until_done):
                log.info("%s: %s; its producer stops", who, sched.last_refusal)
                return None
            if since is None:
                since, first_refusal = time.perf_counter(), sched.last_refusal
            if sched.last_position and queue_wait_s:
                continue  # it waited in the queue: ask again at once, keeping its turn
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait_s)
            wait_s = backoff.next(wait_s)
    finally:
        RESERVE_WAIT.reset(token)
    return None
