"""A tenant's flood from a process of its own: ``python -m joynexus.ops.isolation.flood``.

The isolation deployment runs the agents, the victim's probe and the attacks in
one process and one event loop, so a flood sent from that process also spends
that loop on the attacker's own side (encoding, replies, retries), which no
real attacker's client takes from the service. The floods within quota
(:mod:`.attacks.shares`) therefore run here, in a subprocess with the
attacker's credentials, as a tenant's client on another machine would; the
victim is measured as before. The process runs at niceness 19, the nearest a
2-core test machine gets to the attacker's own machine. Prints one JSON line:
each outcome's count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


async def flood(creds: str, kind: str, workload: str, *, lanes: int, seconds: float,
                rows: int = 64, instruction: str = "", signature: str = "") -> dict[str, int]:
    from joynexus.ops.isolation.kit import api_raw, error_code, infer_raw, infer_request
    from joynexus.schemas.inference import InferError
    from joynexus.sdk import Client

    client = await Client.connect(credentials=creds)
    outcomes: Counter[str] = Counter()
    payload = (infer_request(client.tenant, workload, signature, rows, instruction=instruction)
               if kind == "act" else b"")
    stop = time.monotonic() + seconds

    async def one() -> str:
        if kind == "act":
            reply: Any = await infer_raw(client, payload, timeout_s=30.0)
            return reply.code if isinstance(reply, InferError) else "ok"
        await api_raw(client, "get_policy", {"workload": workload, "limit": 1}, timeout_s=30.0)
        return "ok"

    async def lane() -> None:
        while time.monotonic() < stop:
            try:
                outcome = await one()
            except Exception as e:
                outcome = f"raised {error_code(e)}"
            outcomes[outcome] += 1
            if outcome != "ok":
                await asyncio.sleep(0.05)

    try:
        await asyncio.gather(*(lane() for _ in range(lanes)))
    finally:
        await client.close()
    return dict(outcomes)


async def connections(creds: str, *, count: int, wait_s: float = 20.0) -> dict[str, int]:
    """Open ``count`` bare connections as the tenant (past its ``max_connections``),
    then wait until the service has closed the excess (fewer than ``count`` open) or
    ``wait_s`` passed; counts ``opened``, ``refused`` (a connect that failed) and
    ``alive`` (still open when it stopped waiting); closes the rest."""
    import nats

    from joynexus.broker.credentials import Credentials
    from joynexus.broker.subjects import Names

    c = Credentials.load(creds)
    if not c.url:
        raise SystemExit(f"{creds}: the credentials name no server url")
    prefix = Names(c.namespace).inbox_prefix(c.tenant) if c.tenant and c.namespace else ""
    kw: dict[str, Any] = {"inbox_prefix": prefix} if prefix else {}
    opened: list[Any] = []
    refused = 0

    async def quiet(_e: Exception) -> None:
        return None

    for _ in range(count):
        try:
            opened.append(await nats.connect(c.url, user=c.user, password=c.password,
                                             error_cb=quiet, max_reconnect_attempts=0,
                                             allow_reconnect=False, connect_timeout=5, **kw))
        except Exception:
            refused += 1
    for _ in range(int(wait_s / 0.3)):  # until the service closes the excess
        if sum(nc.is_connected for nc in opened) < count - refused:
            break
        await asyncio.sleep(0.3)
    await asyncio.sleep(1.0)  # the closes of one sweep land together
    alive = sum(nc.is_connected for nc in opened)
    for nc in opened:
        with contextlib.suppress(Exception):
            await nc.close()
    return {"opened": len(opened), "refused": refused, "alive": alive}


def creds_file(dep: Any, tenant: str) -> Path:
    """The tenant's credentials (of a ``SecuredDeployment``) in a file, for a flood's
    own process."""
    path: Path = dep.creds[tenant].save(dep.data / "flood-creds" / f"{tenant}.json")
    return path


async def fill_queue(creds: str, workload: str, *, limit_bytes: int, seconds: float) -> dict[str, int]:
    """Open jobs on ``workload`` and put a 480-row batch into each (in requests under
    the server's max_payload) until the tenant's Training Queue quota refuses (or
    ``limit_bytes`` went in, or ``seconds`` passed); then abort every job opened.
    Counts: ``ok`` batches, the refusal's code, and ``pushed_mib``."""
    import contextlib

    from joynexus.ops.isolation.deployment import MiB, sft_batch
    from joynexus.ops.isolation.kit import error_code
    from joynexus.schemas.errors import JoyNexusError
    from joynexus.schemas.inference import TensorBytes
    from joynexus.schemas.workloads import CloseJob, OpenJob, PutData
    from joynexus.sdk import Client

    client = await Client.connect(credentials=creds)
    outcomes: Counter[str] = Counter()
    chunk = sft_batch(480, 3)
    row_bytes = sum(v[0].nbytes for v in chunk.values())
    step = max(1, client._b.max_payload * 3 // 4 // row_bytes)  # rows per put_data request
    parts = [(at, {k: TensorBytes.from_array(v[at:at + step]) for k, v in chunk.items()})
             for at in range(0, 480, step)]
    pushed, opened = 0, []
    stop = time.monotonic() + seconds
    try:
        while pushed <= limit_bytes and time.monotonic() < stop:
            try:
                r = await client._api("open_job", OpenJob(workload=workload, sample_count=480))
                if r.job is None:
                    outcomes["admission_refused"] += 1
                    break
                opened.append(r.job.job_id)
                for at, fields in parts:  # the batch in requests under the server's limit
                    await client._api("put_data", PutData(job_id=r.job.job_id, fields=fields,
                                                          offset=at), binary=True)
                    pushed += sum(len(f.data) for f in fields.values())
            except JoyNexusError as e:
                outcomes[error_code(e)] += 1
                break
            outcomes["ok"] += 1
    finally:
        for job_id in opened:
            with contextlib.suppress(Exception):
                await client._api("abort_job", CloseJob(job_id=job_id, reason="quota attack"))
        await client.close()
    return {**outcomes, "pushed_mib": pushed // MiB}


async def long_strings(creds: str, workload: str, *, signature: str, claim: str) -> dict[str, int]:
    """190 requests carrying 1 MB strings where names go (a claimed tenant ``claim``
    + 1 MB, a workload name, a job id), then 10 connections that each publish on a
    subject with a 1 MB token (the server drops them). Counts: ``sent``, ``subjects``."""
    import contextlib

    import msgspec
    import nats

    from joynexus.ops.isolation.deployment import MODEL, MiB
    from joynexus.ops.isolation.kit import infer_request
    from joynexus.sdk import Client

    client = await Client.connect(credentials=creds)
    n, nc, tenant = client._b.names, client._b.nc, client.tenant
    big = "x" * MiB
    payloads = (
        (n.infer(MODEL, tenant), infer_request(tenant, workload, signature, 1, claim=claim + big)),
        (n.api(tenant, "get_workload"), msgspec.json.encode({"name": big})),
        (n.api(tenant, "close_job"), msgspec.json.encode({"job_id": big})),
    )
    sent = 0
    try:
        for i in range(190):
            subject, payload = payloads[i % 3]
            await nc.publish(subject, payload, reply=nc.new_inbox())
            sent += 1
            if i % 20 == 19:
                await nc.flush()
        await nc.flush()
    finally:
        await client.close()
    from joynexus.broker.credentials import Credentials

    c = Credentials.load(creds)
    subjects = 0
    for _ in range(10):  # a 1 MB subject token: one connection each
        try:
            r = await nats.connect(c.url or "", user=c.user, password=c.password,
                                   inbox_prefix=n.inbox_prefix(tenant),
                                   max_reconnect_attempts=0, allow_reconnect=False,
                                   connect_timeout=5)
            with contextlib.suppress(Exception):
                await r.publish(n.api(tenant, "v" * MiB), b"{}")
                await r.flush(timeout=2)
            with contextlib.suppress(Exception):
                await r.close()
        except Exception:
            pass
        subjects += 1
    return {"sent": sent, "subjects": subjects}


async def burst(creds: str, *, total: int = 2000, wait_s: float = 45.0) -> dict[str, int]:
    """``total`` fire-and-forget requests at once, alternately ``list_workloads`` and a
    ``create_workload`` that fails its checks, with replies to the tenant's own inbox;
    counts the replies by error code (``ok``: none) and their number (``replies``)."""
    import contextlib

    import msgspec

    from joynexus.schemas.base import decode
    from joynexus.schemas.workloads import ApiReply
    from joynexus.sdk import Client

    client = await Client.connect(credentials=creds)
    n, nc, tenant = client._b.names, client._b.nc, client.tenant
    codes: Counter[str] = Counter()
    done = asyncio.Event()

    async def on_reply(msg: Any) -> None:
        try:
            r = decode(msg.data, ApiReply)
            codes[r.error.code if r.error else "ok"] += 1
        except Exception:
            codes["undecodable"] += 1
        if sum(codes.values()) >= total:
            done.set()

    prefix = n.inbox_prefix(tenant)
    await nc.subscribe(f"{prefix}.flood.>", cb=on_reply, pending_msgs_limit=100_000)
    bad_create = msgspec.json.encode(
        {"spec": {"name": "flood", "task_type": "sft", "dataset": "no-such-dataset"}})
    try:
        for i in range(total):
            verb, body = ("list_workloads", b"{}") if i % 2 else ("create_workload", bad_create)
            await nc.publish(n.api(tenant, verb), body, reply=f"{prefix}.flood.{i}")
        await nc.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), wait_s)
        await asyncio.sleep(0.5)
    finally:
        await client.close()
    return {**codes, "replies": sum(codes.values())}


async def open_loop(creds: str, *, seconds: float) -> dict[str, Any]:
    """``list_workloads`` requests published as fast as one connection can, never
    waiting for (or reading) a reply, for ``seconds`` or until the server closes the
    connection. Counts: ``sent``, ``closed_by_server`` (1 or 0), ``after_s`` (when it
    was closed), ``authorization`` (the server's authorization violations seen)."""
    import nats

    from joynexus.broker.credentials import Credentials
    from joynexus.broker.subjects import Names

    c = Credentials.load(creds)
    n = Names(c.namespace or "jnx")
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e).lower())

    nc = await nats.connect(c.url or "", user=c.user, password=c.password, error_cb=on_error,
                            inbox_prefix=n.inbox_prefix(c.tenant or ""), allow_reconnect=False,
                            max_reconnect_attempts=0, connect_timeout=5)
    subject, reply = n.api(c.tenant or "", "list_workloads"), f"{n.inbox_prefix(c.tenant or '')}.never"
    sent, t0 = 0, time.monotonic()
    closed_at = None
    try:
        while time.monotonic() - t0 < seconds:
            if nc.is_closed or not nc.is_connected:
                closed_at = time.monotonic() - t0
                break
            try:
                for _ in range(200):
                    await nc.publish(subject, b"{}", reply=reply)
                sent += 200
            except Exception:
                closed_at = time.monotonic() - t0
                break
            await asyncio.sleep(0)  # let the client's flusher write
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return {"sent": sent, "closed_by_server": int(closed_at is not None),
            "after_s": round(closed_at or 0.0, 2),
            "authorization": sum("authorization violation" in e for e in errors)}


