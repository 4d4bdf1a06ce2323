"""The scheduler agent on a real nats-server: leases, races, restarts, cleanup."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.agents.stage import StageWorker
from joynexus.broker.connection import Broker
from joynexus.broker.eventlog import JobEventLog, new_op_id
from joynexus.schemas.base import decode
from joynexus.schemas.errors import (
    Conflict,
    IllegalTransition,
    InvalidMessage,
    StaleLease,
    UnknownTenant,
)
from joynexus.schemas.jobs import GlobalLimits, JobState, Leased, WorkloadPolicy
from joynexus.schemas.scheduler import Reply

S = JobState


async def start_scheduler(broker: Broker, **kw: object) -> SchedulerAgent:
    agent = SchedulerAgent(broker, lease_ttl_s=kw.pop("lease_ttl_s", 30.0), expire_every_s=0.1, **kw)  # type: ignore[arg-type]
    await agent.start()
    return agent


@pytest.fixture
async def sched(broker: Broker) -> AsyncIterator[SchedulerAgent]:
    agent = await start_scheduler(broker, lease_ttl_s=1.0)
    yield agent
    await agent.stop()


async def setup_tenants(c: SchedulerClient) -> None:
    await c.set_limits(GlobalLimits(max_active_rollouts=16))
    await c.set_policy(WorkloadPolicy(tenant_id="acme", task_type="rl", max_in_flight=16, max_active_rollouts=16))
    await c.set_policy(WorkloadPolicy(tenant_id="bolt", task_type="sft", max_in_flight=16))


async def completed_count(broker: Broker, tenant: str, job_id: str) -> int:
    hist = await JobEventLog(broker).history(tenant, job_id)
    return sum(1 for h in hist if h.event.job.state is S.COMPLETED)


async def test_full_rl_lifecycle_through_the_api(broker: Broker, sched: SchedulerAgent) -> None:
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    job = await c.reserve("acme", "rl", sample_count=4, behavior_policy_version=0)
    assert job is not None and job.state is S.RESERVED and job.created_seq > 0
    await c.mark(job.job_id, S.NEEDS_ADVANTAGES, sample_count=8)
    staged = await c.lease_stage(job.job_id, "advantages")
    ready = await c.mark(job.job_id, S.READY, attempt=staged.attempt)
    assert ready.ready_seq > job.created_seq
    leased = await c.lease_next(wait_s=1.0)
    assert leased is not None and leased.job_id == job.job_id and leased.state is S.LEASED
    done = await c.complete(leased, result_version=1)
    assert done.state is S.COMPLETED and done.sample_count == 8
    states = [h.event.job.state for h in await JobEventLog(broker).history("acme", job.job_id)]
    assert states == [S.RESERVED, S.NEEDS_ADVANTAGES, S.COMPUTING_ADVANTAGES, S.READY, S.LEASED, S.COMPLETED]
    snap = await c.snapshot()
    assert snap.jobs_by_state == {"completed": 1} and snap.versions == {"acme.default": 1}


async def test_bad_requests_get_clear_errors_and_service_continues(broker: Broker, sched: SchedulerAgent) -> None:
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    with pytest.raises(UnknownTenant, match="'ghost' has no workload 'default'"):
        await c.reserve("ghost", "rl")
    msg = await broker.nc.request(broker.names.sched("reserve"), b"{not json", timeout=5)
    reply = decode(msg.data, Reply)
    assert reply.error is not None and reply.error.code == "invalid_message"
    assert msg.headers and "Nats-Service-Error" in msg.headers
    job = await c.reserve("bolt", "sft")
    assert job is not None
    with pytest.raises(IllegalTransition, match="not leased"):
        await c.complete(job)
    await c.mark(job.job_id, S.READY)
    leased = await c.lease_next()
    assert leased is not None
    await c.complete(leased)
    with pytest.raises(IllegalTransition, match="completed -> computing_advantages"):
        await c.lease_stage(job.job_id, "advantages")
    with pytest.raises(IllegalTransition, match="already completed"):
        await c.fail(job.job_id, "too late")


async def test_two_actors_race_for_one_ready_job(broker: Broker, sched: SchedulerAgent) -> None:
    await setup_tenants(SchedulerClient(broker, by="setup"))
    a, b = SchedulerClient(broker, by="actor-a"), SchedulerClient(broker, by="actor-b")
    for _ in range(5):
        job = await a.reserve("bolt", "sft")
        assert job is not None
        await a.mark(job.job_id, S.READY)
        got = await asyncio.gather(a.lease_next(), b.lease_next())
        leased = [g for g in got if g is not None]
        assert len(leased) == 1 and leased[0].job_id == job.job_id
        await (a if leased[0].holder == "actor-a" else b).complete(leased[0])


async def test_event_log_compare_and_append_admits_one_writer(broker: Broker, sched: SchedulerAgent) -> None:
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    job = await c.reserve("bolt", "sft")
    job = await c.mark(job.job_id, S.READY)
    log = JobEventLog(broker)
    last = await log.last("bolt", job.job_id)
    assert last is not None

    def lease_by(who: str) -> Leased:
        import msgspec

        return Leased(job=msgspec.structs.replace(job, state=S.LEASED, attempt=1, holder=who))

    results = await asyncio.gather(
        log.append(lease_by("x"), expected_last_seq=last.seq, op_id=new_op_id()),
        log.append(lease_by("y"), expected_last_seq=last.seq, op_id=new_op_id()),
        return_exceptions=True,
    )
    assert sum(isinstance(r, Conflict) for r in results) == 1
    # A retry of the append that landed is recognised as ours, not as a conflict.
    winner_op = None
    hist = await log.history("bolt", job.job_id)
    winner_op = hist[-1].headers["Nats-Msg-Id"].rsplit(":", 1)[1]
    ev = hist[-1].event
    again = await log.append(ev, expected_last_seq=last.seq, op_id=winner_op)
    assert again.duplicate and again.seq == hist[-1].seq


async def test_actor_killed_mid_lease_is_leased_again_and_completed_once(
    broker: Broker, sched: SchedulerAgent
) -> None:
    await setup_tenants(SchedulerClient(broker, by="setup"))
    zombie = SchedulerClient(broker, by="actor-dead")
    job = await zombie.reserve("bolt", "sft")
    await zombie.mark(job.job_id, S.READY)
    first = await zombie.lease_next()
    assert first is not None and first.attempt == 1
    # The actor dies: no touch, no complete. After the lease TTL (1 s) it is ready again.
    survivor = SchedulerClient(broker, by="actor-ok")
    second = await survivor.lease_next(wait_s=5.0)
    assert second is not None and second.job_id == job.job_id and second.attempt == 2
    with pytest.raises(StaleLease):
        await zombie.complete(first)
    await survivor.complete(second)
    assert await completed_count(broker, "bolt", job.job_id) == 1
    states = [h.event.job.state for h in await JobEventLog(broker).history("bolt", job.job_id)]
    assert states == [S.RESERVED, S.READY, S.LEASED, S.READY, S.LEASED, S.COMPLETED]


async def test_touch_keeps_a_long_lease(broker: Broker, sched: SchedulerAgent) -> None:
    c = SchedulerClient(broker, by="slow-actor")
    await setup_tenants(c)
    job = await c.reserve("bolt", "sft")
    await c.mark(job.job_id, S.READY)
    leased = await c.lease_next()
    for _ in range(6):  # 1.8 s, longer than the 1 s TTL
        await asyncio.sleep(0.3)
        await c.touch(leased)
    assert (await c.complete(leased)).state is S.COMPLETED


async def test_scheduler_restart_rebuilds_state_without_loss_or_doubling(broker: Broker) -> None:
    agent = await start_scheduler(broker)
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    jobs = [await c.reserve("acme" if i % 2 else "bolt", "rl" if i % 2 else "sft") for i in range(12)]
    for j in jobs[:9]:
        await c.mark(j.job_id, S.READY)
    leased = [await c.lease_next() for _ in range(4)]
    for lj in leased[:2]:
        await c.complete(lj)
    before = agent.snapshot()
    await agent.stop()
    # While the scheduler is down, a caller's request waits and goes through after restart.
    pending = asyncio.create_task(c.mark(jobs[9].job_id, S.READY))
    await asyncio.sleep(0.3)
    agent2 = await start_scheduler(broker)
    try:
        await asyncio.wait_for(pending, 10)
        after = agent2.snapshot()
        assert after.jobs_by_state["ready"] == before.jobs_by_state["ready"] + 1
        for k in ("completed", "leased", "reserved"):
            expect = before.jobs_by_state.get(k, 0) - (1 if k == "reserved" else 0)
            assert after.jobs_by_state.get(k, 0) == expect
        assert agent2.rebuild_stats["jobs"] == 12
        # The held leases survive the restart; finish everything.
        for lj in leased[2:]:
            await c.complete(lj)
        for j in jobs[10:]:
            await c.mark(j.job_id, S.READY)
        while (lj := await c.lease_next()) is not None:
            await c.complete(lj)
        counts = Counter([await completed_count(broker, j.job_id and j.tenant_id, j.job_id) for j in jobs])
        assert counts == {1: 12}
    finally:
        await agent2.stop()


async def test_malformed_event_in_log_is_skipped_on_rebuild(broker: Broker) -> None:
    agent = await start_scheduler(broker)
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    job = await c.reserve("bolt", "sft")
    await agent.stop()
    await broker.js.publish(broker.names.job_subject("bolt", "jgarbage", "ready"), b"\x00 not an event")
    agent2 = await start_scheduler(broker)
    try:
        assert agent2.rebuild_stats["skipped_malformed"] == 1
        assert (await c.get_job(job.job_id)).state is S.RESERVED
    finally:
        await agent2.stop()


async def test_stage_message_failing_max_deliver_times_fails_the_job(broker: Broker, sched: SchedulerAgent) -> None:
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)

    async def broken(job):  # a transient error every time
        raise ConnectionError("simulator unreachable")

    worker = StageWorker(broker, SchedulerClient(broker, by="w"), "advantages", broken, max_deliver=3)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    # Speed the test up: the disposition's backoff grows 0.5, 1, ... seconds.
    job = await c.reserve("acme", "rl")
    await c.mark(job.job_id, S.NEEDS_ADVANTAGES)
    for _ in range(100):
        if (await c.get_job(job.job_id)).state is S.FAILED:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await run
    failed = await c.get_job(job.job_id)
    assert failed.state is S.FAILED
    assert "simulator unreachable" in failed.reason and "3 deliveries" in failed.reason


async def test_garbage_on_a_stage_subject_is_terminated_not_retried(broker: Broker, sched: SchedulerAgent) -> None:
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    seen: list[str] = []

    async def work(job):
        seen.append(job.job_id)
        return None

    worker = StageWorker(broker, SchedulerClient(broker, by="w"), "advantages", work)
    await broker.js.publish(broker.names.job_subject("acme", "jjunk", "needs_advantages"), b"garbage")
    good = await c.reserve("acme", "rl")
    await c.mark(good.job_id, S.NEEDS_ADVANTAGES)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    for _ in range(100):
        if (await c.get_job(good.job_id)).state is S.READY:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await run
    assert seen == [good.job_id]
    info = await broker.js.consumer_info(broker.names.jobs_stream, worker.consumer_name)
    assert info.num_ack_pending == 0 and info.num_pending == 0


def test_decode_is_strict_in_tests() -> None:
    with pytest.raises(InvalidMessage, match="unknown field"):
        decode(b'{"job":null,"refused":"","bogus":1}', Reply)


async def test_stage_message_that_crashes_every_worker_fails_the_job_via_advisory(
    broker: Broker, sched: SchedulerAgent
) -> None:
    """A worker that dies holding the message (no ack, no nak) each time: JetStream
    gives up after max_deliver and its advisory makes the scheduler fail the job."""
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)

    async def never(job):  # pragma: no cover - the 'crashed' worker never runs work
        raise AssertionError

    worker = StageWorker(broker, SchedulerClient(broker, by="w"), "advantages", never, ack_wait_s=0.5, max_deliver=2)
    sub = await worker.subscribe()
    job = await c.reserve("acme", "rl")
    await c.mark(job.job_id, S.NEEDS_ADVANTAGES)
    deliveries = 0
    for _ in range(50):
        try:
            msgs = await sub.fetch(1, timeout=0.5)
        except TimeoutError:
            msgs = []
        deliveries += len(msgs)  # received, then "crash": never acked
        if (await c.get_job(job.job_id)).state is S.FAILED:
            break
    failed = await c.get_job(job.job_id)
    assert deliveries == 2
    assert failed.state is S.FAILED and "2 times without success" in failed.reason


async def test_partition_bytes_return_to_zero_once_every_job_is_terminal(
    broker: Broker, sched: SchedulerAgent
) -> None:
    import numpy as np

    from joynexus.broker.tq import TrainingQueue

    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    tq = TrainingQueue(broker)
    jobs = []
    for i in range(6):
        job = await c.reserve("bolt", "sft")
        await tq.async_put({"x": np.full((4, 256), i, dtype=np.float32)}, tenant_id="bolt", partition_id=job.partition_id)
        jobs.append(await c.mark(job.job_id, S.READY))
    # An orphan: data for a job that was never reserved (a producer died mid-reserve).
    await tq.async_put({"x": np.ones((2, 8), dtype=np.float32)}, tenant_id="bolt", partition_id="jorphan")
    assert await tq.partition_bytes() > 6 * 4 * 256 * 4
    for i, _ in enumerate(jobs):
        leased = await c.lease_next()
        if i % 3 == 0:
            await c.complete(leased)
        elif i % 3 == 1:
            await c.drop(leased.job_id, "operator said so")
        else:
            await c.fail(leased.job_id, "bad batch", attempt=leased.attempt)
    assert await sched.sweep_partitions() >= 1  # the orphan (and any purge still in flight)
    for _ in range(50):
        if await tq.partition_bytes() == 0:
            break
        await asyncio.sleep(0.05)
    assert await tq.partition_bytes() == 0
    assert await tq.list_partitions() == {}


async def test_events_carry_the_callers_trace(broker: Broker, sched: SchedulerAgent, spans) -> None:
    from opentelemetry import trace

    exporter = spans
    tracer = trace.get_tracer("test")
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    with tracer.start_as_current_span("producer") as span:
        job = await c.reserve("acme", "rl")
        await c.mark(job.job_id, S.NEEDS_ADVANTAGES)
        trace_id = f"{span.get_span_context().trace_id:032x}"
    hist = await JobEventLog(broker).history("acme", job.job_id)
    assert all(trace_id in h.headers.get("traceparent", "") for h in hist)

    async def work(j):
        return None

    worker = StageWorker(broker, SchedulerClient(broker, by="w"), "advantages", work)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    for _ in range(100):
        if (await c.get_job(job.job_id)).state is S.READY:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await run
    stage_spans = [s for s in exporter.get_finished_spans() if s.name == "stage.advantages"]
    assert stage_spans and f"{stage_spans[0].context.trace_id:032x}" == trace_id


async def test_a_swallowed_cancellation_still_stops_a_retry_loop() -> None:
    """nats-py's next_msg turns a cancellation into ConnectionClosedError when the
    connection closes meanwhile; the agents' log-and-retry loops must stop anyway."""
    from joynexus.broker.connection import raise_if_cancelled

    async def fetch_like_nats() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("nats: connection closed") from None

    async def retry_loop() -> None:
        while True:
            try:
                await fetch_like_nats()
            except Exception:
                raise_if_cancelled()
                await asyncio.sleep(0.01)

    task = asyncio.create_task(retry_loop())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)


