"""broker/fastpath.py against the real nats-server: same answers, errors and order
as nats-py's own request/publish, and nats-py's path whenever the fast one can't hold."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import nats.aio.client as nac
import pytest
from nats import errors
from nats.micro import add_service
from nats.micro.request import Request

from joynexus.broker import rpc
from joynexus.broker.connection import Broker
from joynexus.broker.fastpath import (
    SUPPORTED_NATS,
    FastPath,
    FastResponder,
    sync_server,
    unsupported_reason,
)
from joynexus.broker.responder import Server
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.base import Wire, encode
from joynexus.schemas.errors import QuotaExceeded


def _subj(what: str) -> str:
    return f"fp.{what}.{uuid.uuid4().hex[:8]}"


async def _settled(c: Any) -> None:
    """Until the server has ``c``'s subscriptions (one flush() does not promise it)."""
    await sync_server(c)


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Any]:
    c = await nats.connect(nats_server.url, name="test-fastpath")
    yield c
    await c.close()


@pytest.fixture
async def responder(nats_server: EmbeddedNats) -> AsyncIterator[Any]:
    c = await nats.connect(nats_server.url, name="test-fastpath-responder")
    yield c
    await c.close()


async def _echo(responder: Any, subject: str, *, delay: bool = False) -> None:
    """Reply with the request's payload reversed and its headers (after a random pause)."""

    async def handle(msg: Any) -> None:
        if delay:
            await asyncio.sleep(random.random() * 0.02)
        await responder.publish(msg.reply, msg.data[::-1], headers=msg.headers)

    tasks: set[asyncio.Future[None]] = set()

    async def spawn(msg: Any) -> None:  # many at once, answered out of order
        t = asyncio.ensure_future(handle(msg))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    await responder.subscribe(subject, cb=spawn)
    await _settled(responder)


async def test_payload_and_headers_as_nc_request(nc: Any, responder: Any) -> None:
    subject = _subj("echo")
    await _echo(responder, subject)
    fp = FastPath(nc)
    assert fp.enabled, fp.reason
    payload = bytes(range(256)) * 80  # binary, with CR/LF bytes, 20 KB
    headers = {"Trace-Id": "abc", "X-Odd": "  a\r\nb  ", "Empty": ""}
    got = await fp.request(subject, payload, timeout=5, headers=headers)
    ref = await nc.request(subject, payload, timeout=5, headers=headers)
    assert got.data == payload[::-1] == ref.data
    assert got.headers == ref.headers
    assert got.headers is not None and got.headers["Trace-Id"] == "abc"
    plain = await fp.request(subject, b"hello", timeout=5)
    assert plain.data == b"olleh" and not plain.headers
    empty = await fp.request(subject, b"", timeout=5)
    assert empty.data == b""
    assert fp.counts["fast_request"] == 3 and fp.counts["fallback_request"] == 0
    with pytest.raises(errors.BadHeaderError):
        await fp.request(subject, b"x", timeout=5, headers={"bad key": "v"})
    with pytest.raises(errors.BadSubjectError):
        await fp.request("bad subject", b"x", timeout=5)
    await fp.close()


async def test_many_concurrent_requests_get_their_own_replies(nc: Any, responder: Any) -> None:
    subject = _subj("many")
    await _echo(responder, subject, delay=True)
    fp = FastPath(nc)
    payloads = [f"request-{i}-{uuid.uuid4().hex}".encode() for i in range(300)]
    replies = await asyncio.gather(*(fp.request(subject, p, timeout=10) for p in payloads))
    assert [r.data for r in replies] == [p[::-1] for p in payloads]
    assert fp.counts["fast_request"] == 300
    assert not fp._futures  # nothing left waiting


