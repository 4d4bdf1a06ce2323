"""Each tenant's connections capped on the server: counted and the excess closed.

nats-server caps connections per account (``max_connections``), not per user,
and every tenant of a deployment is a user of one account (the broker fences
them by subject permissions). So the process that owns the server enforces
the cap from the server's own view, as the system account: on every client
connect (the ``$SYS.ACCOUNT.<acc>.CONNECT`` event) and every few seconds, it
asks every server of the cluster for its connections (``CONNZ`` with the
authorized users), counts them per tenant user, and closes the newest beyond
the tenant's ``max_connections`` quota (``KICK``): the connections a tenant
already works with stay, a flood of new ones is closed within about a
second, and each tenant's excess is filed as a security event (at most one
per tenant per :data:`REPORT_EVERY_S`). The service's own users are never
counted. See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats
import orjson

from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.broker.subjects import Names

log = logging.getLogger(__name__)

#: The system account's subjects (nats-server 2.10+).
CONNECT_EVENTS = "$SYS.ACCOUNT.*.CONNECT"
CONNZ_ALL = "$SYS.REQ.SERVER.PING.CONNZ"
#: How long the servers' CONNZ answers are gathered for, and how often a check runs
#: without a connect event.
GATHER_S = 0.3
EVERY_S = 5.0
#: A tenant's excess is filed at most this often.
REPORT_EVERY_S = 10.0


def kick_subject(server_id: str) -> str:
    return f"$SYS.REQ.SERVER.{server_id}.KICK"


@dataclass(frozen=True)
class Capped:
    """A tenant user's cap: its deployment's names, the tenant, its most connections."""

    names: Names
    tenant: str
    cap: int


@dataclass(frozen=True)
class Conn:
    server_id: str
    cid: int
    user: str
    start: str


def over_cap(conns: list[Conn], caps: dict[str, Capped]) -> list[Conn]:
    """The connections to close: per capped user, the newest beyond its cap (by
    start time, then connection id); users without a cap are left alone."""
    by_user: dict[str, list[Conn]] = defaultdict(list)
    for c in conns:
        if c.user in caps:
            by_user[c.user].append(c)
    out: list[Conn] = []
    for user, cs in by_user.items():
        cs.sort(key=lambda c: (c.start, c.server_id, c.cid))
        out += cs[caps[user].cap:]
    return out


class ConnectionCap:
    """Enforces ``caps()`` (user -> :class:`Capped`, read anew each check) on every
    server reachable with the ``system`` credentials; ``b`` files the security events."""

    def __init__(self, b: Broker, system: Credentials, url: str,
                 caps: Callable[[], dict[str, Capped]], *, every_s: float = EVERY_S) -> None:
        self.b, self.system, self.url, self.caps, self.every_s = b, system, url, caps, every_s
        self.kicked = 0
        self._reported: dict[str, float] = {}
        self._wake = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        nc = await nats.connect(self.url, name="joynexus-conncap", max_reconnect_attempts=-1,
                                **self.system.connect_options())

        async def on_connect(msg: Any) -> None:
            with contextlib.suppress(Exception):
                user = orjson.loads(msg.data).get("client", {}).get("user", "")
                if user in self.caps():
                    self._wake.set()

        sub = await nc.subscribe(CONNECT_EVENTS, cb=on_connect)
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.every_s)
                self._wake.clear()
                try:
                    await self.check(nc)
                except Exception as e:
                    log.warning("connection cap: a check failed: %s", e)
                await asyncio.sleep(0.2)  # a burst of connects: one check
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            await nc.close()

    async def connections(self, nc: Any) -> list[Conn]:
        """Every client connection of every server that answers within GATHER_S."""
        inbox = nc.new_inbox()
        replies: list[bytes] = []

        async def on_reply(msg: Any) -> None:
            replies.append(msg.data)

        sub = await nc.subscribe(inbox, cb=on_reply)
        try:
            await nc.publish(CONNZ_ALL, orjson.dumps({"auth": True, "limit": 100_000}),
                             reply=inbox)
            await nc.flush()
            await asyncio.sleep(GATHER_S)
        finally:
            await sub.unsubscribe()
        out = []
        for raw in replies:
            d = orjson.loads(raw)
            sid = d.get("server", {}).get("id", "")
            for c in (d.get("data") or {}).get("connections") or []:
                out.append(Conn(sid, int(c.get("cid", 0)), c.get("authorized_user", ""),
                                c.get("start", "")))
        return out

    async def check(self, nc: Any) -> list[Conn]:
        caps = self.caps()
        excess = over_cap(await self.connections(nc), caps) if caps else []
        for c in excess:
            with contextlib.suppress(Exception):
                await nc.request(kick_subject(c.server_id), orjson.dumps({"cid": c.cid}),
                                 timeout=2.0)
                self.kicked += 1
        for user in {c.user for c in excess}:
            await self._report(caps[user], sum(1 for c in excess if c.user == user))
        return excess

    async def _report(self, who: Capped, n: int) -> None:
        now = time.monotonic()
        if now - self._reported.get(who.tenant, -1e9) < REPORT_EVERY_S:
            return
        self._reported[who.tenant] = now
        b = Broker(nc=self.b.nc, js=self.b.js, names=who.names)
        with contextlib.suppress(Exception):
            await metrics.security(
                b, who.tenant, action="connect", subject="",
                reason=(f"tenant {who.tenant!r} held more than its {who.cap} connections "
                        f"(max_connections): closed the newest {n}"),
                source="conncap",
            )


__all__ = ["CONNECT_EVENTS", "CONNZ_ALL", "Capped", "Conn", "ConnectionCap", "kick_subject",
           "over_cap"]
