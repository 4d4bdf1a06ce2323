"""Request/reply, the serving side: :class:`Server` (who may be answered, how many
requests at once, the span, the error body, the reply) and the :class:`Responder`
under it; the asking side is broker/rpc.py.

Every request server (the scheduler, the control plane's tenant and operator
APIs, the inference engines) answers through a :class:`Server`. See
docs/ARCHITECTURE.md ("Request/reply: one layer"). What it guards:

- **Replies go only to the requester's own inbox** (a reply to
  ``$JS.API.STREAM.PURGE.<stream>`` once purged every tenant's job log): on a
  tenant's subject only under ``_INBOX.<ns>.<tenant>.``, on an agent's or the
  operator's only under their inbox prefixes, which no tenant may subscribe to
  (:func:`reply_allowed`); anything else is dropped and filed as a ``security``
  event. Answers travel as the responder identity, which may publish to inboxes only.
- **A bounded number of requests in flight**, per tenant (its quota's
  ``max_requests_in_flight``) and in all: past the bound a request is answered
  ``rate_limited`` (retryable) instead of being spawned; refusals are sent round
  robin between tenants, a few per turn of the event loop, so a burst of one
  tenant's refused requests does not queue ahead of another tenant's work.
- **A fair share of the server's time** (``slots``): of a tenant's admitted
  requests at most ``slots(tenant)`` work at once, the others wait in order (32
  concurrent handlers of one tenant made every other tenant's call 13-20x slower);
  a verb known to be expensive (``cost``) takes several slots (:class:`Budget`),
  so a tenant's expensive calls run one at a time; a long poll gives its slots
  back while it waits (:func:`waiting`).
- **A handler that raises answers an error body** (the error's stable code,
  its message clipped; a bug answers ``error`` and is logged) with the
  micro-service error headers, and the server keeps serving.

A :class:`Server` answers through its ``respond`` function (None: the request's
own ``respond``, nats-py's): the transport is a seam.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors

from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.headers import SERVICE_ERROR, SERVICE_ERROR_CODE
from joynexus.broker.slots import HELD, Budget, Held
from joynexus.broker.subjects import Names
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.base import encode
from joynexus.schemas.errors import JoyNexusError, PermissionDenied, RateLimited, Unavailable

log = logging.getLogger(__name__)

#: The longest reply subject answered (an inbox is ~60 characters).
MAX_REPLY_LEN = 256
#: Requests of all tenants served at once by one server.
MAX_IN_FLIGHT_TOTAL = 1024
#: The longest error message a tenant-facing server echoes back.
MAX_ERROR_CHARS = 600

#: Refusals of one tenant waiting to be sent, in count and bytes (Server.defer_refusal).
MAX_QUEUED_REFUSALS = 4096
MAX_QUEUED_REFUSAL_BYTES = 16 << 20
#: Refusals sent between two turns of the event loop (see Server._drain_refusals).
REFUSALS_PER_TURN = 16

#: How a server answers one request: ``(request, data, headers or None)``.
RawRespond = Callable[[Any, bytes, "dict[str, str] | None"], Awaitable[Any]]


def reply_allowed(
    names: Names, reply: str, tenant: str | None, *, service: bool = False
) -> bool:
    """May a request on ``tenant``'s subject (None: an operator or agent subject)
    be answered at ``reply``? On a tenant's own subject only in that tenant's
    inboxes; on a subject only the service publishes to (``service``: the agents'
    inference subject for a tenant) only in the agents'; elsewhere in the agents'
    or the operators'."""
    if not reply or len(reply) > MAX_REPLY_LEN or any(c in reply for c in " \t\r\n*>"):
        return False
    if tenant is None:
        prefixes = [names.service_inbox_prefix, names.admin_inbox_prefix]
    elif service:
        prefixes = [names.service_inbox_prefix]
    else:
        prefixes = [names.inbox_prefix(tenant)]
    return any(reply.startswith(p + ".") and len(reply) > len(p) + 1 for p in prefixes)


def _reply_of(request: Any) -> str:
    """The reply subject of a nats-py message or micro-service Request."""
    msg = getattr(request, "_msg", request)
    reply = getattr(msg, "reply", "") or ""
    return reply if isinstance(reply, str) else str(reply)


#: ``Nats-Service-Error-Code`` of an error reply (micro-service convention: HTTP-like).
STATUS_BY_CODE = {PermissionDenied.code: "403"}


def error_headers(code: str, message: str, headers: dict[str, str] | None = None) -> dict[str, str]:
    """The micro-service error headers of an error reply (added to ``headers``)."""
    headers = {} if headers is None else headers
    headers.update({SERVICE_ERROR: message[:200], SERVICE_ERROR_CODE: STATUS_BY_CODE.get(code, "400")})
    return headers


