"""Attacks by volume: a request flood and megabyte strings where names go.

What one tenant sends must cost the server bounded resources (consumers,
connections, metrics stream, security events, log bytes), refused past a
limit rather than served at everyone's expense. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec

from joynexus.ops.isolation.deployment import (
    MODEL,
    MiB,
    SecuredDeployment,
)
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    attacker_workload,
    cancel_quietly,
    infer_request,
    short_error,
)
from joynexus.ops.isolation.victim import CALL_TIMEOUT_S
from joynexus.schemas.base import decode
from joynexus.schemas.workloads import (
    ApiReply,
)


# -- 3. per-call server resources ----------------------------------------------
async def attack_request_flood(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """2,000 fire-and-forget list_workloads / failing create_workload requests."""
    n, ck = dep.names, Checks()
    await dep.client(attacker)
    raw = await dep.raw(attacker)
    codes: dict[str, int] = {}
    replies = 0
    done = asyncio.Event()
    total = 2000

    async def on_reply(msg: Any) -> None:
        nonlocal replies
        replies += 1
        try:
            r = decode(msg.data, ApiReply)
            code = r.error.code if r.error else "ok"
        except Exception:
            code = "undecodable"
        codes[code] = codes.get(code, 0) + 1
        if replies >= total:
            done.set()

    prefix = n.inbox_prefix(attacker)
    log0 = dep.server_log()
    await raw.nc.subscribe(f"{prefix}.flood.>", cb=on_reply, pending_msgs_limit=100_000)
    start = await dep.consumers()
    peak = start
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            with contextlib.suppress(Exception):
                peak = max(peak, await dep.consumers())
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    bad_create = msgspec.json.encode(
        {"spec": {"name": "flood", "task_type": "sft", "dataset": "no-such-dataset"}}
    )
    try:
        for i in range(total):
            verb, body = ("list_workloads", b"{}") if i % 2 else ("create_workload", bad_create)
            await raw.nc.publish(n.api(attacker, verb), body, reply=f"{prefix}.flood.{i}")
        await raw.nc.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 45)
        await asyncio.sleep(0.5)
    finally:
        sampling = False
        await sampler
        await raw.close()
    ck.add("consumers bounded", peak - start < 50, f"{start} -> peak {peak}")
    ck.add("excess refused as rate_limited", codes.get("rate_limited", 0) > 0,
           f"replies {replies}/{total}: {dict(sorted(codes.items()))}")
    other = {k: v for k, v in codes.items() if k not in ("ok", "rate_limited", "invalid_spec")}
    ck.add("no other errors", not other, str(other))
    cut = dep.cut_connections(log0)
    ck.add("no agent connection cut off", not cut, " | ".join(c[-160:] for c in cut[:2]))
    vclient = await dep.client(victim)
    try:
        await asyncio.wait_for(vclient.list_workloads(), CALL_TIMEOUT_S)
        ck.add("bolt's calls work after", True)
    except Exception as e:
        ck.add("bolt's calls work after", False, short_error(e))
    return ck.result()


# -- 7. bounded strings ---------------------------------------------------------
async def attack_long_strings(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """200 requests carrying 1 MB strings where names go (a claimed tenant, a
    workload name, a job id, a subject token): the metrics stream, the security
    events and the log grow by little."""
    n, ck = dep.names, Checks()
    client, rec = await attacker_workload(dep, attacker, "long-probe")
    big = "x" * MiB
    bytes0, seq0, logs0 = await dep.metrics_bytes(), await dep.metrics_seq(), dep.log_bytes.bytes
    log0 = dep.server_log()
    claim = infer_request(attacker, "long-probe", rec.schema_signature, 1, claim=victim + big)
    try:
        raw = await dep.raw(attacker)
        try:
            for i in range(190):
                if i % 3 == 0:
                    await raw.nc.publish(n.infer(MODEL, attacker), claim,
                                         reply=raw.nc.new_inbox())
                elif i % 3 == 1:
                    await raw.nc.publish(n.api(attacker, "get_workload"),
                                         msgspec.json.encode({"name": big}),
                                         reply=raw.nc.new_inbox())
                else:
                    await raw.nc.publish(n.api(attacker, "close_job"),
                                         msgspec.json.encode({"job_id": big}),
                                         reply=raw.nc.new_inbox())
                if i % 20 == 19:
                    await raw.nc.flush()
            await raw.nc.flush()
        finally:
            await raw.close()
        refused_subjects = 0
        for _ in range(10):  # a 1 MB subject token: one connection each (the server drops it)
            try:
                r = await dep.raw(attacker)
                with contextlib.suppress(Exception):
                    await r.nc.publish(n.api(attacker, "v" * MiB), b"{}")
                    await r.nc.flush(timeout=2)
                refused_subjects += 1
                await r.close()
            except Exception:
                refused_subjects += 1
        await asyncio.sleep(3.0)
        grew = await dep.metrics_bytes() - bytes0
        ck.add("metrics stream grew < 2 MB", grew < 2 * MiB, f"+{grew / 1024:.0f} KiB")
        events = await dep.security_events(attacker, seq0)
        biggest = max((e["_bytes"] for e in events), default=0)
        ck.add("security events bounded", biggest < 16 * 1024,
               f"{len(events)} events, largest {biggest} B")
        logs = dep.log_bytes.bytes - logs0
        ck.add("log grew < 2 MB", logs < 2 * MiB, f"+{logs / 1024:.0f} KiB")
        vev = await dep.security_events(victim, seq0)
        ck.add("nothing filed under bolt", not vev, f"{len(vev)} events")
        cut = dep.cut_connections(log0)
        ck.add("no agent connection cut off", not cut, " | ".join(c[-160:] for c in cut[:2]))
    finally:
        await cancel_quietly(client, "long-probe")
    return ck.result()
