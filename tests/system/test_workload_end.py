"""Workloads that finish, and a tenant that trains again (issue 30), through the SDK
on a real deployment (a real nats-server; every role as in test_e2e, in this
process with one tiny backbone; ManiSkill on the CPU).

A workload with a completion target ends ``done`` once that many of its jobs
completed and none is in flight; its producers stop, its events end. Admission
counts per workload generation, so a tenant's second workload (or the same name
created again) trains from zero whatever the first one completed.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import test_e2e
from test_e2e import Deployment, client, wait_for

from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.broker.eventlog import JobEventLog
from joynexus.ops.admin.status import collect, render
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.jobs import JobState
from joynexus.schemas.workloads import Scheduling, WorkloadSpec
from joynexus.sdk import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
S = JobState

# The deployment of test_e2e, one tiny backbone per module; its `deployment` fixture
# takes this module's `datasets_root`.
backbone = test_e2e.backbone
deployment = test_e2e.deployment


@pytest.fixture(scope="module")
def datasets_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from joynexus.agents.envs.lerobot_data import generate_dataset

    root = tmp_path_factory.mktemp("datasets")
    generate_dataset("PickCube-v1", root / "acme" / "pick", episodes=2, obs="rgb",
                     image_size=64, seed=0)
    return root


def sft(name: str, target: int | None) -> WorkloadSpec:
    return WorkloadSpec(
        name=name, task_type="sft", dataset="pick", batch_size=8, action_horizon=2,
        scheduling=Scheduling(max_in_flight=4, completion_target=target),
    )


def rl(name: str, target: int | None) -> WorkloadSpec:
    return WorkloadSpec(
        name=name, task_type="rl", env="PickCube-v1", num_envs=2, horizon=8, action_horizon=2,
        scheduling=Scheduling(max_in_flight=2, completion_target=target),
    )


async def ended(c: Client, name: str, within: float) -> Any:
    """The workload's record once it is no longer active."""
    rec: Any = None

    async def gone() -> bool:
        nonlocal rec
        rec = (await c.get_workload(name)).record
        return rec.state != "active"

    await wait_for(gone, within, f"{name} to end")
    return rec


async def last_update_at(broker: Broker, d: Deployment, tenant: str, name: str,
                         generation: int) -> float:
    """When the generation's last job completed (its event's time)."""
    jobs = [j for j in d.sched.core.jobs.values()
            if (j.tenant_id, j.workload, j.generation, j.state) == (tenant, name, generation,
                                                                    S.COMPLETED)]
    log = JobEventLog(broker)
    return max([(await log.last(tenant, j.job_id)).event.at for j in jobs])  # type: ignore[union-attr]


def counted(d: Deployment, tenant: str, name: str, generation: int, state: JobState) -> int:
    return sum(1 for j in d.sched.core.jobs.values()
               if (j.tenant_id, j.workload, j.generation, j.state)
               == (tenant, name, generation, state))


