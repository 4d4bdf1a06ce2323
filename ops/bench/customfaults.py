"""Chaos drills for a training client (issue 28): a fixed program of Tinker-style
calls on a ``task_type="custom"`` workload, run once fault-free (the reference)
and once under faults, then audited.

The program (:func:`program`): ``ROUNDS`` rounds of ``forward``,
``forward_backward`` (``bc_mse``), ``forward_backward_custom`` (an MSE written
here) and ``optim_step``, two rounds in flight at a time. The drill
(:func:`custom_call_faults`) runs it on real role processes (scheduler, control,
actor) under the rig's health manager and SIGKILLs the actor while it holds a
call, once for each kind of call: each kill catches whichever kind not caught
yet the actor is found holding (a fixed order once flaked: every call of the
wanted op had already completed). A hold is confirmed by freezing the actor
(SIGSTOP) and seeing its job still leased before the kill. The control plane
is SIGKILLed once mid-program, with calls in flight (handed in, results not
yet answered; the client asks again across the restart). The host-loss variant
(:func:`host_lost_custom`) kills one of two hosts (supervisor, roles and its
nats node) under a running client.

The audit (:func:`call_audit`): every call's result (loss, metrics, outputs,
version) and the final weights against the reference (max abs differences),
the job log (nothing lost, completed twice or leaked, no call failed) and the
tenant's committed call log (every seq applied once, in order).
See docs/ARCHITECTURE.md, "The training client".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.ops.bench.faultrig import Fault, FaultRig, wait_until
from joynexus.schemas.jobs import JobState, TrainingJob
from joynexus.schemas.samples import ACTIONS_FIELD, STATE_FIELD, image_field
from joynexus.schemas.workloads import Scheduling, WorkloadSpec
from joynexus.sdk import Client

ROUNDS = 12
#: The job op a kind of call shows while the actor holds it.
KINDS = {"forward": "forward", "forward_backward": "forward_backward",
         "backward": "forward_backward_custom", "optim_step": "optim_step"}
WORKLOAD = "algo"
ENV = {"JOYNEXUS_ACK_WAIT_S": "3"}
EXTRA = {"scheduler": ["--lease-ttl", "2"]}


def spec() -> WorkloadSpec:
    return WorkloadSpec(name=WORKLOAD, task_type="custom", env="PushCube-v1", action_horizon=2,
                        head_hidden=16, seed=0, scheduling=Scheduling(max_in_flight=4))


def batches(schema: Any, rounds: int, rows: int = 4, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    h, w = schema.image_hw
    out = []
    for _ in range(rounds):
        b = {image_field(c): rng.integers(0, 256, (rows, 3, h, w), dtype=np.uint8)
             for c in schema.camera_slots}
        b[STATE_FIELD] = rng.normal(size=(rows, schema.state_dim)).astype(np.float32)
        b[ACTIONS_FIELD] = rng.uniform(-1, 1, (rows, schema.action_horizon, schema.action_dim)).astype(np.float32)
        out.append(b)
    return out


def mse(outputs: dict[str, Any], batch: dict[str, Any]) -> Any:
    """The client's own loss (runs here, never on the service)."""
    return ((outputs["mean"] - batch[ACTIONS_FIELD]) ** 2).mean()


async def program(client: Client, rounds: int = ROUNDS, between: Any = None) -> list[Any]:
    """The fixed program; every call's result, in the order made. ``between(r, tc)``
    runs after round ``r``'s calls are made (the drill injects faults there)."""
    tc = await client.training_client(WORKLOAD)
    futs: list[asyncio.Future[Any]] = []
    for r, batch in enumerate(batches(tc.schema, rounds)):
        futs += [tc.forward(batch), tc.forward_backward(batch, loss="bc_mse"),
                 tc.forward_backward_custom(batch, mse), tc.optim_step(learning_rate=1e-2)]
        if between is not None:
            await between(r, tc, futs)
        if r >= 1:  # two rounds in flight
            await asyncio.gather(*futs[-8:-4])
    out = list(await asyncio.gather(*futs))
    await tc.close()
    return out


def sender_idle(tc: Any) -> bool:
    """Every call made so far is handed in (no request of the client's in flight but
    its results' reads)."""
    return tc._queue.empty() and (tc._sender is None or tc._sender.done())


