"""``joynexus bench faults``: kill roles while they hold work and measure recovery.

Real role processes run under an in-process health manager, fed by synthetic
producers for two tenants (RL and SFT); each fault is injected only once its
victim holds work (the scheduler's view), and measured as:

* ``detect_s``: fault -> the manager's restart decision;
* ``restart_s``: fault -> the first heartbeat of the new process;
* ``jobs_lost`` / ``jobs_doubled`` / ``partitions_leaked``: from an audit of
  the job log and the Training Queue once every job drained (lost: never
  terminal; doubled: two ``completed`` events);
* ``releases``: actor and stage leases granted more than once (work redone),
  ``progress``: jobs each tenant completed after the fault.

The rig (:class:`joynexus.ops.bench.faultrig.FaultRig`) and the audit are in
ops/bench/faultrig.py, shared with ``tests/system/test_chaos.py``; the training
client's drills (a custom workload's calls across actor, control-plane and host
kills) in ops/bench/customfaults.py.
See docs/ARCHITECTURE.md, "Health: heartbeats and in-place restarts".
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.ops.bench.customfaults import custom_call_faults, host_lost_custom
from joynexus.ops.bench.faultrig import (
    TENANTS,
    Fault,
    FaultRig,
    wait_until,
)
from joynexus.ops.bench.hostsrig import HOSTS_ENV, HostsRig
from joynexus.schemas.jobs import JobState, TrainingJob, WorkloadPolicy

#: The real-trainer drill's tenants: SFT on rows of the tiny base's shape.
REAL_TENANTS = (("dana", "sft"), ("erin", "sft"))


async def _real_sft_feed(rig: FaultRig) -> None:
    """Each tenant: a published policy (version 1) and a producer of SFT jobs whose
    rows a real actor trains on (random images/states, target chunks)."""
    import numpy as np

    from joynexus.agents.models.backbone_config import BackboneConfig
    from joynexus.agents.models.features import FeatureSchema
    from joynexus.agents.models.heads.base import HeadConfig
    from joynexus.agents.models.heads.tenant import TenantModule
    from joynexus.agents.models.policyio import PolicyStore
    from joynexus.agents.producers import feature_dim
    from joynexus.schemas.errors import JoyNexusError
    from joynexus.schemas.jobs import JobMetadata
    from joynexus.schemas.samples import ACTIONS_FIELD, STATE_FIELD, image_field

    base = BackboneConfig(size="tiny").base_model  # what the actor role builds by default
    schema = FeatureSchema(("base_camera",), (56, 56), 5, 3, 2, base_model=base)
    tq = TrainingQueue(rig.b)
    for i, (tenant, _) in enumerate(rig.tenants):
        module = TenantModule(tenant, "oft_mlp", HeadConfig(feature_dim(base), 5, 3, 2, seed=i))
        await PolicyStore(rig.b).publish(tenant, "default", module, schema, version=1)
        await rig.sched.set_policy(
            WorkloadPolicy(tenant_id=tenant, task_type="sft", max_in_flight=2)
        )

    async def produce(tenant: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        meta = JobMetadata(
            schema_signature=schema.signature(), extra={"instruction": "push the cube"}
        )
        while not rig.produce_stop.is_set():
            try:
                job = await rig.sched.reserve(
                    tenant, "sft", workload="default", sample_count=8, metadata=meta
                )
                if job is None:
                    await asyncio.sleep(0.1)
                    continue
                rows = {
                    image_field("base_camera"): rng.integers(0, 255, (8, 3, 56, 56), dtype=np.uint8),
                    STATE_FIELD: rng.normal(size=(8, 5)).astype(np.float32),
                    ACTIONS_FIELD: rng.uniform(-1, 1, (8, 2, 3)).astype(np.float32),
                }
                await tq.async_put(rows, tenant_id=tenant, partition_id=job.partition_id)
                await rig.sched.mark(job.job_id, JobState.READY)
            except JoyNexusError:  # the scheduler changing hands: try again
                await asyncio.sleep(0.2)

    for i, (tenant, _) in enumerate(rig.tenants):
        rig.tasks.append(asyncio.create_task(produce(tenant, i)))


async def trainer_continuity(b: Broker, tenants: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """Per tenant from the job log and the trainer checkpoint in JetStream: the
    versions the completed jobs produced (each once: none stepped twice), and
    whether the optimizer's step count matches the updates (no reset)."""
    from joynexus.agents.actor.state import TenantState
    from joynexus.broker.trainerstate import TrainerStateStore

    out: dict[str, Any] = {}
    sched = SchedulerClient(b, by="audit", deadline_s=30)
    for tenant, _ in tenants:
        versions = sorted(
            j.result_version or 0
            for j in await sched.list_jobs(tenant, states=[JobState.COMPLETED])
        )
        loaded = await TrainerStateStore(b).load(tenant, "default")
        steps: list[int] = []
        version = None
        if loaded is not None:
            module, _, _ = await asyncio.to_thread(TenantState.unpack, loaded.data)
            version = module.version
            steps = sorted(
                {int(v["step"]) for v in module.optimizer.state_dict()["state"].values()}
            )
        out[tenant] = {
            "updates": len(versions),
            "versions_unique": len(set(versions)) == len(versions),
            "versions_contiguous": versions == list(range(2, len(versions) + 2)),
            "checkpoint_version": version,
            "optimizer_steps": steps,
            "optimizer_continued": steps == [len(versions)] and version == len(versions) + 1,
        }
    return out