async def test_sft_twice_in_a_row_both_train_to_their_targets_and_end_done(
    deployment: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """The issue's reproduction: `first` (target 20) then `second` (target 10, the same
    tenant and task type). Before: `first` stayed active for good and `second` made 0
    updates in 180 s. The scheduler is restarted while `second` trains."""
    d = deployment
    acme = await client(nats_server, broker, "acme")
    first = await acme.create_workload(sft("first", 20))
    seen = [ev.job.state async for ev in first.events()]  # ends by itself once `first` is done
    rec = await ended(acme, "first", 30)
    assert rec.state == "done", rec
    assert rec.result["completed"] == 20 and rec.result["last_version"] == 21
    assert await acme.latest_version("first") == 21  # 20 updates
    assert seen.count(S.COMPLETED) == 20 and S.RESERVED in seen
    assert rec.finished_at - await last_update_at(broker, d, "acme", "first", 1) < 10.0
    # A second one of the same type was refused while `first` ran; now it is taken.
    second = await acme.create_workload(sft("second", 10))

    async def some_done() -> bool:
        return counted(d, "acme", "second", 1, S.COMPLETED) >= 3

    await wait_for(some_done, 120, "second's first updates")
    await d.sched.stop()  # mid-run: the next one rebuilds the counts from the log
    d.sched = SchedulerAgent(broker, instance="sched-2", lease_ttl_s=d.lease_ttl_s,
                             expire_every_s=0.2)
    await d.sched.start()
    rec2 = await ended(acme, "second", 240)
    assert rec2.state == "done" and rec2.result["completed"] == 10, rec2
    assert await acme.latest_version("second") == 11
    assert counted(d, "acme", "second", 1, S.COMPLETED) == 10  # none trained twice
    assert [ev async for ev in second.events()]  # its events end too
    # Both producers stopped: no job of either is open, none is admitted any more.
    await asyncio.sleep(1.0)
    assert not [j for j in d.sched.core.jobs.values() if j.state not in
                (S.COMPLETED, S.DROPPED, S.FAILED)]
    states = {w.name: w.record.state for w in await acme.list_workloads()}
    assert states == {"first": "done", "second": "done"}
    # What `joynexus status` shows an operator.
    shown = await collect(broker)
    rows = {w["workload"]: w for w in shown["workloads"]}
    assert (rows["first"]["state"], rows["first"]["completed"], rows["first"]["version"]) == (
        "done", 20, 21)
    assert (rows["second"]["state"], rows["second"]["completed"]) == ("done", 10)
    assert "Workloads (newest first" in render(shown)
    await acme.close()


async def test_sft_then_rl_then_sft_again_under_the_first_name(
    deployment: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """A tenant's third workload reuses the first's name once it is done: the name's
    second generation trains from zero (its jobs carry generation 2), and the SDK's
    events of it are that generation's only."""
    d = deployment
    acme = await client(nats_server, broker, "acme")
    await acme.create_workload(sft("pick-sft", 4))
    assert (await ended(acme, "pick-sft", 120)).state == "done"
    await acme.create_workload(rl("pick-rl", 3))
    with pytest.raises(InvalidSpec, match="already runs an active rl workload"):
        await acme.create_workload(rl("other-rl", 3))
    rec = await ended(acme, "pick-rl", 400)
    assert rec.state == "done" and rec.result["completed"] == 3, rec
    assert await acme.latest_version("pick-rl") == 4
    again = await acme.create_workload(sft("pick-sft", 3))
    assert again.record.generation == 2
    rec = await ended(acme, "pick-sft", 120)
    assert rec.state == "done" and rec.generation == 2 and rec.result["completed"] == 3
    assert counted(d, "acme", "pick-sft", 1, S.COMPLETED) == 4
    assert counted(d, "acme", "pick-sft", 2, S.COMPLETED) == 3
    # The name's versions go on: 1 + 4 updates, then 3 more.
    assert await acme.latest_version("pick-sft") == 5 + 3
    events = [ev async for ev in again.events()]
    assert events and all(ev.job.generation == 2 for ev in events)
    assert sum(ev.job.state is S.COMPLETED for ev in events) == 3
    await acme.close()


async def test_two_workloads_cancelled_and_created_again_under_the_same_names(
    deployment: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """Cancel an SFT and an RL workload mid-run (no target), create both again under
    the same names with targets: each trains to its own target from zero and ends
    done; nothing of the cancelled generations is admitted or counted."""
    d = deployment
    acme = await client(nats_server, broker, "acme")
    s1 = await acme.create_workload(sft("s", None))
    await acme.create_workload(rl("r", None))

    async def both_trained() -> bool:
        return (counted(d, "acme", "s", 1, S.COMPLETED) >= 2
                and counted(d, "acme", "r", 1, S.COMPLETED) >= 1)

    await wait_for(both_trained, 300, "both workloads trained a little")
    t0 = time.monotonic()
    for name in ("s", "r"):
        assert (await acme.cancel_workload(name)).record.state == "cancelled"
    assert [ev async for ev in s1.events()]  # the cancel ended its events
    assert time.monotonic() - t0 < 60
    s2 = await acme.create_workload(sft("s", 3))
    r2 = await acme.create_workload(rl("r", 2))
    assert (s2.record.generation, r2.record.generation) == (2, 2)
    for name, target in (("s", 3), ("r", 2)):
        rec = await ended(acme, name, 400)
        assert rec.state == "done" and rec.result["completed"] == target, rec
        assert counted(d, "acme", name, 2, S.COMPLETED) == target
    # The log's newest end of each name is its second generation's; every job of the
    # cancelled generations ended (their producers failed what they held).
    ends = {e.workload: (e.generation, e.state) for e in await JobEventLog(broker).workload_ends()}
    assert ends == {"s": (2, "done"), "r": (2, "done")}
    for j in d.sched.core.jobs.values():
        if j.generation == 1:
            assert j.state in (S.COMPLETED, S.DROPPED, S.FAILED), j
    await acme.close()