async def test_fail_open_fails_only_the_owners_open_jobs(broker: Broker, sched: SchedulerAgent) -> None:
    """A producer cleaning up after a dead worker: its reserved and producing jobs of
    that workload fail; another worker's, another workload's and ended jobs stay."""
    from joynexus.schemas.jobs import JobMetadata

    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    for name in ("pick", "push"):
        await c.set_policy(WorkloadPolicy(tenant_id="acme", task_type="rl", workload=name,
                                          max_in_flight=16, max_active_rollouts=16))

    async def job(key: str, producer: str) -> str:
        j = await c.reserve("acme", "rl", workload=key, metadata=JobMetadata(extra={"producer": producer}))
        assert j is not None
        return j.job_id

    mine_reserved, mine_producing = await job("pick", "w1"), await job("pick", "w1")
    await c.mark(mine_producing, S.PRODUCING)
    theirs, elsewhere, ended = await job("pick", "w2"), await job("push", "w1"), await job("pick", "w1")
    await c.fail(ended, "ended before the clean-up")

    n = await c.fail_open(
        "acme", "pick", "worker gone", owned=lambda j: j.metadata.extra.get("producer") == "w1"
    )
    assert n == 2
    states = {i: (await c.get_job(i)).state for i in (mine_reserved, mine_producing, theirs, elsewhere, ended)}
    assert states == {
        mine_reserved: S.FAILED, mine_producing: S.FAILED, theirs: S.RESERVED,
        elsewhere: S.RESERVED, ended: S.FAILED,
    }
    assert await c.fail_open("acme", "pick", "again", owned=lambda j: j.job_id == mine_reserved) == 0