class Responder:
    """Reply checks, in-flight bounds, spawned tasks and the answering connection of
    one request server (``source`` names it in security events)."""

    def __init__(
        self,
        b: Broker,
        source: str,
        *,
        limit: Callable[[str], int] | None = None,
        total: int = MAX_IN_FLIGHT_TOTAL,
    ) -> None:
        self.b = b
        self.n = b.names
        self.source = source
        self.limit = limit or (lambda _tenant: 32)
        self.total = total
        #: Requests being served, per tenant ("" counts those of no tenant).
        self.in_flight: dict[str, int] = {}
        self._in_flight_total = 0
        self.refused = 0
        self.rate_limited = 0
        self._conn: Broker | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def connection(self) -> Any:
        """The connection to serve on: the responder identity's when the service
        credentials carry one, else the agent's own."""
        if self._conn is None:
            self._conn = await self.b.responder(self.source)
        return (self._conn or self.b).nc

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    def allowed(self, request: Any, tenant: str | None, *, service: bool = False) -> bool:
        """False (and a security event, filed under ``tenant``) when the request's
        reply subject is not the requester's: the request must be dropped."""
        reply = _reply_of(request)
        if reply_allowed(self.n, reply, tenant, service=service):
            return True
        self.refused += 1
        who = tenant or "_"
        self.spawn(
            metrics.security(
                self.b,
                who,
                action="reply",
                subject=reply,
                reason=(
                    f"request on {metrics.clip(request.subject, 80)} asked for its reply at "
                    f"{metrics.clip(reply, 80)!r}, not the requester's inbox "
                    f"({self.n.inbox_prefix(who)}.*): dropped"
                ),
                source=self.source,
            )
        )
        return False

    def admit(self, tenant: str | None) -> None:
        """Count one request of ``tenant`` (None: of no tenant, bound by the total
        only) in; RateLimited past its bound."""
        key = tenant or ""
        n = self.in_flight.get(key, 0)
        if n >= self._bound(key) or self._in_flight_total >= self.total:
            raise self.limited(key)
        self.in_flight[key] = n + 1
        self._in_flight_total += 1

    def _bound(self, tenant: str) -> int:
        return self.limit(tenant) if tenant else self.total

    def busy(self, tenant: str, waiting: int = 0) -> bool:
        """Would a request of ``tenant`` be refused now, with ``waiting`` more of its
        requests taken in and not yet served (they count as in flight)? A dict lookup:
        a tenant with nothing in flight or waiting (or a token that is no tenant) is
        not busy."""
        n = self.in_flight.get(tenant)
        if n is None and not waiting:
            return False
        n = (n or 0) + waiting
        return n >= self._bound(tenant) or self._in_flight_total + waiting >= self.total

    def limited(self, tenant: str) -> RateLimited:
        """The refusal of a request of ``tenant`` ("": of none) past its bound (counted)."""
        self.rate_limited += 1
        who = f"tenant {tenant!r} has" if tenant else "there are"
        return RateLimited(
            f"{who} {self.in_flight.get(tenant, 0)} requests being served by {self.source} "
            f"(the bound is {min(self._bound(tenant), self.total)}); wait for answers before "
            "sending more, or retry shortly")

    def release(self, tenant: str | None) -> None:
        key = tenant or ""
        n = self.in_flight.get(key, 0) - 1
        if n > 0:
            self.in_flight[key] = n
        else:
            self.in_flight.pop(key, None)
        self._in_flight_total = max(0, self._in_flight_total - 1)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        await self.close()


