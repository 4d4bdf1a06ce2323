"""Attacks on the subjects: replies aimed anywhere, and the service reading the operator's replies.

A request server that answered at any reply subject let a tenant make it
publish to the JetStream API (a purged job log) or into another tenant's
records and inbox; the service identity must not read the operator API's
inbox either. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from joynexus.broker import kvwatch
from joynexus.broker.fastpath import sync_server
from joynexus.broker.natsapi import kv_subject, stream_api
from joynexus.ops.isolation.deployment import (
    MODEL,
    VICTIM_WORKLOAD,
    SecuredDeployment,
)
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    attacker_workload,
    cancel_quietly,
    infer_raw,
    infer_request,
    short_error,
)
from joynexus.schemas.base import decode
from joynexus.schemas.workloads import (
    WorkloadRecord,
)


# -- 1. reply subjects ---------------------------------------------------------
async def attack_reply_subject(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """Ordinary requests on the attacker's own subjects, with reply subjects that
    name the JetStream API, another tenant's records, a forged security event,
    the identities bucket and another tenant's inbox."""
    n, js, ck = dep.names, dep.admin.js, Checks()
    client, rec = await attacker_workload(dep, attacker, "reply-probe")
    vclient = await dep.client(victim)
    vkey = n.workload_key(victim, VICTIM_WORKLOAD)
    wkv = await js.key_value(n.workloads_bucket)
    pkv = await js.key_value(n.policy_bucket)
    ikv = await js.key_value(n.identities_bucket)
    jobs0 = (await js.stream_info(n.jobs_stream)).state
    tq0 = await js.stream_info(n.tq_stream)
    wrev0 = (await wkv.get(vkey)).revision
    seq0 = await dep.metrics_seq()
    # bolt listens on its own inbox: nothing of acme's may arrive there.
    vraw = await dep.raw(victim)
    inbox_msgs: list[Any] = []
    victim_inbox = f"{n.inbox_prefix(victim)}.x"

    async def on_inbox(msg: Any) -> None:
        inbox_msgs.append(msg)

    await vraw.nc.subscribe(victim_inbox, cb=on_inbox)  # exactly the target, not bolt's own
    await sync_server(vraw.nc)  # listening on the server before acme aims at it
    targets = [
        stream_api("PURGE", n.jobs_stream),
        stream_api("DELETE", n.tq_stream),
        kv_subject(n.workloads_bucket, vkey),
        kv_subject(n.policy_bucket, n.policy_record_key(victim, VICTIM_WORKLOAD)),
        n.metrics("security", victim),
        kv_subject(n.identities_bucket, "evil"),
        victim_inbox,
    ]
    raw = await dep.raw(attacker)
    try:
        # The inference engine has acme's policy loaded (a real request first).
        ok = await infer_raw(client, infer_request(attacker, "reply-probe",
                                                   rec.schema_signature, 1))
        ck.add("acme's own request answered", hasattr(ok, "actions"), type(ok).__name__)
        for t in targets:
            await raw.nc.publish(n.api(attacker, "list_workloads"), b"{}", reply=t)
            await raw.nc.publish(n.api(attacker, "get_workload"),
                                 b'{"name": "reply-probe"}', reply=t)
        await raw.nc.flush()
        await asyncio.sleep(1.5)
        seq_mid = await dep.metrics_seq()
        api_events = [e for e in await dep.security_events(attacker, seq0)
                      if e.get("action") == "reply"]
        ck.add("control plane reported a reply event", bool(api_events),
               f"{len(api_events)} events")
        payload = infer_request(attacker, "reply-probe", rec.schema_signature, 1)
        for t in targets:
            await raw.nc.publish(n.infer(MODEL, attacker), payload, reply=t)
        await raw.nc.flush()
        await asyncio.sleep(1.5)
        inf_events = [e for e in await dep.security_events(attacker, seq_mid)
                      if e.get("action") == "reply"]
        ck.add("inference engine reported a reply event", bool(inf_events),
               f"{len(inf_events)} events")
    finally:
        await raw.close()
    # Effects, each checked where it would show.
    try:
        jobs1 = (await js.stream_info(n.jobs_stream)).state
        ck.add("job log not purged", jobs1.first_seq == jobs0.first_seq
               and jobs1.messages >= jobs0.messages,
               f"messages {jobs0.messages} -> {jobs1.messages}")
    except Exception as e:
        ck.add("job log not purged", False, short_error(e))
    try:
        tq1 = await js.stream_info(n.tq_stream)
        ck.add("TQ stream not deleted", tq1.created == tq0.created)
    except Exception as e:
        ck.add("TQ stream not deleted", False, short_error(e))
    try:
        entry = await wkv.get(vkey)
        decode(entry.value or b"", WorkloadRecord)
        ck.add("bolt's workload record intact", entry.revision == wrev0,
               f"revision {wrev0} -> {entry.revision}")
    except Exception as e:
        ck.add("bolt's workload record intact", False, short_error(e))
    try:
        from joynexus.schemas.inference import PolicyRecord

        hist = await kvwatch.history(pkv, n.policy_record_key(victim, VICTIM_WORKLOAD))
        for h in hist:
            if h.value:
                decode(h.value, PolicyRecord)
        await vclient.latest_version(VICTIM_WORKLOAD)
        await vclient.get_workload(VICTIM_WORKLOAD)
        ck.add("bolt's policy records decode", True, f"{len(hist)} revisions")
    except Exception as e:
        ck.add("bolt's policy records decode", False, short_error(e))
    forged = await dep.security_events(victim, seq0)
    ck.add("no event filed under bolt", not forged, f"{len(forged)} events")
    try:
        await ikv.get("evil")
        ck.add("no identity 'evil' written", False, "the key exists")
    except Exception:
        ck.add("no identity 'evil' written", True)
    await vraw.close()
    ck.add("nothing reached bolt's inbox", not inbox_msgs, f"{len(inbox_msgs)} messages")
    await cancel_quietly(client, "reply-probe")
    if not all(ok for _, ok, _ in ck.items):  # repair what a failed attack broke
        from joynexus.broker.layout import ensure_layout

        with contextlib.suppress(Exception):
            await ensure_layout(dep.admin)
    return ck.result()


# -- 7. the operator's inbox -------------------------------------------------------
async def attack_service_reads_admin_inbox(
    dep: SecuredDeployment, attacker: str, victim: str
) -> AttackResult:
    """The service identity subscribes to the operator API's reply inbox."""
    from joynexus.ops.admin.tenants import list_tenants

    ck = Checks()
    svc = dep.service_creds
    if svc is None:
        return AttackResult(False, "no service credentials to try with")
    prefix = dep.names.admin_inbox_prefix
    r = await dep.raw_as(svc.user or "", svc.password or "")
    got: list[Any] = []

    async def on_msg(msg: Any) -> None:
        got.append(msg)

    try:
        await r.nc.subscribe(f"{prefix}.>", cb=on_msg)
        await r.nc.flush()
        await list_tenants(dep.admin)  # an operator request: its reply goes to that inbox
        for _ in range(50):  # the server's error arrives asynchronously
            if r.saw("permissions violation"):
                break
            await asyncio.sleep(0.1)
        ck.add("subscription refused", r.saw("permissions violation"),
               "; ".join(e[:100] for e in r.errors[:2]) or "no error from the server")
        ck.add("no operator reply read", not got, f"{len(got)} messages")
    finally:
        await r.close()
    return ck.result()