def compare(ref: list[Any], got: list[Any]) -> dict[str, Any]:
    """Max abs differences of every call's result against the reference."""
    d: dict[str, float] = {"outputs": 0.0, "loss": 0.0, "metrics": 0.0}
    versions_equal = len(ref) == len(got)
    for a, b in zip(ref, got, strict=False):
        if "mean" in a:  # forward
            d["outputs"] = max(d["outputs"], *(float(np.abs(a[k] - b[k]).max()) for k in a))
            continue
        if "loss" in a:
            d["loss"] = max(d["loss"], abs(a["loss"] - b["loss"]))
        if "version" in a:
            versions_equal &= a["version"] == b["version"]
        if set(a["metrics"]) != set(b["metrics"]):
            d["metrics"] = float("inf")
        for k in a["metrics"]:
            d["metrics"] = max(d["metrics"], abs(a["metrics"][k] - b["metrics"].get(k, np.inf)))
    return {"max_abs_diff": d, "versions_equal": versions_equal, "calls": len(got)}


async def weights(b: Any, tenant: str) -> tuple[int, Any]:
    import torch

    from joynexus.agents.models.policyio import PolicyStore

    store = PolicyStore(b)
    rec = await store.latest(tenant, WORKLOAD)
    module = await store.load_module(rec)
    return rec.version, torch.cat([p.detach().reshape(-1) for p in module.head.parameters()])


async def call_audit(rig: FaultRig, tenant: str) -> dict[str, Any]:
    """The tenant's committed call log and its job log: every seq applied once, in
    order; every call job completed once; none failed, lost or leaked."""
    from joynexus.agents.actor.state import TenantState
    from joynexus.broker.trainerstate import TrainerStateStore
    from joynexus.schemas.inference import decode_msgpack
    from joynexus.schemas.training import TrainResult

    jobs = [j for j in await rig.sched.list_jobs(tenant) if j.task_type == "custom"]
    loaded = await TrainerStateStore(rig.b).load(tenant, WORKLOAD)
    assert loaded is not None, f"{tenant} committed nothing"
    module, _, calls = await asyncio.to_thread(TenantState.unpack, loaded.data)
    results = [decode_msgpack(v, TrainResult, what="call result") for v in calls.results.values()]
    seqs = [r.seq for r in results]
    by_state: dict[str, int] = {}
    for j in jobs:
        by_state[j.state.value] = by_state.get(j.state.value, 0) + 1
    return {
        "call_jobs": len(jobs),
        "call_states": by_state,
        "last_seq": calls.last_seq,
        "applied_once_in_order": seqs == list(range(1, len(jobs) + 1)) and calls.last_seq == len(jobs),
        "results_by_job": sorted(r.job_id for r in results) == sorted(j.job_id for j in jobs),
        "errors": [r.error.message for r in results if r.error is not None],
        "version": module.version,
    }


