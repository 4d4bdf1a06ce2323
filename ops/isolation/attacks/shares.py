"""Attacks within quota: one tenant takes every share it is allowed, the victim must not notice.

Each stays inside the attacker's operator-set quota (rows per inference request,
requests in flight, control-plane requests in flight), so nothing is refused for
being too large; what must hold is that the victim's latency and training rate
stay near its baseline (judged by the runner: ``victim_p50_ratio``,
``victim_p99_ratio``, ``victim_train_rate_ratio``) and that the attacker was
served or told ``rate_limited``, nothing else. These are the second review's
high and medium findings (issue 24): an inference flood of 64-row requests
made the victim's ``act`` 20-160x slower, 32 concurrent ``get_policy`` slices
its control-plane calls 13-20x. See docs/ARCHITECTURE.md ("Tenants fenced by
the broker").
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from joynexus.ops.isolation.deployment import Deployment
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    _attacker_workload,
    _cancel,
    _code,
    api_raw,
    infer_raw,
    infer_request,
)
from joynexus.schemas.inference import InferError

#: How long each flood lasts (the review's: 12 s and 8 s).
FLOOD_S = 10.0
#: The attacker's rows per request: its quota's ``max_infer_rows``.
FLOOD_ROWS = 64
#: An instruction of 1,000 bytes (the quota allows 1,024).
LONG_INSTRUCTION = "pick " * 200


async def _wait_policy(client: object, workload: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while await client.latest_version(workload) < 1:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError(f"the attacker's {workload} has no policy after {within_s:.0f}s")
        await asyncio.sleep(0.2)


async def _inference_flood(dep: Deployment, attacker: str, concurrency: int) -> AttackResult:
    ck = Checks()
    name = f"flood-act-{concurrency}"
    client, rec = await _attacker_workload(dep, attacker, name)
    try:
        await _wait_policy(client, name)
        payload = infer_request(attacker, name, rec.schema_signature, FLOOD_ROWS,
                                instruction=LONG_INSTRUCTION)
        outcomes: Counter[str] = Counter()
        rows_served = 0
        stop = time.monotonic() + FLOOD_S

        async def one_lane() -> None:
            nonlocal rows_served
            while time.monotonic() < stop:
                try:
                    reply = await infer_raw(client, payload, timeout_s=30.0)
                except Exception as e:
                    outcomes[f"raised {_code(e)}"] += 1
                    await asyncio.sleep(0.05)
                    continue
                if not isinstance(reply, InferError):
                    outcomes["ok"] += 1
                    rows_served += FLOOD_ROWS
                else:
                    outcomes[reply.code] += 1
                    if reply.code == "rate_limited":
                        await asyncio.sleep(0.05)

        await asyncio.gather(*(one_lane() for _ in range(concurrency)))
        ck.add("the attacker was served within its quota", outcomes["ok"] > 0,
               f"{dict(outcomes)}; {rows_served} rows in {FLOOD_S:.0f}s")
        other = {k: v for k, v in outcomes.items() if k not in ("ok", "rate_limited")}
        ck.add("no other errors", not other, str(other))
    finally:
        await _cancel(client, name)
    return ck.result()


async def attack_inference_rows(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """4 concurrent ``act`` calls of 64 rows each (the rows quota) with 1,000-byte
    instructions for 10 s: the victim's 1-row ``act`` waits at most about one batch."""
    return await _inference_flood(dep, attacker, 4)


async def attack_inference_in_flight(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """32 concurrent 64-row ``act`` calls (the in-flight quota) for 10 s."""
    return await _inference_flood(dep, attacker, 32)


async def attack_control_reads(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """32 concurrent ``get_policy`` calls for a 1-byte slice of the weights, for 8 s:
    each must cost the control plane a slice, not the whole weights object."""
    ck = Checks()
    name = "flood-reads"
    client, _rec = await _attacker_workload(dep, attacker, name)
    try:
        await _wait_policy(client, name)
        outcomes: Counter[str] = Counter()
        stop = time.monotonic() + 8.0

        async def one_lane() -> None:
            while time.monotonic() < stop:
                try:
                    await api_raw(client, "get_policy", {"workload": name, "limit": 1},
                                  timeout_s=30.0)
                    outcomes["ok"] += 1
                except Exception as e:
                    outcomes[_code(e)] += 1
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(one_lane() for _ in range(32)))
        ck.add("the attacker was served", outcomes["ok"] > 0, str(dict(outcomes)))
        other = {k: v for k, v in outcomes.items() if k not in ("ok", "rate_limited")}
        ck.add("no other errors", not other, str(other))
    finally:
        await _cancel(client, name)
    return ck.result()


__all__ = ["attack_control_reads", "attack_inference_in_flight", "attack_inference_rows"]
