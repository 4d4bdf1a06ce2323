"""Attacks with data: non-finite batches at the door and inside a step, another tenant's dataset.

A tenant's bad rows must fail at the door, or fail only its own job inside a
grouped step (never restart the actor), and a dataset path must resolve only
inside the tenant's own space, with one refusal that reveals nothing. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from joynexus.ops.isolation.deployment import (
    DATASET,
    SecuredDeployment,
    sft_batch,
    sft_spec,
)
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    api_raw,
    attacker_workload,
    cancel_quietly,
    refused,
    short_error,
)
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.jobs import JobState
from joynexus.schemas.workloads import (
    CloseJob,
    OpenJob,
    PutData,
)


# -- 4. NaN batches --------------------------------------------------------------
def _nan_batches() -> dict[str, dict[str, np.ndarray]]:
    nan_actions = sft_batch(4, 7)
    nan_actions["actions"][1, 0, 2] = np.nan
    inf_state = sft_batch(4, 8)
    inf_state["obs_state"][0, 3] = np.inf
    huge = sft_batch(4, 9)
    huge["actions"][:] = np.float32(3e38)
    return {"nan actions": nan_actions, "inf state": inf_state, "3e38 actions": huge}


async def attack_nan_batch(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """SFT batches with NaN / inf / overflowing values, through the SDK and by hand."""
    from joynexus.schemas.inference import TensorBytes

    ck = Checks()
    restarts0 = dep.actor_restarts
    client, _ = await attacker_workload(dep, attacker, "nan-sft")
    try:
        batches = _nan_batches()
        ok, note = await refused(client.submit_sft_batch("nan-sft", batches["nan actions"]),
                                 ("invalid_spec",))
        ck.add("SDK submit refused", ok, note)
        for what, b in batches.items():  # past any client-side check: the door itself
            if what == "3e38 actions":
                continue  # finite: whether it is in range is the schema's call (below)
            opened = await client._api("open_job", OpenJob(workload="nan-sft", sample_count=4))
            if opened.job is None:
                ck.add(f"{what}: open_job", False, opened.refused)
                continue
            fields = {k: TensorBytes.from_array(v) for k, v in b.items()}
            ok, note = await refused(
                client._api("put_data", PutData(job_id=opened.job.job_id, fields=fields),
                            binary=True), ("invalid_spec",))
            ck.add(f"{what}: put_data refused", ok, note)
            with contextlib.suppress(Exception):
                await client._api("close_job", CloseJob(job_id=opened.job.job_id))
        await asyncio.sleep(2.0)
        if dep.service is not None:
            from joynexus.agents.scheduler_client import SchedulerClient

            jobs = await SchedulerClient(dep.service, by="iso").list_jobs(
                attacker, workload="nan-sft")
            trained = [j.job_id for j in jobs if j.state in (
                JobState.READY, JobState.LEASED, JobState.COMPLETED)]
            ck.add("no NaN job reached training", not trained,
                   f"{len(jobs)} jobs: {sorted({j.state.value for j in jobs})}")
        if restarts0 is not None:
            ck.add("actor not restarted", dep.actor_restarts == restarts0,
                   f"restarts {restarts0} -> {dep.actor_restarts}: {dep.actor_errors[-1:]}")
    finally:
        await cancel_quietly(client, "nan-sft")
    return ck.result()


async def attack_nan_in_step(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """Rows that passed the door and still break a grouped step (written into the
    Training Queue by the service itself, as a producer bug would): only the
    attacker's job fails, with the reason; the actor goes on."""
    from joynexus.agents.scheduler_client import SchedulerClient
    from joynexus.broker.tq import TrainingQueue
    from joynexus.schemas.jobs import JobMetadata

    ck = Checks()
    assert dep.service is not None
    restarts0 = dep.actor_restarts
    client, rec = await attacker_workload(dep, attacker, "nan-step")
    sched = SchedulerClient(dep.service, by="iso-producer")
    try:
        job = await sched.reserve(
            attacker, "sft", workload="nan-step", sample_count=4, producer_role="iso",
            metadata=JobMetadata(schema_signature=rec.schema_signature,
                                 extra={"instruction": "pick the cube"}),
        )
        if job is None:
            ck.add("reserve", False, sched.last_refusal)
            return ck.result()
        data = sft_batch(4, 11)
        data["actions"][:] = np.nan
        await TrainingQueue(dep.service).async_put(data, tenant_id=attacker,
                                                   partition_id=job.partition_id)
        await sched.mark(job.job_id, JobState.READY)
        deadline = time.monotonic() + 40
        state = job
        while time.monotonic() < deadline:
            state = await sched.get_job(job.job_id)
            if state.state in (JobState.FAILED, JobState.COMPLETED, JobState.DROPPED):
                break
            await asyncio.sleep(0.3)
        ck.add("the attacker's job failed", state.state is JobState.FAILED,
               f"{state.state.value}: {state.reason[:100]}")
        ck.add("actor not restarted", dep.actor_restarts == restarts0,
               f"restarts {restarts0} -> {dep.actor_restarts}: {dep.actor_errors[-1:]}")
        v = await client.latest_version("nan-step")
        ck.add("no NaN version published", v == 1, f"latest v{v}")
    finally:
        await cancel_quietly(client, "nan-step")
    return ck.result()


