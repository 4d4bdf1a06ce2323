"""The policy gateway: openpi's websocket policy protocol at the door, the Inference
Queue behind it (role ``gateway``).

Per connection: the handshake must carry ``Authorization: Api-Key <key>``
(:mod:`.keystore`); the URL may name ``?workload=W&version=N`` where the key does
not fix them (default workload ``default``, the latest version). The gateway
sends the policy's metadata first (:meth:`PolicyView.metadata`), then answers
each observation frame with ``{"actions": [H, A], "policy_version", "server_timing"}``,
asking the Inference Queue on the agents' subject for that tenant
(``<ns>.isvc.<model>.<tenant>``), so gateway requests batch with rollouts and
evaluations and count as the tenant's inference (its quota, its meter). A bad
observation gets a text frame naming what is wrong (openpi's convention) and the
connection stays open.

Bounds: one request in flight per connection (frames are read one at a time, and
at most one more is buffered: ``max_queue=1``), a frame size limit (a larger
frame closes the connection with 1009 before its body is read), an idle timeout,
a send timeout (a client that never reads is cut off), connections per tenant and
in all. A revoked key's connections close at once (1008).

See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from joynexus.agents.gateway import codec
from joynexus.agents.gateway.keystore import KeyStore
from joynexus.agents.gateway.observation import PolicyView
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.inference_client import InferenceClient
from joynexus.broker.policy import PolicyRecords
from joynexus.schemas.apikeys import ApiKeyRecord
from joynexus.schemas.base import decode
from joynexus.schemas.errors import InvalidSpec, JoyNexusError
from joynexus.schemas.jobs import check_name
from joynexus.schemas.samples import ACTIONS_FIELD
from joynexus.schemas.workloads import WorkloadRecord

log = logging.getLogger(__name__)
#: Each connection's kernel send buffer (loopback autotunes it to megabytes, so a
#: client that never reads its small replies held its slot for minutes), and the
#: websocket's own write buffer before a send waits (its default: 32 KiB). Together
#: they bound what a client that never reads holds before it is cut off: about 250
#: answers, 6-10 s (at 64 KiB and the default: about 870 answers, 15-20 s).
SEND_BUFFER_BYTES = 16 * 1024
WRITE_LIMIT_BYTES = 8 * 1024

#: openpi's reply key for the action chunk (the same word as the Training Queue's field).
ACTIONS_KEY = ACTIONS_FIELD


@dataclass
class GatewayOptions:
    host: str = field(default_factory=lambda: os.environ.get("JOYNEXUS_GATEWAY_HOST", "0.0.0.0"))
    #: openpi's default port; 0: any free one (``PolicyGateway.port`` says which).
    port: int = field(default_factory=lambda: int(os.environ.get("JOYNEXUS_GATEWAY_PORT", "8000")))
    tls_cert: str | None = field(default_factory=lambda: os.environ.get("JOYNEXUS_GATEWAY_TLS_CERT"))
    tls_key: str | None = field(default_factory=lambda: os.environ.get("JOYNEXUS_GATEWAY_TLS_KEY"))
    #: Largest observation frame (None: the NATS server's max_payload, which the
    #: request to the engine must fit anyway).
    max_frame_bytes: int | None = None
    idle_s: float = field(
        default_factory=lambda: float(os.environ.get("JOYNEXUS_GATEWAY_IDLE_S", "300")))
    #: A client that does not read its replies for this long is cut off.
    send_timeout_s: float = field(
        default_factory=lambda: float(os.environ.get("JOYNEXUS_GATEWAY_SEND_TIMEOUT_S", "10")))
    infer_timeout_s: float = 10.0
    max_conns_per_tenant: int = field(
        default_factory=lambda: int(os.environ.get("JOYNEXUS_GATEWAY_TENANT_CONNS", "16")))
    max_conns: int = 1024


@dataclass
class _Session:
    key: ApiKeyRecord
    view: PolicyView


class PolicyGateway:
    def __init__(self, b: Broker, opts: GatewayOptions | None = None, *,
                 instance: str = "gateway") -> None:
        self.b = b
        self.o = opts or GatewayOptions()
        self.instance = instance
        self.keys = KeyStore(b, instance=instance)
        self.keys.on_revoke = self._revoked
        self.infer = InferenceClient(b, service=True, timeout_s=self.o.infer_timeout_s,
                                     retry_for_s=2.0)
        self.policies = PolicyRecords(b)
        self.port = 0
        self._server: Any = None
        self._pending: dict[ServerConnection, _Session] = {}
        self._by_key: dict[str, set[ServerConnection]] = {}
        self._per_tenant: Counter[str] = Counter()
        self._open = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.keys.start()
        ctx = None
        if self.o.tls_cert:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(self.o.tls_cert, self.o.tls_key)
        self._server = await serve(
            self._handler, self.o.host, self.o.port, ssl=ctx,
            process_request=self._process_request, compression=None,
            max_size=self.o.max_frame_bytes or self.b.max_payload, max_queue=1,
            write_limit=WRITE_LIMIT_BYTES,
            server_header="joynexus-gateway", logger=logging.getLogger(__name__ + ".ws"),
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 10)
        await self.keys.stop()

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _refuse(self, tenant: str, action: str, reason: str) -> None:
        self._spawn(metrics.security(self.b, tenant, action=action, subject="gateway",
                                     reason=reason, source="gateway"))

    # ------------------------------------------------------------ handshake
    async def _process_request(self, conn: ServerConnection, request: Any) -> Any:
        url = urlsplit(request.path)
        if url.path == "/healthz":
            return conn.respond(HTTPStatus.OK, "OK\n")
        if self._open >= self.o.max_conns:
            return conn.respond(HTTPStatus.SERVICE_UNAVAILABLE, "gateway at its connection limit\n")
        scheme, _, presented = (request.headers.get("Authorization") or "").partition(" ")
        key = self.keys.check(presented) if scheme.lower() == "api-key" else None
        if key is None:
            self._refuse("_", "gateway_auth", "missing, malformed, wrong or revoked API key")
            return conn.respond(HTTPStatus.UNAUTHORIZED, "invalid or revoked API key\n")
        tenant = key.tenant_id
        # The cap first: a flood of refused handshakes costs a hash each, no KV reads.
        if self._per_tenant[tenant] >= self.o.max_conns_per_tenant:
            self._refuse(tenant, "gateway_connections",
                         f"{self.o.max_conns_per_tenant} gateway connections already open")
            return conn.respond(HTTPStatus.TOO_MANY_REQUESTS,
                                f"tenant {tenant!r} has {self._per_tenant[tenant]} gateway "
                                "connections open, its limit\n")
        self._per_tenant[tenant] += 1  # held while the policy is looked up
        try:
            view = await self._view(key, parse_qs(url.query))
        except PermissionError as e:
            self._release(tenant)
            self._refuse(tenant, "gateway_scope", str(e))
            return conn.respond(HTTPStatus.FORBIDDEN, f"{e}\n")
        except JoyNexusError as e:
            self._release(tenant)
            return conn.respond(HTTPStatus.NOT_FOUND, f"{type(e).__name__}: {e}\n")
        except BaseException:
            self._release(tenant)
            raise
        self._open += 1
        self._pending[conn] = _Session(key, view)
        self._spawn(self._release_when_closed(conn, tenant))
        self.keys.used(key.key_id)
        return None

    async def _view(self, key: ApiKeyRecord, q: dict[str, list[str]]) -> PolicyView:
        asked = (q.get("workload") or [""])[0]
        if key.workload and asked and asked != key.workload:
            raise PermissionError(f"this key serves workload {key.workload!r} only")
        workload = key.workload or asked or "default"
        check_name("workload", workload)
        try:
            asked_v = int((q.get("version") or ["0"])[0])
        except ValueError:
            raise InvalidSpec("version must be an integer") from None
        if key.version and asked_v and asked_v != key.version:
            raise PermissionError(f"this key is pinned to version {key.version}")
        pinned = key.version or asked_v or None
        rec = await self.policies.get(key.tenant_id, workload, pinned)
        return PolicyView(key.tenant_id, workload, rec, pinned,
                          await self._instruction(key.tenant_id, workload))

    async def _instruction(self, tenant: str, workload: str) -> str:
        with contextlib.suppress(Exception):
            kv = await self.b.js.key_value(self.b.names.workloads_bucket)
            entry = await kv.get(self.b.names.workload_key(tenant, workload))
            rec = decode(entry.value or b"", WorkloadRecord)
            if rec.tenant_id == tenant:
                return rec.policy_instruction()
        return ""

    async def _release_when_closed(self, conn: ServerConnection, tenant: str) -> None:
        try:
            await conn.wait_closed()
        finally:
            self._release(tenant)
            self._open -= 1
            self._pending.pop(conn, None)

    def _release(self, tenant: str) -> None:
        self._per_tenant[tenant] -= 1
        if self._per_tenant[tenant] <= 0:
            del self._per_tenant[tenant]

    # ------------------------------------------------------------ the session
    def _revoked(self, key_id: str) -> None:
        for conn in self._by_key.pop(key_id, set()):
            self._spawn(conn.close(1008, "API key revoked"))

    async def _handler(self, conn: ServerConnection) -> None:
        s = self._pending.pop(conn, None)
        if s is None or s.key.key_id not in self.keys.records:
            await conn.close(1008, "API key revoked")
            return
        self._by_key.setdefault(s.key.key_id, set()).add(conn)
        sock = conn.transport.get_extra_info("socket")
        if sock is not None:  # a small kernel send buffer: a client that never reads
            with contextlib.suppress(OSError):  # fills it, and is cut off, in seconds
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        try:
            await self._send(conn, codec.encode(s.view.metadata()))
            while True:
                try:
                    frame = await asyncio.wait_for(conn.recv(), self.o.idle_s)
                except TimeoutError:
                    await conn.close(1000, f"idle for {self.o.idle_s:g}s")
                    return
                if isinstance(frame, str):
                    await self._send(conn, "InvalidMessage: send observations as binary "
                                           "msgpack frames (openpi_client.msgpack_numpy)")
                    continue
                await self._send(conn, await self.answer(s.view, frame))
        except ConnectionClosed:
            pass
        except TimeoutError:  # a client that does not read its replies
            log.info("gateway: %s did not read its replies; cut off", s.key.tenant_id)
            conn.transport.abort()
        finally:
            self._by_key.get(s.key.key_id, set()).discard(conn)

    async def _send(self, conn: ServerConnection, data: bytes | str) -> None:
        await asyncio.wait_for(conn.send(data), self.o.send_timeout_s)

    async def answer(self, view: PolicyView, frame: bytes) -> bytes | str:
        """One observation frame's reply: packed actions, or an error string."""
        try:
            obs = codec.decode_observation(frame)
            images, state, prompt = view.inputs(obs)
            t0 = time.perf_counter()
            res = await self.infer.request(
                view.tenant, schema=view.record.schema_signature, images=images,
                instruction=prompt, state=state, workload=view.workload,
                policy_version=view.pinned, base_model=view.record.base_model,
            )
            infer_ms = (time.perf_counter() - t0) * 1e3
            actions = np.asarray(res.actions.to_array(ACTIONS_KEY), dtype=np.float32)[0]
        except JoyNexusError as e:
            return f"{type(e).__name__}: {e}"
        except Exception:
            log.exception("gateway: request of tenant %s failed", view.tenant)
            return "internal error in the gateway (see its log)"
        return codec.encode({
            ACTIONS_KEY: codec.pack_array(actions),
            "policy_version": res.policy_version,
            "server_timing": {"infer_ms": infer_ms, "engine_ms": res.timings.total_ms},
        })


async def run_gateway(b: Broker, stop: asyncio.Event, ready: Any, *, instance: str,
                      opts: GatewayOptions | None = None, announce: Any = None) -> None:
    """The role: serve until ``stop`` (port and TLS from ``$JOYNEXUS_GATEWAY_*``);
    ``announce(url)`` is told its address (the heartbeats carry it)."""
    gw = PolicyGateway(b, opts, instance=instance)
    await gw.start()
    scheme = "wss" if gw.o.tls_cert else "ws"
    url = f"{scheme}://{gw.o.host}:{gw.port}"
    print(f"{instance}: openpi policy gateway on {url}", flush=True)
    if announce is not None:
        announce(url)
    ready()
    try:
        await stop.wait()
    finally:
        await gw.stop()
