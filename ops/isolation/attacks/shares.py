"""Attacks within quota: one tenant takes every share it is allowed, the victim must not notice.

Each stays inside the attacker's operator-set quota (rows per inference request,
requests in flight, control-plane requests in flight), so nothing is refused for
being too large; what must hold is that the victim's latency and training rate
stay near its baseline (judged by the runner: ``victim_p50_ratio``,
``victim_p99_ratio``, ``victim_train_rate_ratio``) and that the attacker was
served or told ``rate_limited``, nothing else. The floods come from a process of
their own (:mod:`..flood`), as a real tenant's client would. These are the second review's
high and medium findings (issue 24): an inference flood of 64-row requests
made the victim's ``act`` 20-160x slower, 32 concurrent ``get_policy`` slices
its control-plane calls 13-20x. See docs/ARCHITECTURE.md ("Tenants fenced by
the broker").
"""

from __future__ import annotations

import asyncio
import time

from joynexus.ops.isolation.deployment import SecuredDeployment
from joynexus.ops.isolation.flood import creds_file, run_flood
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    attacker_workload,
    cancel_quietly,
)
from joynexus.sdk import Client

#: How long each flood lasts (the review's: 12 s and 8 s).
FLOOD_S = 10.0
#: The attacker's rows per request: its quota's ``max_infer_rows``.
FLOOD_ROWS = 64
#: An instruction of 1,000 bytes (the quota allows 1,024).
LONG_INSTRUCTION = "pick " * 200


async def _wait_policy(client: Client, workload: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while await client.latest_version(workload) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the attacker's {workload} has no policy after {within_s:.0f}s")
        await asyncio.sleep(0.2)


def _judge(ck: Checks, outcomes: dict[str, int], note: str = "") -> None:
    ck.add("the attacker was served within its quota", outcomes.get("ok", 0) > 0,
           f"{outcomes}{note}")
    other = {k: v for k, v in outcomes.items() if k not in ("ok", "rate_limited")}
    ck.add("no other errors", not other, str(other))


async def _inference_flood(dep: SecuredDeployment, attacker: str, concurrency: int) -> AttackResult:
    ck = Checks()
    name = f"flood-act-{concurrency}"
    client, rec = await attacker_workload(dep, attacker, name)
    try:
        await _wait_policy(client, name)
        outcomes = await run_flood(creds_file(dep, attacker), "act", name, lanes=concurrency,
                                   seconds=FLOOD_S, rows=FLOOD_ROWS,
                                   instruction=LONG_INSTRUCTION, signature=rec.schema_signature)
        _judge(ck, outcomes, f"; {outcomes.get('ok', 0) * FLOOD_ROWS} rows in {FLOOD_S:.0f}s")
    finally:
        await cancel_quietly(client, name)
    return ck.result()


async def attack_inference_rows(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """4 concurrent ``act`` calls of 64 rows each (the rows quota) with 1,000-byte
    instructions for 10 s: the victim's 1-row ``act`` waits at most about one batch."""
    return await _inference_flood(dep, attacker, 4)


async def attack_inference_in_flight(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """32 concurrent 64-row ``act`` calls (the in-flight quota) for 10 s."""
    return await _inference_flood(dep, attacker, 32)


async def attack_control_reads(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """32 concurrent ``get_policy`` calls for a 1-byte slice of the weights, for 8 s:
    each must cost the control plane a slice, not the whole weights object, and the
    tenant only its share of the control plane's time."""
    ck = Checks()
    name = "flood-reads"
    client, _rec = await attacker_workload(dep, attacker, name)
    try:
        await _wait_policy(client, name)
        _judge(ck, await run_flood(creds_file(dep, attacker), "get_policy", name, lanes=32,
                                   seconds=8.0))
    finally:
        await cancel_quietly(client, name)
    return ck.result()


#: How long the periodic-evaluation flood trains (each new version asks for an evaluation).
EVAL_FLOOD_S = 25.0


async def attack_periodic_evals(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """An SFT workload with ``eval_every=1, eval_episodes=500, eval_videos=4,
    video_frames=200`` fed as fast as it trains (the review: 63 periodic evaluations
    in 40 s, 56 at once): at most ``max_concurrent_evals`` of the tenant's evaluations
    run at once, the rest wait, its records stay within ``max_workloads``."""
    from joynexus.ops.isolation.deployment import sft_batch, sft_spec
    from joynexus.schemas.quotas import DEFAULT_QUOTA

    ck = Checks()
    if not await dep.start_role("evaluator"):
        ck.add("an evaluator to attack", False, "an external deployment: run it there")
        return ck.result()
    client = await dep.client(attacker)
    name = "flood-evals"
    q = dep.quotas.get(attacker, {})
    most_evals = int(q.get("max_concurrent_evals", DEFAULT_QUOTA.max_concurrent_evals))
    max_records = int(q.get("max_workloads", DEFAULT_QUOTA.max_workloads))
    await client.create_workload(sft_spec(
        name, await dep.dataset(attacker), env="PickCube-v1", eval_every=1,
        eval_episodes=500, eval_videos=4, video_frames=200))
    peak, records, periodic, seed = 0, 0, 0, 5000
    try:
        stop = time.monotonic() + EVAL_FLOOD_S
        while time.monotonic() < stop:
            await client.submit_sft_batch(name, sft_batch(4, seed))
            seed += 1
            wls = [w.record for w in await client.list_workloads()]
            running = [r for r in wls if r.spec.task_type == "eval" and r.state == "active"]
            peak = max(peak, len(running))
            records = max(records, len(wls))
            periodic = max(periodic, sum(1 for r in wls if r.periodic))
        # Each version asks for one; a record exists only once the tenant's quota has
        # room for it (the rest wait in the evaluator, oldest first, none dropped).
        ck.add("periodic evaluations ran", periodic >= 1,
               f"{periodic} periodic records for v1..v{await client.latest_version(name)}")
        ck.add("at most max_concurrent_evals at once", peak <= most_evals,
               f"peak {peak} (quota {most_evals})")
        ck.add("records within max_workloads", records <= max_records,
               f"{records} (quota {max_records})")
    finally:
        await cancel_quietly(client, name)
        for w in await client.list_workloads():  # its periodic evaluations go too
            if w.record.periodic and w.record.state == "active":
                await cancel_quietly(client, w.record.spec.name)
    return ck.result()


__all__ = ["EVAL_FLOOD_S", "attack_control_reads", "attack_inference_in_flight",
           "attack_inference_rows", "attack_periodic_evals"]