async def test_no_responders_and_timeout_raise_as_nc_request(nc: Any, responder: Any) -> None:
    fp = FastPath(nc)
    nobody = _subj("nobody")
    with pytest.raises(errors.NoRespondersError):
        await nc.request(nobody, b"x", timeout=2)
    with pytest.raises(errors.NoRespondersError):
        await fp.request(nobody, b"x", timeout=2)

    silent = _subj("silent")
    async def ignore(msg: Any) -> None:  # listens, never answers
        pass

    await responder.subscribe(silent, cb=ignore)
    await _settled(responder)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(errors.TimeoutError) as info:
        await fp.request(silent, b"x", timeout=0.3)
    assert isinstance(info.value, asyncio.TimeoutError)
    assert 0.29 <= loop.time() - t0 < 2.0
    assert not fp._futures
    # a late answer to a request that timed out is dropped, not delivered to the next one
    echo = _subj("after")
    await _echo(responder, echo)
    assert (await fp.request(echo, b"ab", timeout=5)).data == b"ba"


async def test_respond_answers_micro_and_plain_requests(nc: Any, responder: Any) -> None:
    fp_resp = FastPath(responder)
    name = "fp" + uuid.uuid4().hex[:8]

    async def handler(req: Request) -> None:
        await fp_resp.respond(req, req.data.upper(), headers={"Served-By": "fast"})

    svc = await add_service(responder, name=name, version="0.0.1")
    await svc.add_endpoint(name="up", subject=f"{name}.up", handler=handler)
    plain = _subj("plain")

    async def plain_cb(msg: Any) -> None:
        await fp_resp.respond(msg, b"plain:" + msg.data)

    await responder.subscribe(plain, cb=plain_cb)
    await _settled(responder)
    m = await nc.request(f"{name}.up", b"abc", timeout=5, headers={"Ignored": "1"})
    assert m.data == b"ABC" and m.headers == {"Served-By": "fast"}
    m2 = await FastPath(nc).request(plain, b"x", timeout=5)
    assert m2.data == b"plain:x" and not m2.headers
    assert fp_resp.counts["fast_publish"] == 2
    with pytest.raises(ValueError):
        await fp_resp.respond(m2, b"no reply subject")
    await svc.stop()


async def test_order_kept_behind_nats_py_pending_publishes(nc: Any, responder: Any) -> None:
    subject = _subj("order")
    seen: list[bytes] = []
    done = asyncio.Event()
    total = 200

    async def collect(msg: Any) -> None:
        seen.append(msg.data)
        if len(seen) == total:
            done.set()

    await responder.subscribe(subject, cb=collect)
    await _settled(responder)
    fp = FastPath(nc)
    rng = random.Random(7)
    sent: list[bytes] = []
    for i in range(total):
        data = str(i).encode()
        sent.append(data)
        if rng.random() < 0.5:
            # nats-py buffers this one until its flusher task runs (no await yields before)
            await nc.publish(subject, data)
        else:
            await fp.publish(subject, data)
        if rng.random() < 0.3:
            await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), 10)
    assert seen == sent
    # both of the fast path's ways were taken: straight to the socket, and behind nats-py's buffer
    assert fp.counts["fast_publish"] > 0 and fp.counts["fallback_publish"] > 0