async def oversize(creds: str, workload: str, *, signature: str) -> dict[str, Any]:
    """Inference requests past the tenant's bounds, each three at once: as many rows
    as fit in 90% of max_payload, and an instruction of max_payload less 64 KiB.
    Per request kind: the reply codes (``served`` for an answer) and the seconds."""
    from joynexus.ops.isolation.kit import infer_raw, infer_request
    from joynexus.schemas.inference import InferError
    from joynexus.sdk import Client

    client = await Client.connect(credentials=creds)
    tenant, limit = client.tenant, client._b.max_payload
    rows = min(10_000, int(limit * 0.9) // (3 * 64 * 64 + 12 * 4))
    out: dict[str, Any] = {}
    try:
        for what, payload in (
            ("rows", infer_request(tenant, workload, signature, rows)),
            ("instruction", infer_request(tenant, workload, signature, 1,
                                          instruction="a" * (limit - 64 * 1024))),
        ):
            t0 = time.perf_counter()
            try:
                got = await asyncio.gather(*(infer_raw(client, payload, timeout_s=10)
                                             for _ in range(3)))
                out[what] = [g.code if isinstance(g, InferError) else "served" for g in got]
            except Exception as e:
                out[what] = [f"raised {type(e).__name__}"]
            out[f"{what}_s"] = round(time.perf_counter() - t0, 2)
        out["rows_asked"] = rows
    finally:
        await client.close()
    return out


async def run_flood(creds_file: Path, kind: str, workload: str, *, lanes: int = 1,
                    seconds: float, rows: int = 64, instruction: str = "", signature: str = "",
                    limit_mib: int = 512, claim: str = "") -> dict[str, Any]:
    """Run :func:`flood` in a subprocess; its outcome counts."""
    cmd = [sys.executable, "-m", "joynexus.ops.isolation.flood", "--creds", str(creds_file),
           "--kind", kind, "--workload", workload, "--lanes", str(lanes),
           "--seconds", str(seconds), "--rows", str(rows), "--instruction", instruction,
           "--signature", signature, "--limit-mib", str(limit_mib), "--claim", claim]
    proc = await asyncio.create_subprocess_exec(*lowest_priority(cmd), stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), seconds + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"the flood process exited {proc.returncode}: {err.decode()[-500:]}")
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


