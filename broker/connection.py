"""Connecting to NATS: one place for reconnect policy, buffers and identity.

nats-py's defaults give up reconnecting after ~2 minutes and cap the outbound
buffer at 2 MB; a service that must outlive a broker restart and move
multi-MB Training Queue partitions needs neither limit.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker" (identities).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from joynexus.broker.credentials import Credentials, from_env_or_file
from joynexus.broker.fastpath import FastPath, enabled_by_env
from joynexus.broker.subjects import Names
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.errors import PermissionDenied, Unavailable

log = logging.getLogger(__name__)

PENDING_SIZE = 256 * 1024 * 1024


@dataclass
class Broker:
    """A live connection plus the names of this deployment."""

    nc: NATS
    js: JetStreamContext
    names: Names = field(default_factory=Names)
    #: Called with every asynchronous error the server reports on this
    #: connection (permission violations, authorization violations...).
    error_listeners: list[Callable[[Exception], None]] = field(default_factory=list)
    #: How this connection was made (to open a sibling: the responder connection).
    url: str | list[str] = ""
    credentials: Credentials | None = None
    _fast: FastPath | None = field(default=None, init=False, repr=False)

    def fastpath(self) -> FastPath:
        """This connection's :class:`~joynexus.broker.fastpath.FastPath` (one per
        connection, made on first use; nats-py's own path where it cannot apply
        or with ``JOYNEXUS_FASTPATH=0``)."""
        if self._fast is None:
            self._fast = FastPath(self.nc, enabled=enabled_by_env())
        return self._fast

    @classmethod
    async def connect(
        cls,
        url: str | list[str],
        *,
        name: str,
        namespace: str = "jnx",
        connect_timeout: float = 5.0,
        initial_timeout_s: float = 10.0,
        credentials: Credentials | Literal["env"] | None = "env",
        **auth: Any,
    ) -> Broker:
        """Connect with reconnects that never give up (an agent outlives server restarts).

        ``credentials`` authenticate (see :mod:`joynexus.broker.credentials`); a
        tenant's connection gets its own inbox prefix, the only subjects it may
        subscribe to. By default (``"env"``) they come from the file named by
        ``$JOYNEXUS_CREDS`` if set (how agents get the service identity and
        operator commands the admin one); ``None``: no credentials. Other keyword
        arguments go to ``nats.connect``."""

        conn: list[NATS] = []
        names = Names(namespace)
        listeners: list[Callable[[Exception], None]] = []
        if credentials == "env":
            credentials = from_env_or_file(None)
        if credentials is not None:
            auth = {**credentials.connect_options(), **auth}
            if credentials.kind == "tenant" and credentials.tenant:
                auth.setdefault("inbox_prefix", names.inbox_prefix(credentials.tenant))
            elif credentials.kind == "admin":
                auth.setdefault("inbox_prefix", names.admin_inbox_prefix)
        # Agents' and operators' replies arrive under prefixes no tenant may
        # subscribe to; request servers check a reply subject against them.
        auth.setdefault("inbox_prefix", names.service_inbox_prefix)

        refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

        async def on_error(e: Exception) -> None:
            # Before the first connect succeeds every refused attempt lands here;
            # the final error says it once.
            log.log(logging.WARNING if conn else logging.DEBUG, "nats connection %s: %s", name, e)
            if not conn and "authorization violation" in str(e).lower() and not refused.done():
                refused.set_result(e)  # refused credentials: retrying will not help
            for listener in list(listeners):
                try:
                    listener(e)
                except Exception:  # a listener's bug must not break the connection
                    log.exception("error listener of %s failed", name)

        async def on_disconnect() -> None:
            if conn and not (conn[0].is_closed or conn[0].is_draining):
                log.warning("nats connection %s: disconnected, reconnecting", name)

        async def on_reconnect() -> None:
            log.info("nats connection %s: reconnected", name)

        try:
            client = NATS()  # held here, so a refused first connect can be closed
            connecting = client.connect(
                servers=url,
                name=name,
                connect_timeout=int(max(1, connect_timeout)),
                reconnect_time_wait=0.5,  # type: ignore[arg-type]
                max_reconnect_attempts=-1,
                pending_size=PENDING_SIZE,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                **auth,
            )
            # Reconnects never give up once connected; the first connect does,
            # at once if the server refuses the credentials.
            task = asyncio.ensure_future(connecting)
            first: set[asyncio.Future[Any]] = {task, refused}
            await asyncio.wait(first, timeout=initial_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await cancel_and_wait(task)
                with contextlib.suppress(Exception):  # stop its reconnect attempts
                    await client.close()
                raise refused.result() if refused.done() else TimeoutError()
            task.result()
            nc = client
        except Exception as e:  # nats raises several unrelated types here
            why = "no answer" if isinstance(e, TimeoutError) else str(e)
            if "authorization violation" in why.lower():
                who = credentials.user if credentials and credentials.user else "anonymous"
                raise PermissionDenied(
                    f"the NATS server at {url} refused the credentials of {who!r} "
                    "(wrong, revoked or none: tenants use the file `joynexus tenant add` "
                    "wrote, agents <data-dir>/credentials/service.json, operators "
                    "<data-dir>/credentials/admin.json; pass it with --creds FILE or "
                    "$JOYNEXUS_CREDS)"
                ) from e
            raise Unavailable(
                f"cannot connect to NATS at {url} within {initial_timeout_s:.0f}s ({why}); "
                "is the server running? (`joynexus up` or `joynexus server` start one)"
            ) from e
        conn.append(nc)
        return cls(nc=nc, js=nc.jetstream(timeout=10.0), names=names, error_listeners=listeners,
                   url=url, credentials=credentials if isinstance(credentials, Credentials) else None)

    async def responder(self, name: str) -> Broker | None:
        """A second connection as the responder identity (inboxes only), when this
        connection's credentials carry one; None: answer on this connection."""
        creds = self.credentials.responder() if self.credentials else None
        if creds is None:
            return None
        # A refusal can be transient while the server reloads its authorization
        # (the auth sync applies a change); a few tries before giving up.
        deadline = asyncio.get_running_loop().time() + 20.0
        while True:
            try:
                return await Broker.connect(self.url, name=f"{name}-responder",
                                            namespace=self.names.namespace, credentials=creds)
            except PermissionDenied:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("%s: the responder identity was refused; retrying", name)
                await asyncio.sleep(0.5)

    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload)

    async def close(self) -> None:
        """Flush what was published, then close (drain would wait on every
        subscription, including abandoned pull fetches)."""
        if self.nc.is_closed:
            return
        if self._fast is not None:
            fast, self._fast = self._fast, None
            with contextlib.suppress(Exception):
                await fast.close()
        try:
            await self.nc.flush(timeout=2)
        except Exception:  # disconnected: nothing more can be flushed
            pass
        await self.nc.close()


def raise_if_cancelled() -> None:
    """Re-raise a cancellation a library turned into another error (nats-py's
    ``next_msg`` raises ConnectionClosedError instead of CancelledError when the
    connection closes meanwhile). Call it first in an ``except Exception`` of a
    loop that logs and retries: otherwise that loop never stops."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError

