"""Attacks on identities: bad records in the identities bucket, failed logins as the victim.

Revocation must keep working with garbage and forged records present, and a
stranger's failed logins must not be filed as the victim's misdeeds. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from joynexus.ops.isolation.deployment import (
    SecuredDeployment,
)
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    short_error,
)
from joynexus.schemas.errors import PermissionDenied
from joynexus.sdk import Client


# -- 2. revocation after a bad record -----------------------------------------
async def attack_bad_identity_record(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """Garbage and a record whose key does not match its user in the identities
    bucket; then a tenant added and removed must still be applied."""
    from joynexus.broker.permissions import hash_password
    from joynexus.ops.admin.tenants import add_tenant, remove_tenant
    from joynexus.schemas.base import encode
    from joynexus.schemas.identities import TenantIdentity

    n, ck = dep.names, Checks()
    ikv = await dep.admin.js.key_value(n.identities_bucket)
    pw = "let-me-in-" + secrets.token_hex(4)
    forged = TenantIdentity(tenant_id="mallory", user=n.tenant_user(victim),
                            password_hash=await asyncio.to_thread(hash_password, pw))
    bad_keys = {"aaa-garbage": b"\x00not json{", "mallory": encode(forged),
                "zzz-wrongtype": b'{"tenant_id": 5, "user": [], "password_hash": null}'}
    for k, v in bad_keys.items():
        await ikv.put(k, v)
    newbie = "tom" + secrets.token_hex(2)
    try:
        creds, reply = await add_tenant(dep.admin, newbie, url=dep.url)
        ck.add("tenant add applied", reply.applied == "yes", reply.applied)
        c = await Client.connect(credentials=creds)
        try:
            await c.list_workloads()
            ck.add("new tenant connects", True)
            reply = await remove_tenant(dep.admin, newbie)
            ck.add("tenant rm applied", reply.applied == "yes", reply.applied)
            revoked = False
            for _ in range(50):
                try:
                    await c.list_workloads()
                except PermissionDenied:
                    revoked = True
                    break
                except Exception:
                    pass
                await asyncio.sleep(0.1)
            ck.add("live connection revoked", revoked)
        finally:
            with contextlib.suppress(Exception):
                await c.close()
        try:
            c2 = await Client.connect(credentials=creds)
            await c2.close()
            ck.add("revoked credentials refused", False, "connected")
        except PermissionDenied:
            ck.add("revoked credentials refused", True)
        try:
            r = await dep.raw_as(n.tenant_user(victim), pw)
            await r.close()
            ck.add("mismatched record gives no login as bolt", False, "connected as jnx.bolt")
        except Exception:
            ck.add("mismatched record gives no login as bolt", True)
    except Exception as e:
        ck.add("add/rm with bad records present", False, short_error(e))
    finally:
        for k in bad_keys:
            with contextlib.suppress(Exception):
                await ikv.purge(k)
    return ck.result()


# -- 7. failed logins ------------------------------------------------------------
async def attack_failed_logins(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """50 wrong-password logins as the victim's user: not filed as the victim's misdeeds."""
    ck = Checks()
    seq0 = await dep.metrics_seq()
    user = dep.names.tenant_user(victim)
    refused_n = 0
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal refused_n
        try:
            r = await dep.raw_as(user, f"wrong-{i}")
            await r.close()
        except Exception:
            refused_n += 1

    for k in range(0, 50, 10):
        await asyncio.gather(*(one(i) for i in range(k, k + 10)))
    took = time.perf_counter() - t0
    ck.add("all refused", refused_n == 50, f"{refused_n}/50 in {took:.1f}s")
    await asyncio.sleep(3.0)
    vev = await dep.security_events(victim, seq0)
    ck.add("none filed as bolt's", not vev,
           f"{len(vev)} events: {[e.get('action') for e in vev[:3]]}")
    return ck.result()