async def catch_holding(rig: FaultRig, tenant: str, caught: dict[str, dict[str, Any]],
                        instance: str = "actor-0", within: float = 120.0) -> dict[str, Any]:
    """Wait until ``instance`` holds a call of a kind not in ``caught``; freeze it,
    confirm the job is still leased to it, SIGKILL it and wait for its restart."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        held = [j for j in await rig.sched.list_jobs(tenant, states=[JobState.LEASED])
                if j.holder.startswith(instance) and _kind(j) not in caught]
        if not held:
            await asyncio.sleep(0.02)
            continue
        job = held[0]
        pid = rig.pid(instance)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(0.1)  # whatever it had sent lands first
        now = await rig.sched.get_job(job.job_id)
        if now.state is not JobState.LEASED or now.attempt != job.attempt or not now.holder.startswith(instance):
            os.kill(pid, signal.SIGCONT)
            continue
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        async def restarted(old: int = pid) -> bool:
            s = rig.manager.core.slots[instance]
            return s.state == "running" and s.pid not in (None, old)

        await wait_until(restarted, within, f"{instance} restarted", every=0.05)
        r = {"job_id": job.job_id, "seq": int(job.metadata.extra.get("seq", "0")),
             "attempt": job.attempt, "restart_s": round(time.monotonic() - t0, 3)}
        caught[_kind(job)] = r
        return r
    raise TimeoutError(f"{instance} never held a call of a kind not caught yet ({sorted(caught)})")


def _kind(job: TrainingJob) -> str:
    return KINDS.get(str(job.metadata.extra.get("op", "")), "other")


async def custom_call_faults(url: str, namespace: str, work: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    """The drill (see the module): the reference, then the run under faults; the audit."""
    rig = FaultRig(url, namespace, ["scheduler", "control", "actor"], out_dir=work / "actor",
                   extra=EXTRA, env=ENV, log_dir=work / "logs",
                   tenants=(("ref", "custom"), ("drill", "custom")))
    await rig.start()
    clients: list[Client] = []
    try:
        for tenant in ("ref", "drill"):
            c = await Client.connect(url, tenant=tenant, namespace=namespace, timeout_s=5.0)
            clients.append(c)
            await c.create_workload(spec())
        t0 = time.monotonic()
        ref = await program(clients[0], rounds)
        ref_s = time.monotonic() - t0
        caught: dict[str, dict[str, Any]] = {}
        control: dict[str, Any] = {}

        async def faults() -> None:
            while len(caught) < len(KINDS):
                await catch_holding(rig, "drill", caught)

        async def between(r: int, tc: Any, futs: list[Any]) -> None:
            if r != rounds // 2:
                return
            await wait_until(lambda: _true(sender_idle(tc)), 60, "every call handed in", every=0.02)
            control["calls_in_flight"] = sum(not f.done() for f in futs)
            control.update(await rig.inject(Fault("control mid-program", "control-0")))
            control.pop("completed_before", None)

        t0 = time.monotonic()
        killer = asyncio.create_task(faults())
        got = await program(clients[1], rounds, between)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(killer), 1.0)
        killer.cancel()
        drill_s = time.monotonic() - t0
        a = await rig.drain(within=60)
        (vr, wr), (vd, wd) = await weights(rig.b, "ref"), await weights(rig.b, "drill")
        return {
            "fault": "actor SIGKILLed holding each kind of call once, control plane once (custom workload)",
            "signal": "SIGKILL",
            "rounds": rounds,
            "reference_s": round(ref_s, 3),
            "drill_s": round(drill_s, 3),
            "actor_kills": caught,
            "kinds_caught": sorted(caught),
            "control_kill": control,
            **compare(ref, got),
            "weights_max_abs_diff": float((wr - wd).abs().max()),
            "final_versions": [vr, vd],
            "calls": await call_audit(rig, "drill"),
            "restarts": {i: s.total_restarts for i, s in rig.manager.core.slots.items()},
            **a.summary(),
        }
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        await rig.close()


async def _true(v: bool) -> bool:
    return v


async def host_lost_custom(work: Path, rounds: int = 8) -> dict[str, Any]:
    """Two hosts (scheduler, control, actor each) on a 3-node cluster; a training client
    runs the program; host a (supervisor, roles and its node) is killed at once
    mid-program, with calls in flight; each call applied once, in order."""
    from joynexus.ops.bench.hostsrig import HOSTS_ENV, HostsRig
    from joynexus.ops.runtime.natsserver import local_cluster

    roles = ["scheduler", "control", "actor"]
    with local_cluster(work / "cluster") as nodes:
        rig = HostsRig("hostcustom", {"a": (nodes[0].url, roles), "b": (nodes[1].url, roles)},
                       rig_urls=[nodes[1].url, nodes[2].url], work=work, env=HOSTS_ENV,
                       tenants=(("drill", "custom"),))
        client: Client | None = None
        try:
            await rig.start()
            client = await Client.connect(rig.rig_urls, tenant="drill", namespace="hostcustom", timeout_s=5.0)
            await client.create_workload(spec())
            kill: dict[str, Any] = {}

            async def between(r: int, tc: Any, futs: list[Any]) -> None:
                if r != rounds // 2:
                    return
                await wait_until(lambda: _true(sender_idle(tc)), 60, "every call handed in", every=0.02)
                held = [j.job_id for j in await rig.sched.list_jobs("drill", states=[JobState.LEASED])
                        if j.holder.startswith("actor-a")]
                kill["calls_in_flight"] = sum(not f.done() for f in futs)
                kill["held_by_host_a"] = len(held)
                t0 = time.monotonic()
                kill["processes_killed"] = len(await rig.kill_host("a")) + 1
                nodes[0].kill()
                await wait_until(lambda: rig.lease_holder("b/"), 60, "host b's scheduler holding the lease")
                kill["detect_s"] = round(time.monotonic() - t0, 3)
                kill["t0"] = t0

            t0 = time.monotonic()
            got = await program(client, rounds, between)
            took = time.monotonic() - t0
            takeover_s = round(time.monotonic() - kill.pop("t0"), 3)
            a = await rig.drain(within=60)
            return {
                "fault": "host lost under a training client (supervisor, roles, nats node; kill -9)",
                "signal": "SIGKILL",
                "rounds": rounds,
                "program_s": round(took, 3),
                **kill,
                "kill_to_program_end_s": takeover_s,
                "versions": [r["version"] for r in got if "version" in r and "mean" not in r],
                "calls": await call_audit(rig, "drill"),
                **a.summary(),
            }
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
            await rig.close()
