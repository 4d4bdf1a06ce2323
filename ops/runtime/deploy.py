"""Where a command's NATS comes from: ``--nats URL``, or an embedded server.

The embedded server runs with authorization on unless ``auth=False``, and
this process then owns it: it runs the auth sync in a thread and acts as the
operator (``$JOYNEXUS_CREDS`` = the admin credentials, which every
:meth:`Broker.connect` without explicit credentials uses); ``role_env``
gives the processes it starts their identity.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from joynexus.broker.credentials import CREDS_ENV, Credentials
from joynexus.broker.subjects import Names
from joynexus.ops.runtime.natsconfig import ClusterOptions, TlsFiles
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.errors import JoyNexusError

log = logging.getLogger(__name__)

#: Set while this process owns a secured embedded server: the service identity's
#: file, handed to the agent processes it starts (as their $JOYNEXUS_CREDS).
SERVICE_CREDS_ENV = "JOYNEXUS_SERVICE_CREDS"
#: The control plane's identity (the service's rights plus tenant identities).
CONTROL_CREDS_ENV = "JOYNEXUS_CONTROL_CREDS"


def role_env(role: str = "") -> dict[str, str]:
    """Environment for an agent process this process starts: the service identity
    (the control identity for the control role) when it owns a secured server,
    else whatever identity it has itself."""
    creds = os.environ.get(CONTROL_CREDS_ENV) if role == "control" else None
    creds = creds or os.environ.get(SERVICE_CREDS_ENV)
    return {CREDS_ENV: creds} if creds else {}


@dataclass
class Endpoint:
    """A running deployment's server: where it is and who may use it."""

    url: str
    data_dir: Path | None = None
    admin: Credentials | None = None
    service: Credentials | None = None
    server: EmbeddedNats | None = None
    #: The control plane's identity (None without authorization).
    control: Credentials | None = None
    sync: object | None = field(default=None, repr=False)

    @property
    def admin_path(self) -> Path | None:
        from joynexus.ops.runtime.bootstrap import credentials_path

        return credentials_path(self.data_dir, "admin") if self.admin and self.data_dir else None

    @property
    def service_path(self) -> Path | None:
        from joynexus.ops.runtime.bootstrap import credentials_path

        return credentials_path(self.data_dir, "service") if self.service and self.data_dir else None

    @property
    def control_path(self) -> Path | None:
        from joynexus.ops.runtime.bootstrap import credentials_path

        return credentials_path(self.data_dir, "control") if self.service and self.data_dir else None


class AuthSyncThread:
    """The auth sync of a server this process owns, on its own event loop, so
    that synchronous commands (and their asyncio.run) need not host it."""

    def __init__(
        self, server: EmbeddedNats, admin: Credentials, service: Credentials, names: Names
    ) -> None:
        self.server, self.admin, self.service, self.names = server, admin, service, names
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="joynexus-auth-sync", daemon=True)
        self.sync: object | None = None

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise JoyNexusError("the auth sync did not connect to the embedded server")
        if self._error is not None:
            raise JoyNexusError(f"the auth sync failed to start: {self._error}") from self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as e:  # reported by start() if it happens before ready
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        from joynexus.broker.connection import Broker
        from joynexus.broker.layout import ensure_layout
        from joynexus.ops.runtime.authsync import AuthSync

        self._stop = asyncio.Event()
        b = await Broker.connect(
            self.server.url, name="auth-sync", namespace=self.names.namespace,
            credentials=self.admin,
        )
        try:
            sync = AuthSync(b, self.server, self.admin, self.service)
            self.sync = sync
            self.server.on_log_line = sync.on_log_line
            self._ready.set()  # connected: the rest may wait for a cluster's JetStream
            while not self._stop.is_set():
                try:
                    await ensure_layout(b)
                    break
                except Exception as e:  # no JetStream meta leader yet (a cluster forming)
                    log.info("auth sync: JetStream not ready yet (%s); retrying", e)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), 1.0)
            await sync.run(self._stop)
        finally:
            self.server.on_log_line = None
            await b.close()

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@contextlib.contextmanager
def embedded(
    data_dir: str | Path | None = None,
    *,
    namespace: str = "jnx",
    auth: bool = True,
    port: int = -1,
    host: str = "127.0.0.1",
    tls: TlsFiles | None = None,
    cluster: ClusterOptions | None = None,
    name: str = "jnx",
    act_as_admin: bool = True,
) -> Iterator[Endpoint]:
    """An embedded nats-server (a temporary store if ``data_dir`` is None), with
    authorization on and its auth sync running unless ``auth=False``; with
    ``act_as_admin`` this process's connections use the admin identity."""
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="jnx-nats-"))
        data = Path(data_dir)
        if not auth:
            server = stack.enter_context(
                EmbeddedNats(data, port=port, host=host, tls=tls, cluster=cluster, name=name)
            )
            yield Endpoint(server.url, data, server=server)
            return
        from joynexus.ops.runtime.bootstrap import secured_server

        names = Names(namespace)
        server, admin, service = secured_server(
            data, names, port=port, host=host, tls=tls, cluster=cluster, name=name
        )
        stack.enter_context(server)
        admin, service = admin.with_url(server.url), service.with_url(server.url)
        sync = AuthSyncThread(server, admin, service, names)
        sync.start()
        stack.callback(sync.stop)
        if act_as_admin:
            from joynexus.ops.runtime.bootstrap import credentials_path

            for var, kind in ((CREDS_ENV, "admin"), (SERVICE_CREDS_ENV, "service"),
                              (CONTROL_CREDS_ENV, "control")):
                stack.callback(_restore_env, var, os.environ.get(var))
                os.environ[var] = str(credentials_path(data, kind))
        from joynexus.ops.runtime.bootstrap import credentials_path

        control = Credentials.load(credentials_path(data, "control")).with_url(server.url)
        yield Endpoint(server.url, data, admin, service, server, sync=sync, control=control)


def _restore_env(var: str, old: str | None) -> None:
    if old is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = old


@contextlib.contextmanager
def nats_url(
    url: str | None,
    data_dir: str | Path | None = None,
    *,
    quiet: bool = False,
    auth: bool = True,
    namespace: str = "jnx",
    tls: TlsFiles | None = None,
    port: int = -1,
    host: str = "127.0.0.1",
    cluster: ClusterOptions | None = None,
    name: str = "jnx",
) -> Iterator[str]:
    """Yield ``url`` as given, or start an embedded nats-server (see :func:`embedded`)
    and stop it after."""
    if url:
        yield url
        return
    with embedded(
        data_dir, auth=auth, namespace=namespace, tls=tls, port=port, host=host,
        cluster=cluster, name=name,
    ) as ep:
        if not quiet:
            how = (
                f"authorization on; admin credentials {ep.admin_path}" if auth
                else "authorization OFF"
            )
            print(f"embedded nats-server at {ep.url} ({how}; store: {ep.data_dir})",
                  file=sys.stderr)
        yield ep.url
