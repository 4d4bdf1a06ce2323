"""Attacks by volume: a request flood and megabyte strings where names go.

What one tenant sends must cost the server bounded resources (consumers,
connections, metrics stream, security events, log bytes), refused past a
limit rather than served at everyone's expense. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib

from joynexus.ops.isolation.deployment import (
    MiB,
    SecuredDeployment,
)
from joynexus.ops.isolation.flood import creds_file, run_flood
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    attacker_workload,
    cancel_quietly,
    short_error,
)
from joynexus.ops.isolation.victim import CALL_TIMEOUT_S
from joynexus.sdk import Client


async def victim_calls_work(dep: SecuredDeployment, victim: str, ck: Checks) -> None:
    """The victim's next call is answered in time (a check of ``ck``)."""
    vclient = await dep.client(victim)
    try:
        await asyncio.wait_for(vclient.list_workloads(), CALL_TIMEOUT_S)
        ck.add("bolt's calls work after", True)
    except Exception as e:
        ck.add("bolt's calls work after", False, short_error(e))


# -- 3. per-call server resources ----------------------------------------------
async def attack_request_flood(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """2,000 fire-and-forget list_workloads / failing create_workload requests."""
    ck = Checks()
    await dep.client(attacker)
    total = 2000
    log0 = dep.server_log()
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
    try:  # from a process of the attacker's own (..flood), as a tenant's client would
        codes = await run_flood(creds_file(dep, attacker), "burst", "", seconds=50)
    finally:
        sampling = False
        await sampler
    replies = codes.pop("replies", 0)
    ck.add("consumers bounded", peak - start < 50, f"{start} -> peak {peak}")
    ck.add("excess refused as rate_limited", codes.get("rate_limited", 0) > 0,
           f"replies {replies}/{total}: {dict(sorted(codes.items()))}")
    other = {k: v for k, v in codes.items() if k not in ("ok", "rate_limited", "invalid_spec")}
    ck.add("no other errors", not other, str(other))
    cut = dep.cut_connections(log0)
    ck.add("no agent connection cut off", not cut, " | ".join(c[-160:] for c in cut[:2]))
    await victim_calls_work(dep, victim, ck)
    return ck.result()


async def attack_open_loop_flood(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """Control-plane requests as fast as one connection sends, never reading a reply,
    for 8 s: the control plane pauses the attacker (the penalty box), the server closes
    its connection and drops the rest; the victim's calls go on; after the pause the
    attacker connects again."""
    ck = Checks()
    seq0 = await dep.metrics_seq()
    log0 = dep.server_log()
    out = await run_flood(creds_file(dep, attacker), "open_loop", "", seconds=8)
    ck.add("the attacker's connection closed by the server", out.get("closed_by_server") == 1,
           f"{out}")
    try:
        ev = await dep.wait_security(attacker, lambda e: e.get("action") == "flood",
                                     "the attacker paused", after_seq=seq0)
        ck.add("paused, filed as the attacker's", True, str(ev.get("reason", ""))[:160])
    except AssertionError as e:
        ck.add("paused, filed as the attacker's", False, str(e))
    vev = [e for e in await dep.security_events(victim, seq0) if e.get("action") == "flood"]
    ck.add("the victim not paused", not vev, f"{len(vev)} events")
    await victim_calls_work(dep, victim, ck)
    cut = dep.cut_connections(log0)
    ck.add("no agent connection cut off", not cut, " | ".join(c[-160:] for c in cut[:2]))
    # The pause ends (its length: the attacker's penalty_s), and the attacker works again.
    back = False
    deadline = asyncio.get_running_loop().time() + 60
    while not back and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(1.0)
        with contextlib.suppress(Exception):
            fresh = await Client.connect(credentials=dep.creds[attacker])
            try:
                await asyncio.wait_for(fresh.list_workloads(), CALL_TIMEOUT_S)
                back = True
            finally:
                await fresh.close()
    ck.add("the attacker's calls work after its pause", back)
    await dep.drop_client(attacker)  # its kept client was closed with its connections
    return ck.result()


# -- 7. bounded strings ---------------------------------------------------------
async def attack_long_strings(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """200 requests carrying 1 MB strings where names go (a claimed tenant, a
    workload name, a job id, a subject token): the metrics stream, the security
    events and the log grow by little."""
    ck = Checks()
    client, rec = await attacker_workload(dep, attacker, "long-probe")
    bytes0, seq0, logs0 = await dep.metrics_bytes(), await dep.metrics_seq(), dep.log_bytes.bytes
    log0 = dep.server_log()
    try:
        # From a process of the attacker's own (..flood): building and sending 190 MB
        # is the attacker's cost, not this process's (where the victim's probe runs).
        sent = await run_flood(creds_file(dep, attacker), "strings", "long-probe",
                               seconds=60, signature=rec.schema_signature, claim=victim)
        ck.add("the requests went out", sent.get("sent") == 190, str(sent))
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