def lowest_priority(argv: list[str]) -> list[str]:
    """``argv`` run at niceness 19 (through ``nice``, where there is one): an attacker's
    client runs on the attacker's machine, so on a shared 2-core test machine it takes
    only the CPU the service leaves (it still sends as fast as that lets it).

    Not a ``preexec_fn``: with one, ``subprocess`` must fork() the whole calling
    process instead of vfork(), and that copy stops the caller's event loop, where the
    victim's probe runs, for 15-50 ms (the bench process at 0.5-1.5 GB), measured as
    the victim's latency at each attack's start."""
    nice = shutil.which("nice")
    return [nice, "-n", "19", *argv] if nice else argv


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m joynexus.ops.isolation.flood",
                                 description="One tenant's flood within its quota (JSON counts).")
    ap.add_argument("--creds", required=True, help="the tenant's credentials file")
    ap.add_argument("--kind", choices=("act", "get_policy", "tq", "strings", "burst", "oversize",
                                       "open_loop", "connections"),
                    required=True,
                    help="act: inference requests; get_policy: control-plane reads; tq: fill "
                    "the Training Queue up to --limit-mib (or the quota); strings: 1 MB "
                    "strings where names go; burst: 2,000 control-plane requests at once; "
                    "open_loop: control-plane requests as fast as one connection sends, never "
                    "reading a reply; "
                    "oversize: inference requests past the rows and instruction bounds; "
                    "connections: --lanes bare connections, then wait for the excess closed")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--lanes", type=int, default=4, help="requests in flight")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rows", type=int, default=64, help="act: rows per request")
    ap.add_argument("--instruction", default="", help="act: the instruction")
    ap.add_argument("--signature", default="", help="act: the workload's schema signature")
    ap.add_argument("--limit-mib", type=int, default=512, help="tq: stop after this many MiB")
    ap.add_argument("--claim", default="", help="strings: the tenant an inference request claims")
    a = ap.parse_args(argv)
    counts: dict[str, Any]
    if a.kind == "oversize":
        counts = asyncio.run(oversize(a.creds, a.workload, signature=a.signature))
    elif a.kind == "open_loop":
        counts = asyncio.run(open_loop(a.creds, seconds=a.seconds))
    elif a.kind == "burst":
        counts = asyncio.run(burst(a.creds))
    elif a.kind == "connections":
        counts = asyncio.run(connections(a.creds, count=a.lanes))
    elif a.kind == "strings":
        counts = asyncio.run(long_strings(a.creds, a.workload, signature=a.signature,
                                          claim=a.claim))
    elif a.kind == "tq":
        counts = asyncio.run(fill_queue(a.creds, a.workload, limit_bytes=a.limit_mib << 20,
                                        seconds=a.seconds))
    else:
        counts = asyncio.run(flood(a.creds, a.kind, a.workload, lanes=a.lanes,
                                   seconds=a.seconds, rows=a.rows,
                                   instruction=a.instruction, signature=a.signature))
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
