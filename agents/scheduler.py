"""The Training Scheduler agent: the single decider of admission and leases.

It owns no state of its own: on start it rebuilds :class:`SchedulerCore`
from the job event log (the last event of every job) and the tenant
policies bucket, then serves the scheduler API as the NATS micro service
``<ns>-sched`` on ``<ns>.sched.<verb>``. Each request is decided in memory
(pure core), applied optimistically, appended to the log with
compare-and-append, then committed (or reverted if the append failed).
Appends for one job are serialized by a per-job lock; different jobs are
appended concurrently, so throughput is not bound by one round trip.

Besides requests it runs three loops: actor-lease expiry, a consumer of
JetStream max-deliveries advisories (jobs whose stage message failed too
often are failed, with the reason), and a sweep that clears Training Queue
partitions of terminal or unknown jobs (cleanup after a crash). The verbs
themselves, and the tenants bucket they keep, are ``agents.scheduler_verbs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from nats.js.api import AckPolicy, ConsumerConfig
from nats.micro import add_service
from nats.micro.request import Request

from joynexus.agents.leases import Deposed, RoleLease
from joynexus.agents.lifecycle import ROLLOUT_STATES
from joynexus.agents.schedcore import SchedulerCore
from joynexus.agents.scheduler_verbs import LEASE_VERBS, REQUEST_TYPES, SchedulerVerbs, snapshot
from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.broker.eventlog import Fenced, JobEventLog, new_op_id
from joynexus.broker.fastpath import sync_server
from joynexus.broker.layout import LayoutOptions, ensure_layout
from joynexus.broker.responder import Server
from joynexus.broker.subjects import SCHEDULER_VERBS
from joynexus.broker.tasks import cancel_and_wait
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.base import decode
from joynexus.schemas.errors import Conflict, JoyNexusError, Unavailable
from joynexus.schemas.jobs import (
    STAGES,
    TERMINAL_STATES,
    Failed,
    JobEvent,
    JobState,
    TrainingJob,
    WorkloadEnded,
)
from joynexus.schemas.scheduler import EndRequest, ErrorBody, Reply, SchedulerSnapshot

log = logging.getLogger(__name__)

#: Requests served at once (long polls included); past it ``rate_limited``, which
#: the scheduler's clients retry.
MAX_IN_FLIGHT = 10_000


class SchedulerAgent:
    def __init__(
        self,
        broker: Broker,
        *,
        instance: str = "sched-0",
        lease_ttl_s: float = 30.0,
        expire_every_s: float = 0.5,
        sweep_every_s: float = 30.0,
        keep_terminal: int = 100_000,
        layout: LayoutOptions | None = None,
        lease: RoleLease | None = None,
    ) -> None:
        self.b = broker
        #: With several hosts: serve only while holding this lease (``agents.leases``);
        #: admissions are fenced by its epoch. None: the only scheduler (one host).
        self.lease = lease
        #: Set when the lease was lost to another host's scheduler: stop and exit.
        self.deposed = asyncio.Event()
        self._stopping = asyncio.Event()
        self.n = broker.names
        self.instance = instance
        self.core = SchedulerCore(lease_ttl_s=lease_ttl_s)
        self.log = JobEventLog(broker)
        self.tq = TrainingQueue(broker)
        self.expire_every_s = expire_every_s
        self.sweep_every_s = sweep_every_s
        self.keep_terminal = keep_terminal
        self.layout = layout or LayoutOptions()
        self._locks: dict[str, asyncio.Lock] = {}
        self.verbs = SchedulerVerbs(self)
        # One workload end decided and appended at a time (decide, note, append).
        self._end_lock = asyncio.Lock()
        # Requests are answered by the rpc layer (agents' subjects: no reply check).
        self.rpc = Server(
            broker,
            "scheduler",
            error_reply=lambda code, message: Reply(error=ErrorBody(code=code, message=message)),
            clip=None,
            internal="internal error: {error}",
            total=MAX_IN_FLIGHT,
        )
        self._loops: list[asyncio.Task[Any]] = []
        self._service: Any = None
        self.rebuild_stats: dict[str, float] = {}

    # ------------------------------------------------------------ lifecycle
    async def stand_by(self, stop: asyncio.Event) -> bool:
        """Wait until this scheduler holds the lease (True; at once without one), or
        ``stop`` (False). Call before :meth:`start`."""
        if self.lease is None:
            return True
        await ensure_layout(self.b, self.layout)
        said: list[str] = []

        def waiting(rec: Any) -> None:
            if rec.holder not in said:
                said.append(rec.holder)
                log.info("scheduler %s standing by: %s holds the lease", self.instance, rec.holder)

        return await self.lease.acquire(stop, on_wait=waiting)

    async def start(self) -> None:
        await ensure_layout(self.b, self.layout)
        if self.lease is not None and not self.lease.epoch_seq:
            raise RuntimeError("SchedulerAgent.start() before stand_by() acquired the lease")
        await self.verbs.load_policies(await self.b.js.key_value(self.n.tenants_bucket))
        await self.rebuild()
        self.rpc.spawn(self._append_due_ends())
        self._service = await add_service(
            self.b.nc,
            name=self.n.scheduler_service,
            version="0.1.0",
            description="JoyNexus Training Scheduler: admission, stage and actor leases",
            metadata={"instance": self.instance},
        )
        for verb in SCHEDULER_VERBS:
            await self._service.add_endpoint(
                name=verb, subject=self.n.sched(verb), handler=self._handler(verb)
            )
        await sync_server(self.b.nc)  # on the server before start() returns
        self._loops = [
            asyncio.create_task(self._expiry_loop(), name="sched-expiry"),
            asyncio.create_task(self._advisory_loop(), name="sched-advisories"),
            asyncio.create_task(self._sweep_loop(), name="sched-sweep"),
        ]
        if self.lease is not None:
            self._loops.append(
                asyncio.create_task(self.lease.keep(self._stopping, self._lost), name="sched-lease")
            )
        log.info("scheduler %s serving %d jobs", self.instance, len(self.core.jobs))

    async def _lost(self, e: Exception) -> None:
        """Another host's scheduler holds the lease now: stop answering at once."""
        log.error("scheduler %s deposed: %s", self.instance, e)
        self.deposed.set()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()

    async def stop(self) -> None:
        self._stopping.set()
        for t in self._loops:
            t.cancel()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        await cancel_and_wait(*self._loops)
        await self.rpc.stop()

    async def rebuild(self) -> None:
        """Replay the last event of every job from the log into a fresh core."""
        t0 = time.perf_counter()
        now = time.monotonic()
        latest, bad = await self.log.latest_per_job()
        for stored in latest:
            self.core.load(stored.event, stored.seq, now)
        # The fair order as it was: charges and lifts replayed in log order.
        self.core.replay_shares([(s.event, s.seq) for s in latest], now=now, wall=time.time())
        ends = await self.log.workload_ends()
        for end in ends:
            self.core.note_ended(end)
        self.core.prune_terminal(self.keep_terminal)
        self.rebuild_stats = {
            "jobs": len(latest),
            "workload_ends": len(ends),
            "skipped_malformed": len(bad),
            "seconds": time.perf_counter() - t0,
        }
        if bad:
            log.warning("rebuild skipped %d malformed job events (first: %s)", len(bad), bad[0])

    # ------------------------------------------------------------ plumbing
    def _handler(self, verb: str) -> Callable[[Request], Awaitable[None]]:
        typ = REQUEST_TYPES[verb]
        method: Callable[[Any], Awaitable[Reply]] = getattr(self.verbs, f"on_{verb}")
        span = f"scheduler.{typ.__name__}"
        # A lease reply says how long the lease lasts untouched (the keep-alive's period).
        ttl = self.core.lease_ttl_s if verb in LEASE_VERBS else 0.0

        async def handle(request: Request) -> Reply:
            reply = await method(decode(request.data or b"{}", typ, what=typ.__name__))
            if ttl and reply.job is not None:
                reply.lease_ttl_s = ttl
            return reply

        async def on_request(request: Request) -> None:
            # The events this request appends carry the caller's trace, if it has one.
            self.rpc.serve(request, lambda: handle(request), span=span, traced_only=True)

        return on_request

    @contextlib.asynccontextmanager
    async def job_lock(self, job_id: str) -> AsyncIterator[None]:
        """Serialise the appends of one job (different jobs append concurrently)."""
        lock = self._locks.get(job_id)
        if lock is None:
            lock = self._locks[job_id] = asyncio.Lock()
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not getattr(lock, "_waiters", None):
                self._locks.pop(job_id, None)

    def busy_jobs(self) -> set[str]:
        """Jobs whose lock is held now (a lease skips them)."""
        return {j for j, lock in self._locks.items() if lock.locked()}

    async def append(self, event: JobEvent) -> TrainingJob:
        """Apply, append with compare-and-append, commit (or revert). Caller holds the job lock."""
        now = time.monotonic()
        job_id = event.job.job_id
        expected = self.core.last_seq.get(job_id, 0)
        prev = self.core.apply(event, now)
        try:
            appended = await self._append_fenced(event, expected)
        except BaseException as e:
            self.core.revert(job_id, prev, now)
            if isinstance(e, Conflict):
                await self._reload(job_id)
            if isinstance(e, (Conflict, asyncio.CancelledError)):
                raise
            raise Unavailable(
                f"could not append {event.job.state.value} for job {job_id}: {e}"
            ) from e
        job = self.core.commit(job_id, appended.seq)
        if job.state is JobState.READY:
            self.verbs.wake(job.consumer_role)
        if job.state not in ROLLOUT_STATES and self.core.queue.waiters:
            # Maybe a rollout slot, a job in flight or the completion target freed.
            self.verbs.wake_admission(f"{job.tenant_id}.{job.workload}")
            if job.task_type == "rl" and self.core.queue.n_global:
                self.verbs.wake_admission()
        for tenant, partition in self.core.effects_of(job).clear_partitions:
            self.rpc.spawn(self._clear_partition(tenant, partition))
        if job.state in TERMINAL_STATES:  # maybe the last job of its workload
            self.rpc.spawn(self._end_workload(job.tenant_id, job.workload))
        return job

    async def _end_workload(self, tenant_id: str, workload: str) -> WorkloadEnded | None:
        """Append the workload's end if it is due (see ``decide_workload_end``). Noted
        before the append, so no reserve is admitted while it is written; forgotten
        again if the append fails (the sweep tries again)."""
        async with self._end_lock:
            end = self.core.decide_workload_end(tenant_id, workload, at=self._at(), by=self.instance)
            if end is None:
                return None
            prev = self.core.note_ended(end)
            try:
                await self.log.append_workload_end(end)
            except Exception as e:
                self.core.forget_ended(end, prev)
                raise_if_cancelled()
                log.warning("ending workload %s/%s failed (retried by the sweep): %s",
                            tenant_id, workload, e)
                return None
        log.info("workload %s/%s generation %d %s: %s",
                 tenant_id, workload, end.generation, end.state, end.reason)
        self.verbs.wake_admission(f"{tenant_id}.{workload}", every=True)  # its waiters: ended
        return end

    async def _append_due_ends(self) -> int:
        """End every workload whose end is due but not in the log (a restart)."""
        n = 0
        for end in self.core.pending_ends(at=self._at(), by=self.instance):
            if await self._end_workload(end.tenant_id, end.workload) is not None:
                n += 1
        return n

    async def _append_fenced(self, event: JobEvent, expected: int) -> Any:
        """A new job's first event (an admission) carries the lease's fence."""
        op_id = new_op_id()
        if self.lease is None or expected != 0:
            return await self.log.append(event, expected_last_seq=expected, op_id=op_id)
        fence = (self.n.lease_epoch(self.lease.role), self.lease.epoch_seq)
        try:
            return await self.log.append(event, expected_last_seq=0, op_id=op_id, fence=fence)
        except Fenced:
            # Deposed, or our epoch message aged out of the stream: the lease says which.
            try:
                await self.lease.renew()
            except Deposed as d:
                await self._lost(d)
                raise Unavailable(
                    f"scheduler {self.instance} no longer holds the lease; retry (the new "
                    "holder answers)"
                ) from d
            await self.lease.write_epoch()
            fence = (self.n.lease_epoch(self.lease.role), self.lease.epoch_seq)
            return await self.log.append(event, expected_last_seq=0, op_id=op_id, fence=fence)

    async def _reload(self, job_id: str) -> None:
        """Someone else moved the job: take the log's word for it."""
        job = self.core.jobs.get(job_id)
        if job is None:
            return
        stored = await self.log.last(job.tenant_id, job_id)
        if stored is not None:
            self.core.load(stored.event, stored.seq, time.monotonic())

    async def _clear_partition(self, tenant_id: str, partition_id: str) -> None:
        try:
            await self.tq.async_clear_partition(tenant_id, partition_id)
        except Exception as e:  # the sweep retries later
            log.warning("clearing partition %s/%s failed: %s", tenant_id, partition_id, e)

    @staticmethod
    def _at() -> float:
        return time.time()

    def snapshot(self) -> SchedulerSnapshot:
        return snapshot(self.core)

    # ------------------------------------------------------------ loops
    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.expire_every_s)
            now = time.monotonic()
            for ev in self.core.decide_expiries(now=now, at=self._at(), by=self.instance):
                job_id = ev.job.job_id
                async with self.job_lock(job_id):
                    fresh = self.core.decide_expiries(
                        now=time.monotonic(), at=self._at(), by=self.instance
                    )
                    mine = [e for e in fresh if e.job.job_id == job_id]
                    if not mine:
                        continue  # touched or completed meanwhile
                    try:
                        await self.append(mine[0])
                        if isinstance(mine[0], Failed):
                            log.warning("job %s failed: %s", job_id, mine[0].job.reason)
                        else:
                            log.info("lease %d of job %s expired", ev.job.attempt, job_id)
                    except JoyNexusError as e:
                        log.warning("expiring lease of %s failed: %s", job_id, e)

    async def _advisory_loop(self) -> None:
        """Fail jobs whose stage message JetStream gave up redelivering."""
        sub = await self.b.js.pull_subscribe(
            self.n.max_deliveries_advisories,
            durable="scheduler",
            stream=self.n.advisories_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_deliver=5, ack_wait=30),
        )
        while True:
            raise_if_cancelled()  # a cancel swallowed inside fetch (asyncio.wait_for, 3.11)
            try:
                msgs = await sub.fetch(16, timeout=5.0)
            except TimeoutError:
                continue
            except Exception as e:
                raise_if_cancelled()
                log.warning("advisory fetch failed: %s", e)
                await asyncio.sleep(1.0)
                continue
            for m in msgs:
                try:
                    await self._on_max_deliveries(orjson.loads(m.data))
                except Exception as e:
                    log.warning("advisory %s not handled: %s", m.subject, e)
                await m.ack()

    async def _on_max_deliveries(self, adv: dict[str, Any]) -> None:
        raw = await self.b.js.get_msg(self.n.jobs_stream, seq=int(adv["stream_seq"]))
        event: JobEvent = decode(raw.data or b"", JobEvent, what="job event")  # type: ignore[arg-type]
        job = self.core.jobs.get(event.job.job_id)
        if job is None or job.state in TERMINAL_STATES:
            return
        stage = next((s for s, (needs, _) in STAGES.items() if needs is event.job.state), "")
        reason = (
            f"{stage or event.job.state.value}: consumer {adv.get('consumer')} delivered the "
            f"{event.job.state.value} event {adv.get('deliveries')} times without success "
            "(the worker crashed, timed out or rejected it each time)"
        )
        await self.verbs.end(EndRequest(job_id=job.job_id, reason=reason, by=self.instance), "fail")

    async def _sweep_loop(self) -> None:
        while True:
            raise_if_cancelled()
            try:
                await self.sweep_partitions()
                await self._append_due_ends()
            except Exception as e:
                raise_if_cancelled()
                log.warning("partition sweep failed: %s", e)
            await asyncio.sleep(self.sweep_every_s)

    async def sweep_partitions(self) -> int:
        """Clear partitions whose job is terminal or unknown; returns how many."""
        cleared = 0
        for tenant, partition in await self.tq.list_partitions():
            job = self.core.jobs.get(partition)
            if job is None or job.state in TERMINAL_STATES:
                if job is None and partition in self._locks:
                    continue  # being reserved right now
                await self._clear_partition(tenant, partition)
                cleared += 1
        return cleared