# -- 5. another tenant's dataset --------------------------------------------------
async def attack_foreign_dataset(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """SFT workloads naming the victim's dataset (relative, absolute, via symlinks),
    system files and missing paths: one refusal, revealing nothing."""
    ck = Checks()
    client = await dep.client(attacker)
    own = await dep.dataset(attacker)
    await dep.dataset(victim)
    root = dep.datasets_root.resolve()
    vpath = root / victim / DATASET
    space = root / attacker
    with contextlib.suppress(FileExistsError):
        (space / "link").symlink_to(vpath, target_is_directory=True)
    (space / "meta-link").mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (space / "meta-link" / "meta").symlink_to(vpath / "meta", target_is_directory=True)
    try:  # a control: acme's own dataset is accepted (so the refusals are about paths)
        await client.create_workload(sft_spec("ds-own", own))
        ck.add("own dataset accepted", True)
    except Exception as e:
        ck.add("own dataset accepted", False, short_error(e))
    await cancel_quietly(client, "ds-own")
    names = [f"../{victim}/{DATASET}", str(vpath), f"../{victim}/nothere", "/etc/passwd",
             "/nonexistent-jnx/x", "link", "meta-link", f"{DATASET}/../../{victim}/{DATASET}"]
    messages: dict[str, str] = {}
    for i, name in enumerate(names):
        body = {"spec": {"name": f"ds-{i}", "task_type": "sft", "dataset": name,
                         "source": "tenant", "action_horizon": 2}}
        try:
            await asyncio.wait_for(api_raw(client, "create_workload", body), 20)
            messages[name] = "ACCEPTED"
            await cancel_quietly(client, f"ds-{i}")
        except JoyNexusError as e:
            messages[name] = f"{e.code}: {e}".replace(name, "<NAME>")
        except Exception as e:
            messages[name] = f"unexpected {short_error(e)}"
    distinct = set(messages.values())
    ck.add("all refused", all(m.startswith("invalid_spec") for m in messages.values()),
           "; ".join(f"{k}: {v[:60]}" for k, v in messages.items()
                     if not v.startswith("invalid_spec")))
    ck.add("one message for all", len(distinct) == 1, f"{len(distinct)} distinct: "
           + " | ".join(sorted(m[:90] for m in distinct)))
    leaks = [m for m in distinct if str(root) in m or victim in m or "root:" in m]
    ck.add("no path, file content or tenant of bolt's shown", not leaks,
           " | ".join(m[:120] for m in leaks))
    return ck.result()
