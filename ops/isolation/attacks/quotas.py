"""Attacks past the bounds: priority, in-flight jobs, episodes, horizon, inference size, queue bytes.

Every number a tenant sets is bounded by its operator-set quota, and a refusal
comes quickly; the victim's own work goes on meanwhile. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
from typing import Any

from joynexus.ops.isolation.deployment import (
    VICTIM_WORKLOAD,
    MiB,
    SecuredDeployment,
    sft_batch,
)
from joynexus.ops.isolation.flood import creds_file, run_flood
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    api_raw,
    cancel_quietly,
    refused,
    short_error,
)
from joynexus.schemas.errors import JoyNexusError


# -- 6. quotas and operator bounds ---------------------------------------------------
async def attack_quotas(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """Training Queue bytes, priority, max_in_flight, episodes, action_horizon,
    inference rows and instruction size: past every bound, refused quickly."""
    from joynexus.schemas.quotas import PRIORITY_CLASSES

    ck = Checks()
    client = await dep.client(attacker)
    ds = await dep.dataset(attacker)
    base = {"task_type": "sft", "dataset": ds, "source": "tenant", "action_horizon": 2}
    quota_codes = ("quota_exceeded", "invalid_spec")

    async def create(name: str, **over: Any) -> Any:
        spec = {"name": name, **base, **over}
        return await api_raw(client, "create_workload", {"spec": spec})

    # priority: not the tenant's to set (refused, or replaced by its class's value)
    try:
        await create("q-prio", scheduling={"priority": 10**18})
        pol = [p for p in (await _sched_snapshot(dep)).policies
               if p.tenant_id == attacker and p.task_type == "sft"]
        want = PRIORITY_CLASSES["standard"]
        ck.add("priority 10**18 not honoured", bool(pol) and pol[0].priority == want,
               f"effective {pol[0].priority if pol else '?'} (class value {want})")
    except JoyNexusError as e:
        ck.add("priority 10**18 not honoured", e.code in quota_codes, short_error(e, 100))
    await cancel_quietly(client, "q-prio")
    for what, name, over, mention in (
        ("max_in_flight=10**9", "q-inflight", {"scheduling": {"max_in_flight": 10**9}},
         "max_in_flight"),
        ("action_horizon=250000", "q-horizon", {"action_horizon": 250_000}, "action_horizon"),
    ):
        ok, note = await refused(create(name, **over), quota_codes, mention=mention,
                                 within_s=5.0)
        ck.add(f"{what} refused", ok, note)
        await cancel_quietly(client, name)
    # evaluation episodes (of a policy acme owns)
    await create("q-base")
    await cancel_quietly(client, "q-base")
    ok, note = await refused(api_raw(client, "create_workload", {"spec": {
        "name": "q-eval", "task_type": "eval", "env": "PickCube-v1",
        "init_from_workload": "q-base", "init_from": 1, "episodes": 10**9}}),
        quota_codes, mention="episodes", within_s=20.0)
    ck.add("episodes=10**9 refused", ok, note)
    await cancel_quietly(client, "q-eval")
    # inference: rows and instruction bytes per request, from a process of the
    # attacker's own (building 3 x 2 requests near max_payload is its cost: ..flood)
    rec = (await create("q-infer")).workload
    got = await run_flood(creds_file(dep, attacker), "oversize", "q-infer", seconds=60,
                          signature=rec.schema_signature)
    for what, label in (("rows", f"inference with {got.get('rows_asked')} rows"),
                        ("instruction", "instruction near max_payload")):
        codes = got.get(what, [])
        ok = len(codes) == 3 and all(c in ("quota_exceeded", "invalid_spec", "payload_too_large")
                                     for c in codes)
        ck.add(f"{label} refused", ok and got.get(f"{what}_s", 99) < 5.0,
               f"{codes} in {got.get(f'{what}_s')}s")
    await cancel_quietly(client, "q-infer")
    # Training Queue bytes: open jobs (as many as admission lets in flight) and fill
    # them until the quota says no, from a process of the attacker's own (the encoding
    # of 256 MiB is the attacker's cost, not this process's: see ..flood).
    await create("q-tq", scheduling={"max_in_flight": 16})
    quota = int(dep.quotas.get(attacker, {}).get("tq_bytes", 256 * MiB))
    try:
        counts = await run_flood(creds_file(dep, attacker), "tq", "q-tq", seconds=90,
                                 limit_mib=quota // MiB + 32)  # a few batches past it
        ck.add("TQ bytes past the quota refused", counts.get("quota_exceeded", 0) == 1,
               f"pushed {counts.get('pushed_mib', 0)} MiB (quota {quota / MiB:.0f} MiB); "
               f"{ {k: v for k, v in counts.items() if k != 'pushed_mib'} }")
        vclient = await dep.client(victim)
        try:
            await asyncio.wait_for(vclient.submit_sft_batch(VICTIM_WORKLOAD, sft_batch(4, 77)),
                                   30)
            ck.add("bolt's submit succeeds meanwhile", True)
        except Exception as e:
            ck.add("bolt's submit succeeds meanwhile", False, short_error(e))
    finally:
        await cancel_quietly(client, "q-tq")
    return ck.result()


async def _sched_snapshot(dep: SecuredDeployment) -> Any:
    from joynexus.agents.scheduler_client import SchedulerClient

    b = dep.service or dep.admin
    return await SchedulerClient(b, by="iso").snapshot()
