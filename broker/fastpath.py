"""Request/reply on a nats-py connection without nats-py's extra event-loop hops.

nats-py's ``nc.request`` goes publish -> pending buffer -> a wake-up of the
flusher task -> socket, and the reply comes back read loop -> the reply
subscription's queue -> that subscription's task -> the request's future ->
``wait_for``'s waiter -> the caller: four hops through the event loop besides
the socket's own. :class:`FastPath` keeps the same wire protocol and the same
semantics and skips them:

- **publish**: when nothing is waiting in nats-py's pending buffer, the
  socket's write buffer is empty and no other publish went straight out in this
  turn of the event loop, the PUB/HPUB bytes go straight to the transport (the
  same bytes nats-py would write). Otherwise it is ``nc.publish``: order is
  kept, backpressure applies, and a burst (requests gathered, a batch's
  replies) leaves in one write of nats-py's flusher, not one send a message.
- **request**: one wildcard reply subscription per connection (``<inbox>.*``,
  under the connection's own inbox prefix, replayed by nats-py on reconnect)
  whose messages resolve the waiting future from the read loop itself, and a
  timer instead of ``wait_for``.
- **fallback**: while the connection is not plainly connected (reconnecting,
  draining, closed), or on a nats-py outside the tested range (2.16.x) or without the
  private attributes used, every call is exactly ``nc.request`` /
  ``nc.publish``. ``FastPath.reason`` says why a connection has no fast path.

Errors are nats-py's: ``nats.errors.NoRespondersError`` when the server says
no one listens, ``nats.errors.TimeoutError`` (an ``asyncio.TimeoutError``) past
``timeout``, ``BadSubjectError`` / ``BadHeaderError`` / ``MaxPayloadError`` as
``nc.publish`` raises them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from nats import errors
from nats.aio.client import Client
from nats.aio.msg import Msg

__all__ = [
    "SUPPORTED_NATS",
    "FastPath",
    "FastResponder",
    "enabled_by_env",
    "sync_server",
    "unsupported_reason",
]

#: ``JOYNEXUS_FASTPATH=0`` turns the fast path off in every process of a deployment
#: (the Inference Queue's clients and engines then use nats-py's own path).
ENV = "JOYNEXUS_FASTPATH"


def enabled_by_env() -> bool:
    """Whether this process may take the fast path (default yes; ``JOYNEXUS_FASTPATH=0``: no)."""
    import os

    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


#: nats-py versions whose internals this module was read and tested against: [low, high).
SUPPORTED_NATS = ((2, 16), (2, 17))

#: Private names of nats-py read here; a connection lacking any of them gets no fast path.
_CLIENT_ATTRS = ("_pending", "_pending_data_size", "_max_payload", "_transport", "_status", "stats")
_MODULE_ATTRS = ("_validate_subject", "_HEADER_KEY_RE", "_HEADER_VALUE_NEWLINES", "NATS_HDR_LINE")

_CRLF = b"\r\n"
_STATUS_HDR = "Status"
_NO_RESPONDERS = "503"


def _version(text: str) -> tuple[int, int]:
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def unsupported_reason(nc: Any, version: str | None = None) -> str | None:
    """Why ``nc`` cannot take the fast path (None: it can)."""
    import nats.aio.client as nac

    v = _version(version if version is not None else getattr(nac, "__version__", "0.0"))
    low, high = SUPPORTED_NATS
    if not low <= v < high:
        return f"nats-py {v[0]}.{v[1]} is outside the checked range [{low[0]}.{low[1]}, {high[0]}.{high[1]})"
    if not isinstance(nc, Client):
        return f"{type(nc).__name__} is not a nats-py Client"
    missing = [a for a in _CLIENT_ATTRS if not hasattr(nc, a)]
    missing += [f"nats.aio.client.{a}" for a in _MODULE_ATTRS if not hasattr(nac, a)]
    if missing:
        return "nats-py lacks " + ", ".join(missing)
    return None


async def sync_server(nc: Any, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - as nc.flush's
    """Until the server has processed every command ``nc`` was given before this call.

    ``nc.flush()`` alone does not promise that on nats-py 2.16: its PING is written
    to the socket at once, ahead of commands still in nats-py's buffer (a SUB just
    made, say), so its PONG can come back before the server saw them (measured: 26-33
    of 400 requests right after ``subscribe`` + one ``flush`` found no responders).
    The first flush's wait lets the buffer go out; the second PING follows it."""
    await nc.flush(timeout)
    await nc.flush(timeout)