async def test_a_restarted_scheduler_has_every_tenants_policy_and_version_counter(
    broker: Broker, early_kv_marker: list[int]
) -> None:
    """nats-py's kv.keys() stops at its marker, which can come first: the scheduler then
    started with no tenant-task policies, no global limits and no version counters
    (the next policy version numbered from 1 again). Forced here; it reads them all."""
    agent = await start_scheduler(broker)
    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    assert await c.set_version("acme", "pick", 7) == 7
    await agent.stop()
    agent2 = await start_scheduler(broker)
    try:
        assert early_kv_marker  # the fault was on for the restart's read
        assert set(agent2.core.policies) == {"acme.default", "bolt.default"}
        assert agent2.core.limits.max_active_rollouts == 16
        assert agent2.core.versions == {"acme.pick": 7}
    finally:
        await agent2.stop()


async def test_the_producers_admission_wait_against_the_scheduler(
    broker: Broker, sched: SchedulerAgent
) -> None:
    """``reserve_until_admitted`` (the one admission loop of the SFT, RL and synthetic
    producers) on the scheduler's real refusals: an in-flight refusal waits in the
    scheduler's admission queue (one request, no polling) until a job completes, a
    met completion target ends the run, a stop ends the wait."""
    from joynexus.agents.scheduler_client import Backoff, reserve_until_admitted

    c = SchedulerClient(broker, by="t")
    await c.set_policy(WorkloadPolicy(tenant_id="acme", task_type="sft", workload="w",
                                      max_in_flight=1, completion_target=2))
    fast = Backoff(first_s=0.01, max_s=0.05)
    stop = asyncio.Event()
    tries: list[str] = []

    async def attempt():  # type: ignore[no-untyped-def]
        job = await c.reserve("acme", "sft", workload="w")
        tries.append(c.last_refusal_code)
        return job

    async def finish(job_id: str) -> None:
        await c.mark(job_id, S.READY)
        leased = await c.lease_next(wait_s=1.0)
        assert leased is not None and leased.job_id == job_id
        await c.complete(leased, result_version=1)

    first = await reserve_until_admitted(c, attempt, stop, backoff=fast)
    assert first is not None and tries == [""]
    # In flight: refused with "in_flight" and waited out until the first job ends.
    waiting = asyncio.create_task(reserve_until_admitted(c, attempt, stop, backoff=fast))
    await asyncio.sleep(0.3)
    assert not waiting.done() and tries == [""]  # its one reserve waits at the scheduler
    [w] = sched.core.queue.waiters.values()
    assert (w.tenant, w.code) == ("acme", "in_flight")
    await finish(first.job_id)
    second = await asyncio.wait_for(waiting, 10)
    assert second is not None and second.job_id != first.job_id
    assert tries == ["", ""] and c.last_position == 1  # admitted from the queue, first in it
    assert not sched.core.queue.waiters
    # The target (2) is met once the second completes: the run ends, without waiting.
    await finish(second.job_id)
    assert await asyncio.wait_for(reserve_until_admitted(c, attempt, stop, backoff=fast), 5) is None
    assert c.last_refusal_code == "ended" and not stop.is_set()
    # A refusal the run waits out (until_done=False) ends only when stopped.
    waiting = asyncio.create_task(
        reserve_until_admitted(c, attempt, stop, backoff=fast, until_done=False))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    stop.set()
    assert await asyncio.wait_for(waiting, 2) is None