async def host_lost_fault(work: Path, *, real_trainer: bool = False) -> dict[str, Any]:
    """Two hosts on a 3-node cluster; one host (its supervisor, roles and node) is
    killed at once. Measured: ``detect_s`` (kill -> the other host's scheduler holds
    the lease), ``takeover_s`` (kill -> every tenant completed another job), and
    the audit (jobs lost, doubled, partitions leaked). With ``real_trainer`` each
    host runs a real actor (tiny base) for two SFT tenants instead of the synthetic
    roles, and the trainer checkpoint's continuity is checked as well."""
    from joynexus.ops.runtime.natsserver import local_cluster

    roles = ["scheduler", "actor"] if real_trainer else ["scheduler", "synthetic"]
    with local_cluster(work / "cluster") as nodes:
        rig = HostsRig(
            "hostlost",
            {"a": (nodes[0].url, roles), "b": (nodes[1].url, roles)},
            rig_urls=[nodes[1].url, nodes[2].url],
            work=work,
            env=HOSTS_ENV,
            tenants=REAL_TENANTS if real_trainer else TENANTS,
        )
        try:
            await rig.start()
            if real_trainer:
                await _real_sft_feed(rig)
            else:
                await rig.feed_synthetic()
            await rig.progressed({}, within=180)
            before = dict(await rig.completed())
            holder_before = await rig.lease_holder()
            t0 = time.monotonic()
            killed = await rig.kill_host("a")
            nodes[0].kill()
            await wait_until(lambda: rig.lease_holder("b/"), 60, "host b's scheduler holding the lease")
            detect_s = time.monotonic() - t0
            progress = await rig.progressed(before, within=120)
            takeover_s = time.monotonic() - t0
            a = await rig.drain(within=120)
            extra = {"trainers": await trainer_continuity(rig.b, rig.tenants)} if real_trainer else {}
            return {
                "fault": "host lost (supervisor, roles and nats node, kill -9 at once)"
                + (": real actors" if real_trainer else ""),
                "signal": "SIGKILL",
                "processes_killed": len(killed) + 1,
                "lease_before": holder_before,
                "lease_after": await rig.lease_holder(),
                "detect_s": round(detect_s, 3),
                "takeover_s": round(takeover_s, 3),
                "lease_ttl_s": float(HOSTS_ENV["JOYNEXUS_LEASE_TTL_S"]),
                "progress": progress,
                **a.summary(),
                **extra,
            }
        finally:
            await rig.close()


def holder_is(instance: str, state: JobState) -> Callable[[TrainingJob], bool]:
    return lambda j: j.state is state and j.holder.startswith(instance)