class _Sink:
    """Stands in for a subscription's future: nats-py's read loop hands every
    message of a subscription made with ``future=`` to ``set_result`` at once,
    with no queue and no task between (and never marks it done)."""

    __slots__ = ("_deliver",)

    def __init__(self, deliver: Callable[[Msg], None]) -> None:
        self._deliver = deliver

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    def set_result(self, msg: Msg) -> None:
        self._deliver(msg)


def _expire(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(errors.TimeoutError())


class FastPath:
    """``request`` / ``publish`` / ``respond`` with nats-py's semantics, fewer hops.

    One per connection; ``close`` (or closing the connection) ends its reply
    subscription. ``counts`` says how many calls took each path."""

    def __init__(self, nc: Client, *, enabled: bool = True) -> None:
        self.nc = nc
        self.reason = unsupported_reason(nc) if enabled else "disabled"
        self.enabled = self.reason is None
        self.counts = {"fast_publish": 0, "fallback_publish": 0, "fast_request": 0, "fallback_request": 0}
        self._mux: str = ""
        self._sub: Any = None
        self._starting: asyncio.Future[None] | None = None
        self._futures: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count(1)
        self._burst = False
        if self.enabled:
            import nats.aio.client as nac
            from nats.aio.transport import TcpTransport

            self._validate = nac._validate_subject
            self._key_re = nac._HEADER_KEY_RE
            self._newlines = nac._HEADER_VALUE_NEWLINES
            self._hdr_line = bytes(nac.NATS_HDR_LINE)
            self._tcp = TcpTransport

    # ------------------------------------------------------------ state

    def _plainly_connected(self) -> bool:
        nc = self.nc
        return bool(nc.is_connected and not nc.is_draining)

    def _can_write_now(self, size: int) -> bool:
        """Nothing of nats-py's waits to be written, this is the first publish of this
        turn of the event loop, the socket takes bytes now, and the message is within
        the server's limit (else nc.publish says why not)."""
        nc: Any = self.nc
        if self._burst or nc._status != Client.CONNECTED or nc._pending or nc._pending_data_size:
            return False
        if size > nc._max_payload:
            return False
        tr = nc._transport
        if not isinstance(tr, self._tcp):
            return False
        writer = getattr(tr, "_io_writer", None)
        sock_tr = getattr(writer, "transport", None)
        if sock_tr is None or sock_tr.is_closing():
            return False
        return bool(sock_tr.get_write_buffer_size() == 0)

    # ------------------------------------------------------------ publish

    def _command(self, subject: str, reply: str, payload: bytes, headers: dict[str, str] | None) -> bytes:
        """The bytes nc.publish would write (PUB, or HPUB with the same header rules)."""
        if headers is None:
            return b"".join(
                (f"PUB {subject} {reply} {len(payload)}\r\n".encode(), payload, _CRLF)
            )
        hdr = bytearray(self._hdr_line)
        hdr.extend(_CRLF)
        for k, v in headers.items():
            key = k.strip()
            if not key:
                continue
            if not self._key_re.fullmatch(key):
                raise errors.BadHeaderError(key)
            hdr.extend(key.encode())
            hdr.extend(b": ")
            hdr.extend(v.strip().translate(self._newlines).encode())
            hdr.extend(_CRLF)
        hdr.extend(_CRLF)
        total = len(hdr) + len(payload)
        return b"".join(
            (f"HPUB {subject} {reply} {len(hdr)} {total}\r\n".encode(), bytes(hdr), payload, _CRLF)
        )

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        """``nc.publish``, written to the socket at once when that keeps order."""
        nc: Any = self.nc
        if not self.enabled or not self._can_write_now(len(payload)):
            self.counts["fallback_publish"] += 1
            await nc.publish(subject, payload, reply=reply, headers=headers)
            return
        if not nc._skip_subject_validation:
            self._validate(subject)
            if reply:
                self._validate(reply)
        if not subject:
            raise errors.BadSubjectError
        cmd = self._command(subject, reply, payload, headers)
        nc.stats["out_msgs"] += 1
        nc.stats["out_bytes"] += len(payload)
        nc._transport.write(cmd)
        self.counts["fast_publish"] += 1
        # Later publishes of this same turn (a burst: many requests gathered, replies
        # to a batch) go through nats-py's buffer, which its flusher writes in one
        # call after this turn: one send per burst instead of one per message.
        self._burst = True
        asyncio.get_running_loop().call_soon(self._end_burst)

    def _end_burst(self) -> None:
        self._burst = False

    async def respond(self, msg: Any, payload: bytes = b"", headers: dict[str, str] | None = None) -> None:
        """Answer ``msg`` (a nats-py Msg or a nats.micro Request) on this connection,
        as ``nats.micro.Request.respond`` does: the given headers, not the request's."""
        m = getattr(msg, "_msg", msg)
        reply = getattr(m, "reply", "")
        if not reply:
            raise ValueError("no reply subject set")
        await self.publish(reply, payload, headers=headers)

    # ------------------------------------------------------------ request

    def _deliver(self, msg: Msg) -> None:
        fut = self._futures.get(msg.subject[len(self._mux):])
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def _start(self) -> None:
        if self._starting is not None:
            await asyncio.shield(self._starting)
            return
        self._starting = asyncio.get_running_loop().create_future()
        try:
            mux = self.nc.new_inbox() + "."
            self._sub = await self.nc.subscribe(mux + "*", future=_Sink(self._deliver))  # type: ignore[arg-type]
            self._mux = mux
            self._starting.set_result(None)
        except BaseException as e:
            self._starting.set_exception(e)
            self._starting.exception()  # retrieved: the caller raises it
            self._starting = None
            raise

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,  # noqa: ASYNC109 - nc.request's signature, on purpose
        headers: dict[str, str] | None = None,
    ) -> Msg:
        """``nc.request(subject, payload, timeout=..., headers=...)`` with fewer hops."""
        nc: Any = self.nc
        if not self.enabled or not self._plainly_connected():
            self.counts["fallback_request"] += 1
            return await nc.request(subject, payload, timeout=timeout, headers=headers)
        if not nc._skip_subject_validation:
            self._validate(subject)
        if not self._mux:
            await self._start()
        token = format(next(self._tokens), "x")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._futures[token] = fut
        self.counts["fast_request"] += 1
        try:
            await self.publish(subject, payload, reply=self._mux + token, headers=headers)
            timer = loop.call_later(timeout, _expire, fut)
            try:
                msg = await fut
            finally:
                timer.cancel()
        finally:
            self._futures.pop(token, None)
        if msg.headers and msg.headers.get(_STATUS_HDR) == _NO_RESPONDERS:
            raise errors.NoRespondersError
        return msg

    async def close(self) -> None:
        """End the reply subscription (requests still waiting time out)."""
        sub, self._sub, self._mux, self._starting = self._sub, None, "", None
        if sub is not None and not self.nc.is_closed:
            try:
                await sub.unsubscribe()
            except errors.Error:  # the connection went away meanwhile
                pass


class FastResponder:
    """A server's raw answer ``(request, data, headers)`` (``responder.Server(respond=)``)
    that answers each request through a :class:`FastPath` of the connection it came
    in on, as ``request.respond(data, headers=headers)`` does; a request without that
    connection (``Msg._client``) is answered by its own ``respond``."""

    def __init__(self) -> None:
        # By connection identity. (A WeakKeyDictionary would never let go: each
        # FastPath holds its connection.) Paths of closed connections are dropped
        # when a new one is made, so this holds the server's live connections only.
        self._paths: dict[int, FastPath] = {}

    def path(self, nc: Any) -> FastPath:
        fp = self._paths.get(id(nc))
        if fp is None or fp.nc is not nc:
            self._paths = {k: p for k, p in self._paths.items() if not p.nc.is_closed}
            fp = self._paths[id(nc)] = FastPath(nc)
        return fp

    async def __call__(self, request: Any, data: bytes, headers: dict[str, str] | None = None) -> None:
        nc = getattr(getattr(request, "_msg", request), "_client", None)
        if nc is None:
            await request.respond(data, headers=headers)
            return
        await self.path(nc).respond(request, data, headers=headers)