@pytest.mark.slow  # ~13 s: the lost long poll is re-sent after the client's call timeout
async def test_a_free_rollout_slot_goes_to_the_waiting_tenant_furthest_behind_even_across_a_restart(
    broker: Broker,
) -> None:
    """One global rollout slot, held by acme. acme and bolt both wait for it in the
    admission queue (long polls); acme has a job under way, bolt none: the freed slot
    goes to bolt, though acme asked first. Then the scheduler restarts while acme
    still waits: its reserve is asked again (the client retries) and admitted once
    the slot frees, exactly once."""
    agent = await start_scheduler(broker)
    c = SchedulerClient(broker, by="t")
    await c.set_limits(GlobalLimits(max_active_rollouts=1))
    for t in ("acme", "bolt"):
        await c.set_policy(WorkloadPolicy(tenant_id=t, task_type="rl", max_in_flight=8,
                                          max_active_rollouts=8))
    holder = await c.reserve("acme", "rl")
    assert holder is not None
    ca, cb = SchedulerClient(broker, by="a"), SchedulerClient(broker, by="b")
    wait_a = asyncio.create_task(ca.reserve("acme", "rl", job_id="ja", wait_s=8.0))
    await asyncio.sleep(0.2)
    wait_b = asyncio.create_task(cb.reserve("bolt", "rl", job_id="jb", wait_s=8.0))
    await asyncio.sleep(0.3)
    assert not wait_a.done() and not wait_b.done()
    assert agent.core.position("jb", now=0.0) == 1 and agent.core.position("ja", now=0.0) == 2
    snap = await c.snapshot()
    assert {s.tenant_id: s.queued for s in snap.shares} == {"acme": 1, "bolt": 1}
    await c.mark(holder.job_id, S.READY)  # the slot frees
    got_b = await asyncio.wait_for(wait_b, 5)
    assert got_b is not None and got_b.job_id == "jb" and cb.last_position == 1
    await asyncio.sleep(0.3)
    assert not wait_a.done()  # bolt holds the slot now
    await agent.stop()
    agent = await start_scheduler(broker)  # acme's long poll is lost; its client asks again
    try:
        await asyncio.sleep(0.5)
        assert not wait_a.done()
        await c.mark("jb", S.READY)
        got_a = await asyncio.wait_for(wait_a, 15)
        assert got_a is not None and got_a.job_id == "ja"
        listed = await c.list_jobs("acme")
        assert sorted(j.job_id for j in listed) == sorted([holder.job_id, "ja"])
        assert not agent.core.queue.waiters
    finally:
        await agent.stop()