class Server(Responder):
    """A :class:`Responder` that also runs each request's handler and answers it.

    ``error_reply(code, message)`` builds the reply that carries an error (the
    server's reply type), ``encode`` writes a reply; ``clip``: the longest error
    message echoed back (None: whole, for the agents' own APIs); ``internal``: what
    a bug answers (``{ref}``: a reference logged with it; ``{error}``: its repr);
    ``respond``: the raw answer (None: the request's own ``respond``, nats-py's)."""

    def __init__(
        self,
        b: Broker,
        source: str,
        *,
        error_reply: Callable[[str, str], Any],
        encode: Callable[[Any], bytes] = encode,
        clip: int | None = MAX_ERROR_CHARS,
        internal: str = "internal error (reference {ref} in the {source}'s log)",
        limit: Callable[[str], int] | None = None,
        total: int = MAX_IN_FLIGHT_TOTAL,
        respond: RawRespond | None = None,
        slots: Callable[[str], int] | None = None,
    ) -> None:
        super().__init__(b, source, limit=limit, total=total)
        self.error_reply = error_reply
        self.encode = encode
        self.clip = clip
        self.internal = internal
        self.respond = respond
        self.slots = slots
        #: Per tenant with requests admitted: the slots its requests work in.
        self._slots: dict[str, Budget] = {}
        #: Encoded ``rate_limited`` answers by (error builder, message): see _refuse.
        self._refusals: dict[tuple[int, str], tuple[bytes, dict[str, str]]] = {}
        #: The most requests of one tenant that ever worked at once (for tests).
        self.peak_working: dict[str, int] = {}
        self._working: dict[str, int] = {}
        #: Refused requests not answered yet, per tenant, and their bytes (defer_refusal).
        self._to_refuse: dict[str, deque[tuple[Any, RateLimited | None, Any, bool]]] = {}
        self._to_refuse_bytes: dict[str, int] = {}
        self._refuser: asyncio.Task[None] | None = None
        #: Refused requests dropped unanswered (past MAX_QUEUED_REFUSALS or its bytes).
        self.refusals_dropped = 0

    def error_of(self, e: BaseException) -> tuple[str, str]:
        """(code, message) of a failed request: the error's own, clipped; a bug's
        reference (the traceback is logged, not sent)."""
        if isinstance(e, JoyNexusError):  # clipped: a tenant's 1 MB name is not echoed back
            return e.code, (str(e) if self.clip is None else metrics.clip(e, self.clip))
        if isinstance(e, TimeoutError | nats.errors.TimeoutError):
            # The message store did not answer in time (a server restarting, its cluster
            # electing a leader after a host was lost): the machine, not the request or a
            # bug; retryable, as Unavailable says (an "internal error" ends a caller's retries).
            log.warning("%s request: the message store timed out: %r", self.source, e)
            return Unavailable.code, (f"the {self.source} timed out waiting for the message "
                                      "store (a server restarting or failing over?); retry")
        ref = uuid.uuid4().hex[:12]
        log.error("%s request failed (ref %s)", self.source, ref, exc_info=e)
        return "error", self.internal.format(ref=ref, source=self.source, error=repr(e))

    def serve(
        self,
        request: Any,
        handle: Callable[[], Awaitable[Any]],
        *,
        span: str,
        tenant: str | None = None,
        traced_only: bool = False,
        error_reply: Callable[[str, str], Any] | None = None,
        cost: int = 1,
    ) -> None:
        """Answer ``request`` with what ``handle()`` returns, in a task of its own
        (nats-py runs one callback at a time per subscription: a long poll never
        blocks the others), counted against ``tenant``'s in-flight bound (past it:
        ``rate_limited`` at once) and, with ``slots``, working only in ``cost`` of
        ``tenant``'s slots (at most all of them). ``handle`` decodes the request and does the work
        in a span ``span`` continuing the caller's trace (``traced_only``: only when
        the request carries one; thousands of root spans a second would only cost);
        ``error_reply``: this request's, instead of the server's."""
        try:
            self.admit(tenant)
        except RateLimited as e:
            self.defer_refusal(tenant or "", request, e, error_reply)
            return
        slot = self._slot(tenant)
        work = handle if slot is None else self._in_slot(tenant or "", slot, cost, handle)
        task = self.spawn(self._answer(request, work, span, traced_only, error_reply))
        task.add_done_callback(lambda _t: self._release(tenant))

    def _slot(self, tenant: str | None) -> Budget | None:
        if self.slots is None or not tenant:
            return None
        budget = self._slots.get(tenant)
        if budget is None:
            budget = self._slots[tenant] = Budget(self.slots(tenant))
        return budget

    def _in_slot(
        self, tenant: str, slot: Budget, cost: int, handle: Callable[[], Awaitable[Any]]
    ) -> Callable[[], Awaitable[Any]]:
        async def work() -> Any:
            held = Held(slot, slot.cost(cost))
            await slot.acquire(held.n)
            held.held = True
            token = HELD.set(held)
            n = self._working[tenant] = self._working.get(tenant, 0) + 1
            self.peak_working[tenant] = max(self.peak_working.get(tenant, 0), n)
            try:
                return await handle()
            finally:
                HELD.reset(token)
                self._working[tenant] = self._working.get(tenant, 1) - 1
                if held.held:
                    slot.release(held.n)

        return work

    def _release(self, tenant: str | None) -> None:
        self.release(tenant)
        if tenant and tenant not in self.in_flight:  # none admitted: none waits on it
            self._slots.pop(tenant, None)
            self._working.pop(tenant, None)

    async def _answer(
        self,
        request: Any,
        handle: Callable[[], Awaitable[Any]],
        span: str,
        traced_only: bool,
        error_reply: Callable[[str, str], Any] | None,
    ) -> None:
        headers = request.headers
        try:
            if traced_only and not tracing.traceparent(headers):
                reply = await handle()
            else:
                with tracing.tracer.start_as_current_span(span, context=tracing.extract(headers)):
                    reply = await handle()
        except Exception as e:  # the tenant's error or a bug: answer it, keep serving
            await self.answer_error(request, e, error_reply=error_reply)
            return
        await self.send(request, self.encode(reply))

    def defer_refusal(self, tenant: str, request: Any, e: RateLimited | None = None,
                      error_reply: Callable[[str, str], Any] | None = None, *,
                      service: bool = False) -> None:
        """Queue a refusal, sent round robin with other tenants' a few per loop turn
        (with a task each, another tenant's request waited behind a whole burst's
        answers). ``e`` None: a :meth:`busy` tenant's request refused before any other
        check, its reply subject checked in its turn. Past the bounds: dropped, unanswered."""
        size = len(getattr(request, "data", b"") or b"")
        q = self._to_refuse.get(tenant)
        used = self._to_refuse_bytes.get(tenant, 0)
        if (q is not None and len(q) >= MAX_QUEUED_REFUSALS) or used + size > MAX_QUEUED_REFUSAL_BYTES:
            self.refusals_dropped += 1
            if self.refusals_dropped % 1000 == 1:
                log.warning("%s: %d refused requests dropped unanswered (tenant %r is far "
                            "past its bound)", self.source, self.refusals_dropped, tenant)
            return
        if q is None:
            q = self._to_refuse[tenant] = deque()
        q.append((request, e, error_reply, service))
        self._to_refuse_bytes[tenant] = used + size
        if self._refuser is None:
            self._refuser = self.spawn(self._drain_refusals())

    async def _drain_refusals(self) -> None:
        """Send the queued refusals, round robin, yielding every REFUSALS_PER_TURN."""
        sent = 0
        try:
            while self._to_refuse:
                for tenant in list(self._to_refuse):
                    q = self._to_refuse.get(tenant)
                    if not q:
                        continue
                    request, e, error_reply, service = q.popleft()
                    left = self._to_refuse_bytes.get(tenant, 0) - len(getattr(request, "data", b"") or b"")
                    if q:
                        self._to_refuse_bytes[tenant] = left
                    else:
                        del self._to_refuse[tenant]
                        self._to_refuse_bytes.pop(tenant, None)
                    if e is None:  # refused at the door: its reply subject not checked yet
                        if not self.allowed(request, tenant, service=service):
                            continue
                        e = self.limited(tenant)
                    await self._refuse(request, e, error_reply)
                    sent += 1
                    if sent % REFUSALS_PER_TURN == 0:
                        await asyncio.sleep(0)
        finally:
            self._refuser = None

    async def _refuse(self, request: Any, e: RateLimited,
                      error_reply: Callable[[str, str], Any] | None) -> None:
        """Answer ``rate_limited`` from a cache of encoded refusals (the message repeats:
        same tenant, same bound): a lookup and a publish each, not an encoding."""
        key = (id(error_reply), str(e))
        hit = self._refusals.get(key)
        if hit is None:
            code, message = self.error_of(e)
            hit = (self.encode((error_reply or self.error_reply)(code, message)),
                   error_headers(code, message))
            if len(self._refusals) >= 1024:
                self._refusals.clear()
            self._refusals[key] = hit
        await self.send(request, hit[0], dict(hit[1]))

    async def answer_error(
        self,
        request: Any,
        e: BaseException,
        headers: dict[str, str] | None = None,
        *,
        error_reply: Callable[[str, str], Any] | None = None,
    ) -> tuple[str, str]:
        """Answer the error body of ``e`` (with the error headers); its (code, message)."""
        code, message = self.error_of(e)
        body = (error_reply or self.error_reply)(code, message)
        await self.send(request, self.encode(body), error_headers(code, message, headers))
        return code, message

    async def send(self, request: Any, data: bytes, headers: dict[str, str] | None = None) -> bool:
        """Respond; False (logged) when the answer could not be sent (the caller is
        gone, the connection dropped)."""
        try:
            await self.respond_to(request, data, headers)
            return True
        except Exception as e:
            log.warning("%s: reply not sent: %s", self.source, e)
            return False

    def respond_to(self, request: Any, data: bytes, headers: dict[str, str] | None) -> Awaitable[Any]:
        """The raw answer, to await (no coroutine of its own: the inference engine's
        replies take this path, each microsecond counted); raises what it raises."""
        if self.respond is None:
            return request.respond(data, headers=headers or None)  # type: ignore[no-any-return]
        return self.respond(request, data, headers or None)
