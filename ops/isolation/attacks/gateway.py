"""Hostile clients of the policy gateway (issue 27): keys, frames, a client that never
reads, a connection flood. Each runs as the attacker against the deployment's gateway
(``SecuredDeployment.gateway_url``) while the runner measures the victim; the checks
that need a served policy use a workload of the attacker's own (:data:`WORKLOAD`),
and the victim's own gateway connection must keep serving through the floods. The
heavy ones (:data:`PARTS`) run from a process of their own, as a client on another
machine would, so their encoding and buffers do not load the victim probe's loop.
See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
from typing import Any

import msgspec
import numpy as np

from joynexus.agents.gateway.codec import encode, pack_array
from joynexus.ops.isolation.deployment import VICTIM_WORKLOAD, SecuredDeployment, sft_spec
from joynexus.ops.isolation.flood import lowest_priority
from joynexus.ops.isolation.kit import AttackResult, Checks, cancel_quietly, short_error
from joynexus.schemas.errors import JoyNexusError

#: The attacker's own workload the gateway serves it.
WORKLOAD = "gw"
FLOOD = 1000
MiB = 1 << 20


def _connect(base: str, key: str | None, query: str = "", **kw: Any) -> Any:
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Api-Key {key}"} if key else None
    url = base + "/" + (f"?{query}" if query else "")
    return connect(url, additional_headers=headers, max_size=None, compression=None,
                   open_timeout=20, **kw)


def _unpack(data: bytes) -> Any:
    def conv(x: Any) -> Any:
        if isinstance(x, dict):
            if b"__ndarray__" in x:
                return np.ndarray(buffer=x[b"data"], dtype=np.dtype(x[b"dtype"]), shape=x[b"shape"])
            return {k: conv(v) for k, v in x.items()}
        return x

    return conv(msgspec.msgpack.decode(data))


def observation(meta: dict[str, Any], patch: dict[str, Any] | None = None, *,
                seed: int = 0) -> bytes:
    """An observation of the policy's shapes (its metadata), ``patch`` replacing keys."""
    rng = np.random.default_rng(seed)
    h, w = meta["image_size"]
    obs: dict[str, Any] = {f"observation/images/{c}": rng.integers(0, 255, (h, w, 3), np.uint8)
                           for c in meta["cameras"]}
    obs["observation/state"] = rng.standard_normal(meta["state_dim"]).astype(np.float32)
    obs.update(patch or {})
    return encode({k: pack_array(v) if isinstance(v, np.ndarray) else v for k, v in obs.items()})


async def _status(url: str, key: str | None, query: str = "") -> tuple[int, bytes]:
    """The HTTP status a refused handshake got (101 if it was accepted)."""
    from websockets.exceptions import InvalidStatus

    try:
        async with _connect(url, key, query):
            return 101, b""
    except InvalidStatus as e:
        return e.response.status_code, bytes(e.response.body or b"")


async def _keys(dep: SecuredDeployment, tenant: str, workload: str) -> str:
    """A key of ``tenant``'s ``workload`` (the attacker's made first if missing)."""
    from joynexus.ops.admin.apikeys import add_key

    if workload == WORKLOAD:
        client = await dep.client(tenant)
        with contextlib.suppress(JoyNexusError):  # made by an earlier attack
            await client.create_workload(sft_spec(WORKLOAD, await dep.dataset(tenant)))
    key, _ = await add_key(dep.admin, tenant, workload=workload)
    return key


async def _served(url: str, key: str) -> tuple[bool, str]:
    """One observation through a fresh connection: served, and a note."""
    try:
        async with _connect(url, key) as ws:
            meta = _unpack(await asyncio.wait_for(ws.recv(), 20))
            t0 = time.perf_counter()
            await ws.send(observation(meta))
            reply = await asyncio.wait_for(ws.recv(), 20)
            ok = isinstance(reply, bytes) and _unpack(reply)["actions"].ndim == 2
            return ok, f"{(time.perf_counter() - t0) * 1e3:.0f} ms"
    except Exception as e:
        return False, short_error(str(e), 120)


