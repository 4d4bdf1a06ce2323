"""The second review's remaining rows (issue 24): connections, service inboxes, positions, specs.

- ``connections``: a tenant opens 100 connections past its ``max_connections``
  quota (from a process of its own); the newest are closed within seconds, its
  first client keeps working.
- ``service_inbox_reply``: a request on the tenant's own subject asks for its
  answer under the service's (``_svc``) or the operator's (``_admin``) inbox
  prefix; it is dropped and filed, nothing is written there.
- ``event_position``: ``read_events {"after_seq": -1}`` twice while the victim
  trains: the position is the tenant's own, unchanged by other tenants' events.
- ``bad_seed``: ``seed=-1`` (and other values a consumer would refuse later) are
  refused at creation with ``invalid_spec``, not accepted and crashed on.

See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from joynexus.ops.isolation.deployment import SecuredDeployment
from joynexus.ops.isolation.flood import creds_file, run_flood
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    api_raw,
    refused,
    short_error,
)

#: Connections the attacker opens past what it holds (the review: 300).
EXTRA_CONNECTIONS = 100


async def attack_connections(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """100 connections more than the tenant's ``max_connections`` allow: the newest are
    closed, the tenant's first client still works, the excess is filed."""
    from joynexus.schemas.quotas import DEFAULT_QUOTA

    ck = Checks()
    client = await dep.client(attacker)
    seq0 = await dep.metrics_seq()
    cap = int(dep.quotas.get(attacker, {}).get("max_connections", DEFAULT_QUOTA.max_connections))
    # From a process of the attacker's own (..flood), as a tenant's client would: 132
    # connects made in the probe's own event loop slowed the probe, not the service.
    counts = await run_flood(creds_file(dep, attacker), "connections", "",
                             lanes=cap + EXTRA_CONNECTIONS, seconds=20)
    ck.add("connections past the cap closed", counts["alive"] < cap,
           f"{counts['alive']} of {counts['opened']} still open (cap {cap}, one held before; "
           f"{counts['refused']} refused at connect)")
    try:
        await asyncio.wait_for(client.list_workloads(), 10)
        ck.add("the tenant's first client works", True)
    except Exception as e:
        ck.add("the tenant's first client works", False, short_error(e))
    events = await dep.security_events(attacker, seq0)
    ck.add("the excess filed", any("max_connections" in e.get("reason", "") for e in events),
           f"{len(events)} events")
    return ck.result()


async def attack_service_inbox_reply(dep: SecuredDeployment, attacker: str,
                                     victim: str) -> AttackResult:
    """Requests on the tenant's own subjects with their reply under the service's and
    the operator's inbox prefixes: dropped, filed, and no reply lands there."""
    n, ck = dep.names, Checks()
    await dep.client(attacker)
    seq0 = await dep.metrics_seq()
    raw = await dep.raw(attacker)
    prefixes = [n.service_inbox_prefix, n.admin_inbox_prefix]
    landed: list[str] = []
    watch = None
    if dep.service is not None:  # what lands there, seen as the service
        async def on_msg(msg: Any) -> None:
            if msg.subject.endswith(".planted"):
                landed.append(msg.subject)

        watch = await dep.service.nc.subscribe(f"{prefixes[0]}.>", cb=on_msg)
    try:
        for prefix in prefixes:
            for verb in ("list_workloads", "read_events"):
                await raw.nc.publish(n.api(attacker, verb), b"{}", reply=f"{prefix}.planted")
            await raw.nc.publish(n.infer("qwen2.5-vl-tiny", attacker), b"\x80",
                                 reply=f"{prefix}.planted")
        await raw.nc.flush()
        await asyncio.sleep(2.0)
        ck.add("no reply landed in the service's inbox space", not landed, str(landed[:3]))
        events = [e for e in await dep.security_events(attacker, seq0)
                  if e.get("action") == "reply"]
        ck.add("each refused and filed", len(events) >= 4, f"{len(events)} reply events")
    finally:
        if watch is not None:
            with contextlib.suppress(Exception):
                await watch.unsubscribe()
        await raw.close()
    return ck.result()


async def attack_event_position(dep: SecuredDeployment, attacker: str,
                                victim: str) -> AttackResult:
    """``read_events`` from now on, twice 3 s apart while the victim trains: the
    attacker's position does not move with the victim's events (no other tenant's
    rate can be read from it)."""
    ck = Checks()
    client = await dep.client(attacker)
    first = (await api_raw(client, "read_events", {"after_seq": -1})).last_seq
    vclient = await dep.client(victim)
    from joynexus.ops.isolation.deployment import VICTIM_WORKLOAD

    v0 = await vclient.latest_version(VICTIM_WORKLOAD)
    await asyncio.sleep(3.0)
    v1 = await vclient.latest_version(VICTIM_WORKLOAD)
    second = (await api_raw(client, "read_events", {"after_seq": -1})).last_seq
    ck.add("the victim made events meanwhile", v1 > v0, f"v{v0} -> v{v1}")
    ck.add("the attacker's position did not move", first == second, f"{first} -> {second}")
    return ck.result()


async def attack_bad_seed(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """Specs a consumer would refuse later (``seed=-1`` crashed the SFT producer in a
    loop): refused at creation (at decoding, or by the checks), with the field named."""
    ck = Checks()
    client = await dep.client(attacker)
    ds = await dep.dataset(attacker)
    base = {"task_type": "sft", "dataset": ds, "source": "tenant", "action_horizon": 2}
    for what, over, mention in (
        ("seed=-1", {"seed": -1}, "seed"),
        ("seed=2**70", {"seed": 2**70}, "seed"),
    ):
        ok, note = await refused(
            api_raw(client, "create_workload", {"spec": {"name": "bad-seed", **base, **over}}),
            ("invalid_spec", "invalid_message"), mention=mention, within_s=5.0)
        ck.add(f"{what} refused", ok, note)
        with contextlib.suppress(Exception):
            await client.cancel_workload("bad-seed")
    return ck.result()


__all__ = [
    "EXTRA_CONNECTIONS",
    "attack_bad_seed",
    "attack_connections",
    "attack_event_position",
    "attack_service_inbox_reply",
]
