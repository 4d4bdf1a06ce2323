"""What every attack uses: raw calls past the SDK's own checks, named checks, a result.

An attack must reach the service's door itself, so :func:`api_raw` and
:func:`infer_raw` send bodies built by hand; :class:`Checks` collects what one
attack verified (it held when every check passed) and :func:`refused` is the
common check that a call fails with a given code, quickly. :class:`Attack` is
one entry of the catalogue (:mod:`.attacks`). See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from joynexus.ops.isolation.deployment import (
    MODEL,
    SecuredDeployment,
    sft_spec,
)
from joynexus.schemas.base import decode
from joynexus.schemas.errors import JoyNexusError, error_from_code
from joynexus.schemas.workloads import (
    CONTENT_TYPE,
    MSGPACK,
    ApiReply,
)
from joynexus.sdk import Client


# ---------------------------------------------------------------- raw API calls
async def api_raw(
    client: Client, verb: str, body: Any, *, binary: bool = False, timeout_s: float = 30.0
) -> ApiReply:
    """One control plane request of ``client``'s tenant with a body built by hand
    (a dict: no client-side validation); raises the error the reply carries."""
    subject = client._b.names.api(client.tenant, verb)
    data = msgspec.msgpack.encode(body) if binary else msgspec.json.encode(body)
    headers = {CONTENT_TYPE: MSGPACK} if binary else None
    msg = await client._b.nc.request(subject, data, timeout=timeout_s, headers=headers)
    reply = decode(msg.data, ApiReply, what=f"reply to {verb}")
    if reply.error is not None:
        raise error_from_code(reply.error.code, reply.error.message)
    return reply


def infer_request(tenant: str, workload: str, signature: str, rows: int, *,
                  instruction: str = "pick the cube", claim: str | None = None) -> bytes:
    from joynexus.schemas.inference import InferRequest, Observation, TensorBytes, encode_msgpack

    obs = Observation(
        images={"base_camera": TensorBytes.from_array(np.zeros((rows, 3, 64, 64), np.uint8))},
        instruction=instruction,
        state=TensorBytes.from_array(np.zeros((rows, 12), np.float32)),
    )
    return encode_msgpack(InferRequest(tenant_id=claim or tenant, workload=workload,
                                       schema_signature=signature, observation=obs))


async def infer_raw(client: Client, payload: bytes, *, timeout_s: float = 15.0) -> Any:
    """One inference request on ``client``'s own subject: the reply (InferResult | InferError)."""
    from joynexus.schemas.inference import InferReply, decode_msgpack

    msg = await client._b.nc.request(client._b.names.infer(MODEL, client.tenant), payload,
                                     timeout=timeout_s)
    return decode_msgpack(msg.data, InferReply, what="inference reply")


async def cancel_quietly(client: Client, name: str) -> None:
    with contextlib.suppress(Exception):
        await client.cancel_workload(name)


def error_code(e: BaseException) -> str:
    return getattr(e, "code", type(e).__name__)


def short_error(e: BaseException | str, n: int = 160) -> str:
    s = e if isinstance(e, str) else f"{error_code(e)}: {e}"
    return s if len(s) <= n else s[:n] + "..."


# ---------------------------------------------------------------- checks and the catalogue's entry
@dataclass
class AttackResult:
    held: bool
    detail: str


@dataclass
class Attack:
    name: str
    run: Callable[[SecuredDeployment, str, str], Awaitable[AttackResult]]
    #: The issue's class ("What was observed" item) it belongs to, or "found".
    klass: str = ""
    timeout_s: float = 90.0
    #: Needs the agents in this process (their restarts, the service identity).
    in_process: bool = False


class Checks:
    """Named checks of one attack; the attack held when every one passed."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, note: str = "") -> bool:
        self.items.append((name, bool(ok), note))
        return bool(ok)

    def result(self) -> AttackResult:
        failed = [f"{n}: {note}" if note else n for n, ok, note in self.items if not ok]
        passed = [n for n, ok, _ in self.items if ok]
        if failed:
            return AttackResult(False, "FAILED " + "; ".join(failed)
                                + (f" | held: {', '.join(passed)}" if passed else ""))
        notes = [f"{n} ({note})" if note else n for n, _, note in self.items]
        return AttackResult(True, "; ".join(notes))


async def refused(
    call: Awaitable[Any], codes: tuple[str, ...], *, mention: str = "", within_s: float = 10.0
) -> tuple[bool, str]:
    """Whether ``call`` fails with one of ``codes`` within ``within_s`` (an
    ``invalid_spec`` must name ``mention``, so a refusal for another reason is
    not taken for this one); and a note."""
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(call, within_s + 5)
    except JoyNexusError as e:
        took = time.perf_counter() - t0
        ok = e.code in codes and (e.code != "invalid_spec" or not mention or mention in str(e))
        return ok and took <= within_s, f"{short_error(e, 120)} in {took:.2f}s"
    except TimeoutError:
        return False, f"no answer within {within_s + 5:.0f}s"
    except Exception as e:
        return False, f"unexpected {short_error(e, 120)}"
    return False, "accepted"


async def attacker_workload(dep: SecuredDeployment, attacker: str, name: str) -> tuple[Client, Any]:
    client = await dep.client(attacker)
    ds = await dep.dataset(attacker)
    wl = await client.create_workload(sft_spec(name, ds))
    return client, wl.record