async def test_unsupported_nats_py_falls_back_to_the_public_api(
    nc: Any, responder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    low, high = SUPPORTED_NATS
    assert unsupported_reason(nc) is None
    assert "outside" in (unsupported_reason(nc, f"{high[0]}.{high[1]}.0") or "")
    assert "outside" in (unsupported_reason(nc, f"{low[0]}.{low[1] - 1}.9") or "")
    assert "not a nats-py Client" in (unsupported_reason(object()) or "")
    monkeypatch.setattr(nac, "__version__", f"{high[0]}.{high[1]}.0")
    fp = FastPath(nc)
    assert not fp.enabled and fp.reason and "outside" in fp.reason
    subject = _subj("fallback")
    await _echo(responder, subject)
    m = await fp.request(subject, b"abc", timeout=5, headers={"K": "v"})
    assert m.data == b"cba" and m.headers == {"K": "v"}
    with pytest.raises(errors.NoRespondersError):
        await fp.request(_subj("nobody"), b"x", timeout=2)
    await fp.publish(subject + ".void", b"x")
    assert fp.counts == {"fast_publish": 0, "fallback_publish": 1, "fast_request": 0, "fallback_request": 2}
    off = FastPath(nc, enabled=False)
    assert not off.enabled and (await off.request(subject, b"xy", timeout=5)).data == b"yx"


class _Proxy:
    """A TCP relay in front of the server that can drop every connection and refuse new ones."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)
        self._writers += [w, uw]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        for t in (asyncio.ensure_future(pump(r, uw)), asyncio.ensure_future(pump(ur, w))):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def cut(self) -> None:
        """Stop listening and drop every relayed connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in self._writers:
            w.close()
        self._writers = []


async def test_reconnect_falls_back_then_takes_the_fast_path_again(
    nats_server: EmbeddedNats, responder: Any
) -> None:
    host, port = nats_server.url.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = _Proxy(host, int(port))
    await proxy.start()
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    c = await nats.connect(f"nats://127.0.0.1:{proxy.port}", name="test-fastpath-proxy",
                           reconnect_time_wait=0.1, max_reconnect_attempts=-1,
                           reconnected_cb=on_reconnect)
    try:
        subject = _subj("reconnect")
        await _echo(responder, subject)
        fp = FastPath(c)
        assert (await fp.request(subject, b"one", timeout=5)).data == b"eno"
        await proxy.cut()
        for _ in range(200):  # until nats-py sees the connection gone
            if not c.is_connected:
                break
            await asyncio.sleep(0.01)
        assert not c.is_connected
        # while disconnected: nats-py's own request (its publish waits in its buffer)
        pending = asyncio.ensure_future(fp.request(subject, b"two", timeout=10))
        await asyncio.sleep(0.3)
        assert fp.counts["fallback_request"] == 1 and not pending.done()
        await proxy.start()  # the same port again
        assert (await pending).data == b"owt"
        await asyncio.wait_for(reconnected.wait(), 10)
        # reconnected: the fast path again, its reply subscription replayed by nats-py
        assert (await fp.request(subject, b"three", timeout=5)).data == b"eerht"
        assert fp.counts["fast_request"] == 2 and fp.counts["fallback_request"] == 1
    finally:
        await c.close()
        await proxy.cut()


async def test_sync_server_waits_for_a_subscription_just_made(nc: Any, responder: Any) -> None:
    async def answer(msg: Any) -> None:
        await responder.publish(msg.reply, b"ok")

    for _ in range(150):  # subscribe, sync_server, ask at once from another connection
        subject = _subj("settle")
        sub = await responder.subscribe(subject, cb=answer)
        await sync_server(responder)
        assert (await nc.request(subject, b"", timeout=5)).data == b"ok"
        await sub.unsubscribe()


class _Ask(Wire, kw_only=True):
    text: str
    fail: bool = False


class _Answer(Wire, kw_only=True, omit_defaults=True):
    text: str = ""
    error: Any = None


async def test_plugged_into_the_rpc_seams_on_both_sides(broker: Broker) -> None:
    """rpc.call(request=FastPath(b.nc).request) and responder.Server(respond=FastResponder()):
    the same answers and typed errors as nats-py's own request and respond."""
    from joynexus.schemas.base import decode

    respond = FastResponder()
    server = Server(broker, "fp-echo", respond=respond, limit=lambda _t: 1000,
                        error_reply=lambda code, message: _Answer(error={"code": code, "message": message}))
    subject = broker.names.api("acme", "fpecho")

    async def on_request(request: Any) -> None:
        async def handle() -> _Answer:
            req = decode(request.data, _Ask, what="ask")
            if req.fail:
                raise QuotaExceeded("over its bound")
            return _Answer(text=req.text.upper())

        server.serve(request, handle, span="fp-echo", tenant="acme")

    nc = await server.connection()
    svc = await add_service(nc, name=f"{broker.names.namespace}-fpecho", version="0.1.0")
    await svc.add_endpoint(name="e", subject=subject, handler=on_request)
    await sync_server(nc)

    def decode_answer(data: bytes) -> str:
        a = decode(data, _Answer, what="answer")
        if a.error:
            raise QuotaExceeded(a.error["message"])
        return a.text

    fp = FastPath(broker.nc)
    try:
        got = await asyncio.gather(*(rpc.call(broker, subject, encode(_Ask(text=f"t{i}")), decode_answer,
                                              timeout_s=5, request=fp.request) for i in range(50)))
        assert got == [f"T{i}" for i in range(50)]
        with pytest.raises(QuotaExceeded, match="over its bound"):
            await rpc.call(broker, subject, encode(_Ask(text="x", fail=True)), decode_answer, timeout_s=5,
                           request=fp.request)
        with pytest.raises(rpc.NoResponders):
            await rpc.call(broker, broker.names.api("acme", "nobody"), b"", decode_answer, timeout_s=2,
                           request=fp.request)

        async def ignore(_m: Any) -> None:
            return None

        silent = broker.names.api("acme", "silent")
        sub = await broker.nc.subscribe(silent, cb=ignore)
        await sync_server(broker.nc)
        with pytest.raises(rpc.NoReply):
            await rpc.call(broker, silent, b"", decode_answer, timeout_s=0.3, request=fp.request)
        await sub.unsubscribe()
    finally:
        await svc.stop()
        await server.stop()
    assert fp.counts["fast_request"] == 53 and fp.counts["fallback_request"] == 0
    answers = respond.path(nc).counts
    assert answers["fast_publish"] > 0
    assert answers["fast_publish"] + answers["fallback_publish"] == 51  # every answer, the error's too


async def test_a_burst_in_one_turn_goes_out_once_and_in_order(nc: Any, responder: Any) -> None:
    subject = _subj("burst")
    seen: list[bytes] = []
    done = asyncio.Event()

    async def collect(msg: Any) -> None:
        seen.append(msg.data)
        if len(seen) == 60:
            done.set()

    await responder.subscribe(subject, cb=collect)
    await _settled(responder)
    fp = FastPath(nc)
    for turn in range(3):
        for i in range(20):  # no await yields in between: one turn of the loop
            await fp.publish(subject, f"{turn}-{i}".encode())
        await asyncio.sleep(0.01)
    await asyncio.wait_for(done.wait(), 10)
    assert seen == [f"{t}-{i}".encode() for t in range(3) for i in range(20)]
    assert fp.counts["fast_publish"] == 3 and fp.counts["fallback_publish"] == 57


async def test_bench_rr_echo_measures_both_paths(nats_server: EmbeddedNats) -> None:
    """The benchmark's echo part runs (a responder process, both paths, bare TCP) and
    really took the fast path; the figures themselves belong to `joynexus bench rr`."""
    from joynexus.ops.bench.rr import bench_rr

    out = await bench_rr(nats_server.url, part="echo", repeats=4, gap_ms=0)
    echo = out["echo"]
    assert echo["fastpath_reason"] is None
    assert echo["fastpath_counts"]["fast_request"] == 3 * (20 + 4)  # small, real, held
    for label in ("small", "real", "real_held_6ms_outside"):
        assert echo[label]["nats"]["n"] == echo[label]["fastpath"]["n"] == 4
        assert len(echo[label]["fastpath_minus_nats_p50_ms"]) == 3
    assert echo["small"]["bare_tcp"]["n"] == 4
    assert echo["payload_bytes"]["real"] > 10_000 and out["load"]["after"]["cpus"] >= 1


async def test_the_responder_lets_go_of_closed_connections(broker: Broker) -> None:
    """One path per live connection: a closed connection's path (which holds it)
    is dropped when another connection is first answered on."""
    respond = FastResponder()
    other = await Broker.connect(broker.url, name="fp-other", namespace=broker.names.namespace,
                                 credentials=broker.credentials)
    first = respond.path(other.nc)
    assert respond.path(other.nc) is first  # the same connection: the same path
    await other.close()
    mine = respond.path(broker.nc)
    assert mine.nc is broker.nc and mine is respond.path(broker.nc)
    assert [p.nc for p in respond._paths.values()] == [broker.nc]
