"""Attacks with hostile input: non-finite waits and malformed bodies on every API verb.

Each must get a clear error, never an internal one, and never park a request
server forever. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import time

from joynexus.ops.isolation.deployment import (
    SecuredDeployment,
)
from joynexus.ops.isolation.kit import (
    AttackResult,
    Checks,
    api_raw,
    short_error,
)
from joynexus.schemas.base import decode
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.workloads import (
    CONTENT_TYPE,
    MSGPACK,
    ApiReply,
)


# -- found: non-finite waits, hostile bodies -------------------------------------
async def attack_non_finite_wait(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """read_events with wait_s NaN (msgpack carries it): answered, not parked forever."""
    ck = Checks()
    client = await dep.client(attacker)
    for what, wait in (("NaN", float("nan")), ("-inf", float("-inf"))):
        t0 = time.perf_counter()
        try:
            await api_raw(client, "read_events",
                          {"after_seq": 10**12, "limit": 10, "wait_s": wait},
                          binary=True, timeout_s=25)
            ck.add(f"wait_s={what} answered", True, f"{time.perf_counter() - t0:.1f}s")
        except JoyNexusError as e:
            ck.add(f"wait_s={what} answered", e.code != "error",
                   f"{short_error(e, 80)} in {time.perf_counter() - t0:.1f}s")
        except Exception as e:
            ck.add(f"wait_s={what} answered", False, short_error(e, 80))
    return ck.result()


HOSTILE_BODIES: tuple[tuple[str, bytes, bool], ...] = (
    ("empty object", b"{}", False),  # every field at its default (an empty name...)
    ("not json", b"\xff\xfe{", False),
    ("a list", b"[1, 2]", False),
    ("wrong types", b'{"name": {"$gt": ""}, "job_id": 5, "workload": [], "spec": "x"}', False),
    ("deep nesting", b"[" * 5000 + b"]" * 5000, False),
    ("deeper nesting", b'{"a":' * 8000 + b"1" + b"}" * 8000, False),  # the review's 8,000
    ("msgpack garbage", b"\xc1\xc1\xc1", True),
    ("huge numbers", b'{"after_seq": 1e400, "limit": -99999999999999999999, '
                     b'"offset": -5, "sample_count": 1e300}', False),
)


async def attack_hostile_bodies(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """Malformed bodies on every API verb: each a clear error, never an internal one."""
    from joynexus.agents.control import VERBS

    n, ck = dep.names, Checks()
    client = await dep.client(attacker)
    bad: list[str] = []
    count = 0
    for verb in VERBS:
        for what, body, binary in HOSTILE_BODIES:
            count += 1
            headers = {CONTENT_TYPE: MSGPACK} if binary else None
            try:
                msg = await client._b.nc.request(n.api(attacker, verb), body, timeout=10,
                                                 headers=headers)
                r = decode(msg.data, ApiReply)
                if r.error is None:
                    if what not in ("empty object", "a list", "wrong types", "huge numbers"):
                        bad.append(f"{verb}/{what}: accepted")
                elif r.error.code == "error" or "internal error" in r.error.message \
                        or "Traceback" in r.error.message:
                    bad.append(f"{verb}/{what}: {r.error.message[:80]}")
            except Exception as e:
                bad.append(f"{verb}/{what}: {short_error(e, 60)}")
    ck.add("every hostile body refused clearly", not bad,
           f"{len(bad)}/{count}: " + "; ".join(bad[:4]))
    return ck.result()
