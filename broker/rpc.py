"""The serving side of request/reply, in one place: who may be answered, and how
many of a tenant's requests are served at once.

Every request server of the service (the control plane's tenant and operator
APIs, the inference engines) answers through :class:`Responder`:

- **Replies go only to the requester's own inbox.** A tenant names the reply
  subject of its request; the service must not publish where it says (a reply
  to ``$JS.API.STREAM.PURGE.<stream>`` once purged every tenant's job log). A
  request on a tenant's subject is answered only if its reply subject is under
  that tenant's inbox (``_INBOX.<ns>.<tenant>.``), or under the agents' or the
  operator's inbox prefixes, which no tenant may subscribe to. Anything else is
  dropped, unanswered, and reported as a ``security`` event (action
  ``reply``). Behind the check, the answers travel on a connection of their
  own, as the responder identity, which the broker lets publish to inboxes
  only (:func:`joynexus.broker.permissions.responder_permissions`).
- **A bounded number of requests in flight per tenant.** Past the tenant's
  bound (its quota's ``max_requests_in_flight``) a request is answered at once
  with ``rate_limited`` (retryable) instead of being spawned; a global bound
  keeps the sum of all tenants' finite too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import Names
from joynexus.schemas.errors import RateLimited

log = logging.getLogger(__name__)

#: The longest reply subject answered (an inbox is ~60 characters).
MAX_REPLY_LEN = 256
#: Requests of all tenants served at once by one server.
MAX_IN_FLIGHT_TOTAL = 1024


def reply_allowed(names: Names, reply: str, tenant: str | None) -> bool:
    """May a request on ``tenant``'s subject (None: an operator or agent subject)
    be answered at ``reply``?"""
    if not reply or len(reply) > MAX_REPLY_LEN or any(c in reply for c in " \t\r\n*>"):
        return False
    prefixes = [names.service_inbox_prefix, names.admin_inbox_prefix]
    if tenant is not None:
        prefixes.append(names.inbox_prefix(tenant))
    return any(reply.startswith(p + ".") and len(reply) > len(p) + 1 for p in prefixes)


def _reply_of(request: Any) -> str:
    """The reply subject of a nats-py message or micro-service Request."""
    msg = getattr(request, "_msg", request)
    reply = getattr(msg, "reply", "") or ""
    return reply if isinstance(reply, str) else str(reply)


class Responder:
    """Reply checks, per-tenant in-flight bounds and the answering connection of
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
        self.in_flight: dict[str, int] = {}
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

    def allowed(self, request: Any, tenant: str | None) -> bool:
        """False (and a security event, filed under ``tenant``) when the request's
        reply subject is not the requester's: the request must be dropped."""
        reply = _reply_of(request)
        if reply_allowed(self.n, reply, tenant):
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

    def admit(self, tenant: str) -> None:
        """Count one request of ``tenant`` in; RateLimited past its bound."""
        n = self.in_flight.get(tenant, 0)
        total = sum(self.in_flight.values())
        bound = self.limit(tenant)
        if n >= bound or total >= self.total:
            self.rate_limited += 1
            raise RateLimited(
                f"tenant {tenant!r} has {n} requests being served by {self.source} "
                f"(its bound is {bound}); wait for answers before sending more, or retry shortly"
            )
        self.in_flight[tenant] = n + 1

    def release(self, tenant: str) -> None:
        n = self.in_flight.get(tenant, 0) - 1
        if n > 0:
            self.in_flight[tenant] = n
        else:
            self.in_flight.pop(tenant, None)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.close()