def synthetic_faults() -> list[Fault]:
    return [
        Fault("actor mid-lease", "synthetic-0", holds=holder_is("synthetic-0", JobState.LEASED)),
        Fault(
            "advantage mid-lease",
            "synthetic-0",
            holds=holder_is("synthetic-0", JobState.COMPUTING_ADVANTAGES),
        ),
        Fault("scheduler", "scheduler-0"),
        Fault("SIGSTOP (frozen agent)", "synthetic-0", sig=signal.SIGSTOP),
    ]


SYNTHETIC_ENV = {"JOYNEXUS_ACK_WAIT_S": "3", "JOYNEXUS_SYNTHETIC_WORK_S": "0.3"}
SYNTHETIC_EXTRA = {"scheduler": ["--lease-ttl", "2"]}


async def run_synthetic_faults(url: str, namespace: str, work_dir: Path) -> list[dict[str, Any]]:
    rig = FaultRig(
        url,
        namespace,
        ["scheduler", "synthetic"],
        out_dir=work_dir / "actor",
        extra=SYNTHETIC_EXTRA,
        env=SYNTHETIC_ENV,
        log_dir=work_dir / "logs",
    )
    await rig.start()
    results = []
    try:
        await rig.feed_synthetic()
        await rig.progressed({})
        for fault in synthetic_faults():
            r = await rig.inject(fault)
            r["progress"] = await rig.progressed(r.pop("completed_before"))
            results.append(r)
        a = await rig.drain()
        for r in results:  # the audit covers the whole run: every fault together
            r.update(a.summary())
    finally:
        await rig.close()
    return results


async def bench_faults(url: str | None = None) -> dict[str, Any]:
    """Inject each fault once; per fault: detect_s, restart_s, jobs_lost, jobs_doubled,
    partitions_leaked, releases (work redone). Starts an embedded nats-server
    without ``url`` (and then also measures a nats-server kill -9 and restart)."""
    from joynexus.ops.runtime.natsserver import EmbeddedNats

    with tempfile.TemporaryDirectory(prefix="jnx-faults-") as tmp:
        work = Path(tmp)
        server: EmbeddedNats | None = None
        if url is None:
            server = EmbeddedNats(work / "nats")
            url = server.start()
        try:
            faults = await run_synthetic_faults(url, "faults", work)
            faults.append(await custom_call_faults(url, "customfaults", work / "custom"))
            if server is not None:
                faults.append(await nats_restart_fault(server, work))
                faults.append(await host_lost_fault(work / "hosts"))
                faults.append(await host_lost_fault(work / "hosts-real", real_trainer=True))
                faults.append(await host_lost_custom(work / "hosts-custom"))
        finally:
            if server is not None:
                server.stop()
    return {"url_given": server is None, "faults": faults}


async def nats_restart_fault(server: Any, work: Path) -> dict[str, Any]:
    """kill -9 the nats-server under load, start it again on the same port and store."""
    rig = FaultRig(
        server.url,
        "natsfault",
        ["scheduler", "synthetic"],
        out_dir=work / "actor2",
        extra=SYNTHETIC_EXTRA,
        env=SYNTHETIC_ENV,
        log_dir=work / "logs2",
    )
    await rig.start()
    try:
        await rig.feed_synthetic()
        before = dict(await rig.completed())
        await rig.progressed(before)
        pids = {i: rig.pid(i) for i in rig.manager.slots}
        t0 = time.monotonic()
        server.kill()
        down_s = 1.0
        await asyncio.sleep(down_s)  # the outage itself, not a readiness wait
        await asyncio.to_thread(server.start)
        before = dict(await rig.completed())
        progress = await rig.progressed(before, within=90)
        resume_s = time.monotonic() - t0
        a = await rig.drain(within=90)
        restarts = [d for d in rig.manager.decisions if d.action in ("restart", "global_restart")]
        return {
            "fault": "nats-server kill -9 + restart",
            "signal": "SIGKILL",
            "down_s": down_s,
            "detect_s": None,
            "restart_s": round(resume_s, 3),
            "agents_restarted": len(restarts),
            "restart_reasons": [d.reason for d in restarts],
            "same_pids": all(rig.pid(i) == p for i, p in pids.items()),
            "progress": progress,
            **a.summary(),
        }
    finally:
        await rig.close()


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else None
    print(json.dumps(asyncio.run(bench_faults(url)), indent=2))


if __name__ == "__main__":
    main()
