"""Usage metering (broker.usage): parts add up, exact across restarts, fenced per tenant.

The busy intervals go through the services' own emit path (``metrics.busy``,
with the fields the actor and the inference engine put on them); Training
Queue puts are real puts, job ends real scheduler transitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from joynexus.agents.control import ControlPlane
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import metrics, usage, usagestate
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.ops.admin.tenants import add_tenant
from joynexus.ops.runtime.deploy import embedded
from joynexus.schemas.errors import PermissionDenied
from joynexus.schemas.jobs import JobState, WorkloadPolicy
from joynexus.sdk import Client

TENANTS = ("acme", "bolt", "cora")


async def emit_work(b: Broker, rng: np.random.Generator, n: int, t0: float) -> dict[str, float]:
    """``n`` busy intervals of each service, as the services emit them; returns the
    measured busy seconds per service."""
    busy = {"train": 0.0, "infer": 0.0, "env": 0.0}
    for i in range(n):
        start = t0 + i
        group = list(rng.choice(TENANTS, size=int(rng.integers(1, 4)), replace=False))
        rows = {str(t): int(rng.integers(1, 64)) for t in group}
        d = float(rng.uniform(0.01, 0.5))
        await metrics.busy(b, "train", start, start + d, instance="actor-0", jobs=len(group),
                           tenants=sorted(rows), tenant_rows=rows, cpu_s=d)
        busy["train"] += (start + d) - start
        reqs = {t: int(rng.integers(1, 5)) for t in rows}
        d = float(rng.uniform(0.001, 0.1))
        await metrics.busy(b, "infer", start, start + d, instance="inference-0",
                           requests=sum(reqs.values()), rows=sum(rows.values()),
                           tenants=len(rows), tenant_rows=rows, tenant_requests=reqs, cpu_s=d)
        busy["infer"] += (start + d) - start
        d = float(rng.uniform(0.1, 2.0))
        await metrics.busy(b, "env", start, start + d, instance="env-1", workload="rl",
                           tenant=str(group[0]), steps=16)
        busy["env"] += (start + d) - start
    await b.nc.flush()
    return busy


async def wait_folded(b: Broker, meter: usage.Meter, at_least: int) -> None:
    for _ in range(200):
        await meter.run_once()
        if meter.state["events"] >= at_least:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {meter.state['events']} events folded, expected {at_least}")


async def test_parts_add_up_to_busy_time_and_queue_bytes(broker: Broker) -> None:
    rng = np.random.default_rng(7)
    busy = await emit_work(broker, rng, 40, time.time() - 100)
    # Two jobs through the real scheduler, with real Training Queue puts.
    sched = SchedulerAgent(broker, instance="sched", lease_ttl_s=30)
    await sched.start()
    # The meter runs while the bytes sit in the queue (a job's end purges them).
    meter = usage.Meter(broker, interval_s=0.05)
    await meter._open()
    running = asyncio.create_task(meter.run())
    try:
        c = SchedulerClient(broker, by="test")
        await c.set_policy(WorkloadPolicy(tenant_id="acme", task_type="sft", max_in_flight=4))
        tq = TrainingQueue(broker)
        put = 0
        for i in range(2):
            job = await c.reserve("acme", "sft", job_id=f"j{i}")
            assert job is not None
            data = {"x": np.ones((8, 16), np.float32)}
            await tq.async_put(data, tenant_id="acme", partition_id=job.partition_id)
            put += data["x"].nbytes
            await c.mark(job.job_id, JobState.READY)
            leased = await c.lease_next("actor")
            assert leased is not None
            await asyncio.sleep(0.3)  # the bytes sit in the queue a while
            await c.complete(leased, result_version=i + 1)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if meter.state["tenants"].get("acme", {}).get("jobs_completed") == 2:
                break
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await sched.stop()
    r = meter.report()
    st = meter.state
    for service, key in (("train", "train_s"), ("infer", "infer_s"), ("env", "env_s")):
        parts = sum(t.get(key, 0) for t in st["tenants"].values())
        assert st["services"][service] == pytest.approx(busy[service], abs=1e-9)
        assert parts == pytest.approx(busy[service], abs=1e-9), service
        assert st["unattributed"][service] == 0
        assert sum(t[key] for t in r["tenants"].values()) == pytest.approx(busy[service], abs=1e-4)
    acme = r["tenants"]["acme"]
    assert acme["jobs_completed"] == 2
    # Each put's bytes stayed from the put to the job's completion (>= 0.3 s).
    assert put * 0.3 <= acme["tq_byte_s"] <= put * 10
    assert acme["tq_bytes_held"] == 0
    # Rows: a step's time is split in proportion to its tenants' rows.
    one = usagestate.split(1.0, {"a": 3, "b": 1})
    assert one == {"a": 0.75, "b": 0.25}


async def test_restart_counts_each_event_once(broker: Broker, nats_server: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(11)
    t0 = time.time() - 1000
    await emit_work(broker, rng, 20, t0)
    a = usage.Meter(broker)
    await a._open()
    await wait_folded(broker, a, 60)  # checkpointed
    await emit_work(broker, rng, 20, t0 + 20)
    # A folds the next events in memory and dies before its checkpoint.
    for source, r in a._readers.items():
        async for _ in usage._drain(a.state, source, r):
            pass
    assert a.state["events"] >= 120
    await a._close()
    # B starts from A's last checkpoint while more events keep coming, and is
    # killed at an arbitrary point of its run loop, then started again.
    b2 = usage.Meter(broker, interval_s=0.05)
    task = asyncio.create_task(b2.run())
    await emit_work(broker, rng, 20, t0 + 40)
    await asyncio.sleep(0.15)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    c = usage.Meter(broker)
    await c._open()
    await wait_folded(broker, c, 180)
    # The stale meter A cannot move the checkpoint back: its write is refused and it reloads.
    a.state["tenants"]["acme"]["train_s"] = 1e9
    stale = a.revision
    await a.checkpoint()  # refused (the revision moved on): it reloads the checkpoint
    assert a.revision > stale
    assert a.state["tenants"]["acme"]["train_s"] < 1e9
    reference = await usage.catch_up(broker, usagestate.empty_state())  # everything, from seq 1
    assert reference["events"] == 180
    assert c.state["events"] == 180
    for t in TENANTS:
        for k in usagestate.FIELDS:
            assert c.state["tenants"][t].get(k, 0) == pytest.approx(
                reference["tenants"][t].get(k, 0), abs=1e-9), (t, k)
    # What an operator reads (checkpoint + tail) is the same.
    op = await usage.read_usage(broker)
    assert op["events"] == 180
    assert usagestate.report(op)["tenants"]["acme"]["train_s"] == pytest.approx(
        usagestate.report(reference)["tenants"]["acme"]["train_s"])
    # ... and what `joynexus usage` prints.
    from joynexus.ops.admin.usage import usage as usage_command

    capsys.readouterr()
    assert await usage_command(nats_server.url, broker.names.namespace, tenant="bolt",
                               since=None, as_json=True) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["tenants"]) == {"bolt"}
    assert printed["tenants"]["bolt"]["train_s"] == pytest.approx(
        reference["tenants"]["bolt"]["train_s"], abs=1e-5)
    assert printed["events"] == 180


async def test_tenant_sees_only_its_own_usage(tmp_path: Path) -> None:
    ns = "jnxuse"

    async def no_init(record: object) -> str:
        raise AssertionError("no workload is created here")

    with embedded(tmp_path / "nats", namespace=ns, act_as_admin=False) as ep:
        service = await Broker.connect(ep.url, name="svc", namespace=ns, credentials=ep.service)
        control_b = await Broker.connect(ep.url, name="ctl", namespace=ns,
                                         credentials=getattr(ep, "control", None) or ep.service)
        admin = await Broker.connect(ep.url, name="op", namespace=ns, credentials=ep.admin)
        control = ControlPlane(control_b, init_policy=no_init)  # type: ignore[arg-type]
        clients: list[Client] = []
        try:
            await control.start()
            now = time.time()
            await metrics.busy(service, "train", now - 2, now - 1, tenant_rows={"acme": 3, "bolt": 1},
                               tenants=["acme", "bolt"])
            await metrics.busy(service, "infer", now - 2, now - 1.5, tenant_rows={"bolt": 4},
                               tenant_requests={"bolt": 2})
            await service.nc.flush()
            creds: dict[str, Any] = {}
            for t in ("acme", "bolt"):
                creds[t], _ = await add_tenant(admin, t, url=ep.url)
                clients.append(await Client.connect(ep.url, credentials=creds[t]))
            acme, bolt = clients
            for _ in range(100):
                mine = await acme.usage()
                if mine["tenants"].get("acme", {}).get("train_s"):
                    break
                await asyncio.sleep(0.1)
            assert set(mine["tenants"]) == {"acme"}
            assert mine["tenants"]["acme"]["train_s"] == pytest.approx(0.75)
            assert mine["tenants"]["acme"]["infer_s"] == 0
            assert "services" not in mine  # nothing about the others, not even totals
            theirs = await bolt.usage()
            assert set(theirs["tenants"]) == {"bolt"}
            assert theirs["tenants"]["bolt"]["train_s"] == pytest.approx(0.25)
            assert theirs["tenants"]["bolt"]["infer_requests"] == 2
            # acme cannot ask on bolt's subject: the broker refuses the publish.
            with pytest.raises(PermissionDenied):
                for _ in range(20):
                    await acme._guarded(
                        control_b.names.api("bolt", "usage"),
                        acme._b.nc.request(control_b.names.api("bolt", "usage"), b"{}",
                                           timeout=2),
                    )
                    await asyncio.sleep(0.1)
        finally:
            for c in clients:
                with contextlib.suppress(Exception):
                    await c.close()
            await control.stop()
            for b in (service, control_b, admin):
                await b.close()


async def test_real_training_steps_split_by_rows(tmp_path: Path) -> None:
    """Real grouped training steps (the actor, a tiny backbone) of two tenants: the
    control plane's meter gives each its rows' share, and the shares add up to the
    training service's busy intervals on the metrics stream."""
    from joynexus.ops.isolation import SecuredDeployment
    from joynexus.schemas.workloads import WorkloadSpec

    def rows(n: int, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {
            "obs_image_base_camera": rng.integers(0, 255, (n, 3, 64, 64), dtype=np.uint8),
            "obs_state": rng.standard_normal((n, 12), dtype=np.float32),
            "actions": rng.uniform(-1, 1, (n, 2, 4)).astype(np.float32),
        }

    async with SecuredDeployment(tmp_path / "dep", namespace="jnxmeter") as dep:
        clients = {}
        for t in ("acme", "bolt"):
            await dep.issue(t)
            clients[t] = await dep.client(t)
            spec = WorkloadSpec(name="pick", task_type="sft", dataset=await dep.dataset(t),
                                source="tenant", action_horizon=2)
            await clients[t].create_workload(spec)
        for i in range(3):
            await asyncio.gather(clients["acme"].submit_sft_batch("pick", rows(4, i)),
                                 clients["bolt"].submit_sft_batch("pick", rows(12, 10 + i)))
        for _ in range(600):
            if all([await c.latest_version("pick") >= 4 for c in clients.values()]):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the actor did not train both tenants' 3 jobs")
        # The training service's busy intervals, as the metrics stream holds them.
        state = usagestate.empty_state()
        busy = 0.0
        sub = await dep.admin.js.subscribe(dep.names.metrics("system", "*"), ordered_consumer=True)
        try:
            for _ in range(200):
                try:
                    m = await sub.next_msg(timeout=0.5)
                except TimeoutError:
                    break
                e = json.loads(m.data)
                if e.get("service") == "train":
                    busy += e["busy_end"] - e["busy_start"]
                    usagestate.fold_metric(state, e)
        finally:
            await sub.unsubscribe()
        assert busy > 0
        got: dict[str, dict[str, float]] = {}
        for _ in range(100):
            got = {t: (await c.usage())["tenants"].get(t, {}) for t, c in clients.items()}
            if sum(g.get("train_s", 0) for g in got.values()) >= busy - 1e-4:
                break
            await asyncio.sleep(0.1)
        assert sum(g["train_s"] for g in got.values()) == pytest.approx(busy, abs=1e-4)
        assert got["acme"]["rows_trained"] == 12 and got["bolt"]["rows_trained"] == 36
        for t in clients:
            assert got[t]["train_s"] == pytest.approx(state["tenants"][t]["train_s"], abs=1e-5)