def fair_state(core) -> dict:  # type: ignore[no-untyped-def]
    """Each tenant's charges (virtual time, jobs, mean rows per job), and the order
    the ready jobs would be leased in."""
    skip: set[str] = set()
    order = []
    while (job := core.next_ready("actor", skip, now=0.0)) is not None:
        order.append(job.job_id)
        skip.add(job.job_id)
    shares = {t: (round(s.vt, 9), s.jobs, round(s.cost, 9)) for t, s in core.fair.shares.items()}
    return {"shares": shares, "mean": round(core.fair.mean_cost, 9), "order": order}


async def test_the_fair_order_survives_a_restart_and_a_lease_takeover(broker: Broker) -> None:
    """Charges made by real completions (three tenants, weights 1, 2, 1, unequal
    rows; a failed job, a lease and a reserve open): a restarted scheduler, then a
    standby that takes the lease over, rebuild the same charges and lease order."""
    from joynexus.agents.leases import RoleLease

    agent = await start_scheduler(broker)
    c = SchedulerClient(broker, by="t", deadline_s=30)
    await c.set_limits(GlobalLimits(max_active_rollouts=64))
    rows = {"acme": 8, "bolt": 16, "cora": 4}
    for t, w in (("acme", 1), ("bolt", 2), ("cora", 1)):
        await c.set_policy(WorkloadPolicy(tenant_id=t, task_type="rl", max_in_flight=64,
                                          max_active_rollouts=64, weight=w))
    for i in range(4):
        for t in ("acme", "bolt", "cora") if i % 2 else ("cora", "acme", "bolt"):
            job = await c.reserve(t, "rl", sample_count=rows[t] + i)
            assert job is not None
            await c.mark(job.job_id, S.READY)
    for _ in range(7):
        leased = await c.lease_next(wait_s=1.0)
        assert leased is not None
        await c.complete(leased, result_version=1)
    failed = await c.reserve("bolt", "rl", sample_count=99)
    assert failed is not None
    await c.fail(failed.job_id, "x")
    assert await c.lease_next(wait_s=1.0) is not None  # open at the restart
    assert await c.reserve("acme", "rl", sample_count=3) is not None
    before = fair_state(agent.core)
    assert len(before["shares"]) == 3 and len(before["order"]) == 4
    assert len({v[0] for v in before["shares"].values()}) > 1  # not all level
    await agent.stop()
    agent = await start_scheduler(broker)
    try:
        assert fair_state(agent.core) == before
    finally:
        await agent.stop()
    # A standby takes the lease over from a holder that froze: the same again.
    stop = asyncio.Event()
    a = SchedulerAgent(broker, instance="sched-a", expire_every_s=0.2,
                       lease=RoleLease(broker, "scheduler", "host-a/sched", ttl_s=2))
    b = SchedulerAgent(broker, instance="sched-b", expire_every_s=0.2,
                       lease=RoleLease(broker, "scheduler", "host-b/sched", ttl_s=2))
    try:
        assert await a.stand_by(stop)
        await a.start()
        standby = asyncio.create_task(b.stand_by(stop))
        for t in a._loops:
            if t.get_name() == "sched-lease":
                t.cancel()
        assert await asyncio.wait_for(standby, 15)
        await b.start()
        assert fair_state(b.core) == before
    finally:
        stop.set()
        await a.stop()
        await b.stop()


async def test_jobs_are_listed_by_their_metadata_extra(broker: Broker, sched: SchedulerAgent) -> None:
    """A training client's call asked again finds its job by (client, seq) in the
    scheduler: the reply holds that job only, not the workload's history."""
    from joynexus.schemas.jobs import JobMetadata

    c = SchedulerClient(broker, by="t")
    await setup_tenants(c)
    await c.set_policy(WorkloadPolicy(tenant_id="acme", workload="algo", task_type="custom",
                                      max_in_flight=16))
    for seq in (1, 2, 3):
        job = await c.reserve("acme", "custom", workload="algo", producer_role="tenant",
                              metadata=JobMetadata(extra={"client": "4", "seq": str(seq)}))
        assert job is not None
    mine = await c.list_jobs("acme", workload="algo", extra={"client": "4", "seq": "2"})
    assert [j.metadata.extra["seq"] for j in mine] == ["2"]
    assert await c.list_jobs("acme", workload="algo", extra={"client": "5", "seq": "2"}) == []
    assert await c.list_jobs("bolt", workload="algo", extra={"client": "4", "seq": "2"}) == []
    assert len(await c.list_jobs("acme", workload="algo")) == 3