def _ends_its_workload(attack: Any) -> Any:
    """The attack, then the attacker's :data:`WORKLOAD` cancelled (a tenant runs one
    active workload per task type: left active, it failed the next attack that
    creates one)."""
    async def run(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
        try:
            return await attack(dep, attacker, victim)  # type: ignore[no-any-return]
        finally:
            await cancel_quietly(await dep.client(attacker), WORKLOAD)

    run.__doc__, run.__name__ = attack.__doc__, attack.__name__
    return run


@_ends_its_workload
async def attack_gateway_keys(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """Wrong, missing and revoked keys; the victim's workload named in the key's place."""
    from websockets.exceptions import ConnectionClosed

    from joynexus.ops.admin.apikeys import add_key, remove_key

    ck, url = Checks(), dep.gateway_url
    key = await _keys(dep, attacker, WORKLOAD)
    for what, k in (("missing", None), ("garbage", "garbage"), ("forged", key[:-4] + "AAAA"),
                    ("unknown id", "jnxk_000000000000_" + "A" * 43)):
        code, _ = await _status(url, k)
        ck.add(f"{what} key refused", code == 401, f"HTTP {code}")
    code, body = await _status(url, key, f"workload={VICTIM_WORKLOAD}")
    ck.add("a workload key names the victim's workload", code == 403, f"HTTP {code}")
    any_key, _ = await add_key(dep.admin, attacker)
    code, body = await _status(url, any_key, f"workload={VICTIM_WORKLOAD}")
    ck.add("an unscoped key reaches only its own tenant's workloads",
           code in (101, 404) and victim.encode() not in body, f"HTTP {code}")
    if code == 101:  # the attacker has a workload of that name: it must be its own
        async with _connect(url, any_key, f"workload={VICTIM_WORKLOAD}") as ws:
            tenant = _unpack(await ws.recv())["tenant"]
        ck.add("... and serves the attacker's own", tenant == attacker, tenant)
    doomed, info = await add_key(dep.admin, attacker, workload=WORKLOAD)
    async with _connect(url, doomed) as ws:
        await ws.recv()
        await remove_key(dep.admin, attacker, info.key_id)
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(ws.recv(), 10)
            closed = "still open"
        except ConnectionClosed as e:
            closed = str(e.rcvd.code if e.rcvd else None)
        except TimeoutError:
            closed = "still open after 10 s"
        ck.add("a revoked key's open connection closed", closed == "1008",
               f"{closed} in {time.perf_counter() - t0:.1f}s")
    code, _ = await _status(url, doomed)
    ck.add("a revoked key refused", code == 401, f"HTTP {code}")
    return ck.result()


async def _frames(url: str, key: str, victim_key: str) -> Checks:
    """A 100 MB frame, msgpack bombs, non-finite and mis-shaped arrays."""
    from websockets.exceptions import ConnectionClosed

    ck = Checks()
    t0 = time.perf_counter()
    code: Any = None
    ws = await _connect(url, key, write_limit=4 * MiB)
    try:
        meta = _unpack(await ws.recv())
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            await asyncio.wait_for(ws.send(b"\x00" * (100 * MiB)), 30)
        try:
            await asyncio.wait_for(ws.recv(), 30)
        except ConnectionClosed as e:
            code = e.rcvd.code if e.rcvd else None
            if e.rcvd and "exceeds limit" not in e.rcvd.reason:  # says why, to the client
                code = f"{code} without the limit in its reason: {e.rcvd.reason[:60]!r}"
        except TimeoutError:
            code = "no close"
    finally:  # the server hung up mid-send: websockets' own close would trip over it
        with contextlib.suppress(Exception):
            ws.transport.abort()
    ck.add("a 100 MB frame closes with 1009", code == 1009,
           f"{code} in {time.perf_counter() - t0:.1f}s")
    bombs = [
        ("deep nesting", b"\x91" * 100_000 + b"\xc0"),
        ("huge declared array", b"\xdd\xff\xff\xff\xff\xc0"),
        ("huge declared bytes", b"\xc6\x7f\xff\xff\xff"),
        ("a map of 10,000 keys", msgspec.msgpack.encode({f"k{i}": i for i in range(10_000)})),
        ("an array claiming 2^60 bytes", msgspec.msgpack.encode({"observation/state": {
            b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**30, 2**30]}})),
        ("object dtype", msgspec.msgpack.encode({"observation/state": {
            b"__ndarray__": True, b"data": b"x" * 8, b"dtype": "|O", b"shape": [1]}})),
        ("NaN state", observation(meta, {"observation/state": np.full(meta["state_dim"],
                                                                         np.nan, np.float32)})),
        ("inf state", observation(meta, {"observation/state": np.full(meta["state_dim"],
                                                                         np.inf)})),
        ("mis-shaped image", observation(meta, {
            f"observation/images/{meta['cameras'][0]}": np.zeros((7, 7, 3), np.uint8)})),
    ]
    async with _connect(url, key) as ws:
        await ws.recv()
        bad = []
        for what, frame in bombs:
            await ws.send(frame)
            reply = await asyncio.wait_for(ws.recv(), 20)
            if not isinstance(reply, str) or "internal error" in reply:
                bad.append(f"{what}: {str(reply)[:60]}")
        ck.add("every bomb answered with an error string", not bad, "; ".join(bad[:3]))
        await ws.send(observation(meta, seed=1))
        reply = await asyncio.wait_for(ws.recv(), 20)
        ck.add("the same connection still serves", isinstance(reply, bytes))
    return ck


async def _never_reads(url: str, key: str, victim_key: str) -> Checks:
    """A client that sends observations and never reads a reply: cut off, and the
    victim's own gateway connection keeps serving meanwhile."""
    from websockets.exceptions import ConnectionClosed

    ck = Checks()
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, full soon
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    t0, sent, cut = time.perf_counter(), 0, "not cut off within 90 s"
    async with _connect(url, key, sock=sock, max_queue=1) as ws:
        meta = _unpack(await ws.recv())
        frame = observation(meta, {"pad": "x" * 512})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(90):
                while True:
                    try:
                        await ws.send(frame)
                        sent += 1
                    except ConnectionClosed:
                        cut = f"cut off after {sent} frames in {time.perf_counter() - t0:.1f}s"
                        break
                    if sent % 50 == 0:
                        ok, note = await _served(url, victim_key)
                        if not ok:
                            cut = f"the victim's gateway connection failed: {note}"
                            break
    ck.add("a client that never reads is cut off", cut.startswith("cut off"), cut)
    return ck


async def _connections(url: str, key: str, victim_key: str) -> Checks:
    """1,000 connections from one tenant against its cap; the victim still connects."""
    from websockets.exceptions import InvalidStatus

    ck = Checks()
    held: list[Any] = []
    codes: dict[str, int] = {}
    t0 = time.perf_counter()

    async def one() -> None:
        try:
            held.append(await _connect(url, key).__aenter__())
            codes["101"] = codes.get("101", 0) + 1
        except InvalidStatus as e:
            c = str(e.response.status_code)
            codes[c] = codes.get(c, 0) + 1
        except Exception as e:
            codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1

    try:
        for i in range(0, FLOOD, 100):
            await asyncio.gather(*(one() for _ in range(min(100, FLOOD - i))))
        took = time.perf_counter() - t0
        ok, note = await _served(url, victim_key)
        ck.add("the victim is served during the flood", ok, note)
    finally:
        await asyncio.gather(*(ws.close() for ws in held), return_exceptions=True)
    ck.add(f"{FLOOD} connections bounded by the tenant's cap",
           codes.get("101", 0) <= 16 and codes.get("429", 0) >= FLOOD - 16,
           f"{codes} in {took:.1f}s")
    await asyncio.sleep(0.5)
    ok, note = await _served(url, key)
    ck.add("the attacker connects again once it closed them", ok, note)
    return ck


#: The attacks that run from a process of their own (as a client on another machine
#: would: their encoding and buffers are not the victim probe's event loop's), at the
#: lowest priority, as the floods (``..flood.lowest_priority``).
PARTS = {"frames": _frames, "never_reads": _never_reads, "connections": _connections}


async def _from_own_process(dep: SecuredDeployment, part: str, attacker: str,
                            victim: str) -> AttackResult:
    key = await _keys(dep, attacker, WORKLOAD)
    victim_key = await _keys(dep, victim, VICTIM_WORKLOAD)
    proc = await asyncio.create_subprocess_exec(
        *lowest_priority([sys.executable, "-m", "joynexus.ops.isolation.attacks.gateway", part,
                          dep.gateway_url]),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:  # the keys through stdin, not the command line
        out, err = await asyncio.wait_for(proc.communicate(f"{key}\n{victim_key}\n".encode()),
                                          170)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return AttackResult(False, f"the attacker's process ({part}) did not finish in 170 s")
    if proc.returncode != 0:
        return AttackResult(False, f"the attacker's process ({part}) exited {proc.returncode}: "
                            f"{err.decode()[-400:]}")
    ck = Checks()
    for name, ok, note in json.loads(out.decode().strip().splitlines()[-1]):
        ck.add(name, ok, note)
    return ck.result()


@_ends_its_workload
async def attack_gateway_frames(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """A 100 MB frame, msgpack bombs, non-finite and mis-shaped arrays."""
    return await _from_own_process(dep, "frames", attacker, victim)


@_ends_its_workload
async def attack_gateway_never_reads(dep: SecuredDeployment, attacker: str,
                                     victim: str) -> AttackResult:
    """A client that never reads its replies: cut off; the victim served meanwhile."""
    return await _from_own_process(dep, "never_reads", attacker, victim)


@_ends_its_workload
async def attack_gateway_connections(dep: SecuredDeployment, attacker: str,
                                     victim: str) -> AttackResult:
    """1,000 connections from one tenant against its cap; the victim still served."""
    return await _from_own_process(dep, "connections", attacker, victim)


def main() -> None:
    """``python -m joynexus.ops.isolation.attacks.gateway PART URL``, the attacker's and the
    victim's keys on stdin: the part's checks as one JSON line."""
    part, url = sys.argv[1], sys.argv[2]
    key, victim_key = sys.stdin.read().split()[:2]
    print(json.dumps(asyncio.run(PARTS[part](url, key, victim_key)).items), flush=True)


__all__ = ["FLOOD", "WORKLOAD", "attack_gateway_connections", "attack_gateway_frames",
           "attack_gateway_keys", "attack_gateway_never_reads", "observation"]


if __name__ == "__main__":
    main()
