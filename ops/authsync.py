"""Authorization on the embedded server: bootstrap identities and the auth sync.

The process that owns the embedded nats-server (``joynexus up``, ``joynexus
server``, ``joynexus demo``, the tests) runs it with authorization on:

1. :func:`bootstrap` generates the admin and service identities into
   ``<data-dir>/credentials/{admin,service}.json`` (owner-only) on first start
   and writes ``<data-dir>/auth.conf`` (users with bcrypt hashes and
   permissions, included by the server's config) if it does not exist yet.
2. :class:`AuthSync` (connected as admin) watches the identities bucket, which
   the control plane writes when an operator adds or removes a tenant, renders
   it into ``auth.conf`` and reloads the server (SIGHUP: no restart, live
   connections of a removed tenant are closed), then records the revision it
   applied under ``_applied.<server name>`` (one key per node of a cluster),
   which the control plane waits for.
3. It turns the server's refusals (permission violations, failed
   authentications, from its log) into ``security`` metric events.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from joynexus.broker import metrics
from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.broker.credentials import Credentials
from joynexus.broker.permissions import (
    User,
    hash_password,
    new_password,
    parse_refusal,
    render_authorization,
    service_permissions,
    tenant_permissions,
)
from joynexus.broker.subjects import Names
from joynexus.ops.natsserver import EmbeddedNats
from joynexus.schemas.base import decode, encode
from joynexus.schemas.identities import (
    AuthApplied,
    TenantIdentity,
    applied_key,
    is_applied_key,
)

log = logging.getLogger(__name__)

AUTH_FILE = "auth.conf"
#: JetStream's advisory when a stream (e.g. ``KV_<NS>_IDENTITIES``) is created.
STREAM_CREATED = "$JS.EVENT.ADVISORY.STREAM.CREATED.*"
CREDS_DIR = "credentials"


def credentials_path(data_dir: str | os.PathLike[str], kind: str) -> Path:
    return Path(data_dir) / CREDS_DIR / f"{kind}.json"


def bootstrap(
    data_dir: str | os.PathLike[str], names: Names, *, ca_file: str | None = None
) -> tuple[Credentials, Credentials]:
    """The (admin, service) credentials of this data dir, generated on first use,
    and an ``auth.conf`` holding at least them."""
    out = []
    for kind, user in (("admin", names.admin_user), ("service", names.service_user)):
        path = credentials_path(data_dir, kind)
        if path.exists():
            creds = Credentials.load(path)
            if ca_file and creds.ca_file != ca_file:  # TLS turned on since: trust its CA
                creds = dataclasses.replace(creds, ca_file=ca_file)
                creds.save(path)
        else:
            creds = Credentials(
                kind=kind,  # type: ignore[arg-type]
                user=user,
                password=new_password(),
                namespace=names.namespace,
                ca_file=ca_file,
            )
            creds.save(path)
        out.append(creds)
    admin, service = out
    conf = Path(data_dir) / AUTH_FILE
    if not conf.exists():
        write_auth(conf, names, admin, service, [])
    return admin, service


def _bootstrap_users(names: Names, admin: Credentials, service: Credentials) -> list[User]:
    assert admin.user and admin.password and service.user and service.password
    return [
        User(admin.user, _hash_cached(admin.password)),
        User(service.user, _hash_cached(service.password), service_permissions()),
    ]


_hashes: dict[str, str] = {}


def _hash_cached(password: str) -> str:
    if password not in _hashes:
        _hashes[password] = hash_password(password)
    return _hashes[password]


def write_auth(
    path: Path,
    names: Names,
    admin: Credentials,
    service: Credentials,
    tenants: list[tuple[TenantIdentity, Names]],
) -> None:
    """auth.conf: the bootstrap users, then each tenant user with the permissions
    of its deployment's namespace."""
    users = _bootstrap_users(names, admin, service) + [
        User(t.user, t.password_hash, tenant_permissions(ns, t.tenant_id))
        for t, ns in sorted(tenants, key=lambda x: x[0].user)
    ]
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(render_authorization(users))
    os.replace(tmp, path)


def secured_server(
    data_dir: str | os.PathLike[str], names: Names, **server_kw: Any
) -> tuple[EmbeddedNats, Credentials, Credentials]:
    """An embedded server (not started yet) with authorization on, and the
    (admin, service) credentials to reach it."""
    tls = server_kw.get("tls")
    admin, service = bootstrap(data_dir, names, ca_file=getattr(tls, "ca_file", None))
    server = EmbeddedNats(data_dir, auth_include=AUTH_FILE, **server_kw)
    return server, admin, service


class AuthSync:
    """Keeps the server's authorization equal to the identities buckets of every
    deployment namespace on it (each ``<NS>_IDENTITIES``, discovered as they are
    created), and reports the server's refusals as security events."""

    def __init__(
        self,
        b: Broker,
        server: EmbeddedNats,
        admin: Credentials,
        service: Credentials,
        *,
        debounce_s: float = 0.05,
        discover_s: float = 0.5,
    ) -> None:
        self.b = b
        self.n = b.names
        self.server = server
        self.admin = admin
        self.service = service
        self.debounce_s = debounce_s
        self.discover_s = discover_s
        self.reloads = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lines: asyncio.Queue[str] = asyncio.Queue(maxsize=10_000)
        # bucket -> tenant -> identity; bucket -> revision seen but not yet applied
        self._tenants: dict[str, dict[str, TenantIdentity]] = {}
        self._dirty: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._kvs: dict[str, Any] = {}

    # -- the server's log (called from its pump thread)
    def on_log_line(self, line: str) -> None:
        if self._loop is None or parse_refusal(line) is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self._loop.call_soon_threadsafe(self._enqueue, line)

    def _enqueue(self, line: str) -> None:
        with contextlib.suppress(asyncio.QueueFull):  # a flood of refusals: drop the excess
            self._lines.put_nowait(line)

    async def _report_refusals(self) -> None:
        while True:
            line = await self._lines.get()
            r = parse_refusal(line)
            if r is None:
                continue
            names = self._names_of_user(r.user)
            await metrics.security(
                Broker(nc=self.b.nc, js=self.b.js, names=names),
                r.tenant(names),
                action=r.action,
                subject=r.subject,
                reason=f"{r.reason} (user {r.user!r})",
                source="nats-server",
            )

    def _names_of_user(self, user: str) -> Names:
        """The deployment a tenant user belongs to (``<ns>.<tenant>``)."""
        ns = user.split(".", 1)[0] if "." in user else self.n.namespace
        try:
            return Names(ns)
        except Exception:
            return self.n

    # -- identities buckets -> auth.conf -> reload
    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        tasks = [
            asyncio.ensure_future(self._report_refusals()),
            asyncio.ensure_future(self._apply_loop()),
        ]
        watchers: dict[str, asyncio.Task[None]] = {}
        # A new identities bucket (a deployment's ensure_layout) is found at once from
        # JetStream's stream-created advisory; the periodic listing is the fallback.
        wake = asyncio.Event()

        async def on_created(msg: Any) -> None:
            if msg.subject.endswith("_IDENTITIES"):
                wake.set()

        created = await self.b.nc.subscribe(STREAM_CREATED, cb=on_created)
        try:
            while not stop.is_set():
                wake.clear()
                for bucket in await self._identity_buckets():
                    if bucket not in watchers or watchers[bucket].done():
                        watchers[bucket] = asyncio.ensure_future(self._watch(bucket))
                waits = [asyncio.ensure_future(e.wait()) for e in (stop, wake)]
                await asyncio.wait(waits, timeout=self.discover_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
        finally:
            with contextlib.suppress(Exception):
                await created.unsubscribe()
            for t in [*tasks, *watchers.values()]:
                t.cancel()
            await asyncio.gather(*tasks, *watchers.values(), return_exceptions=True)
            # This server stops applying: nobody should wait for it any more.
            for kv in self._kvs.values():
                with contextlib.suppress(Exception):
                    await kv.delete(applied_key(self.server.name))

    async def _identity_buckets(self) -> list[str]:
        try:
            infos = await self.b.js.streams_info()
        except Exception as e:  # disconnected for a moment: try again later
            log.debug("listing streams failed: %s", e)
            return []
        suffix = "_IDENTITIES"
        return [
            i.config.name[3:]
            for i in infos
            if i.config.name and i.config.name.startswith("KV_") and i.config.name.endswith(suffix)
        ]

    async def _watch(self, bucket: str) -> None:
        kv = self._kvs[bucket] = await self.b.js.key_value(bucket)
        tenants = self._tenants.setdefault(bucket, {})
        watcher = await kv.watchall()
        last = 0
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=5.0)
                except TimeoutError:
                    continue
                if entry is None:  # the current values are all in: apply them
                    # Everything up to `last` is in (the watcher delivers in order);
                    # never claim a revision not seen yet (an empty bucket: 0).
                    self._mark(bucket, last)
                    continue
                last = max(last, entry.revision or 0)
                if is_applied_key(entry.key):
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    tenants.pop(entry.key, None)
                else:
                    tenants[entry.key] = decode(entry.value, TenantIdentity)
                self._mark(bucket, last)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def _mark(self, bucket: str, revision: int) -> None:
        self._dirty[bucket] = max(self._dirty.get(bucket, 0), revision)
        self._changed.set()

    async def _apply_loop(self) -> None:
        while True:
            raise_if_cancelled()
            await self._changed.wait()
            await asyncio.sleep(self.debounce_s)  # let a burst of changes land together
            self._changed.clear()
            dirty, self._dirty = self._dirty, {}
            try:
                await self.apply()
            except Exception:
                raise_if_cancelled()
                log.exception("applying the authorization failed; retrying")
                for bucket, rev in dirty.items():
                    self._mark(bucket, rev)
                await asyncio.sleep(1.0)
                continue
            for bucket, rev in dirty.items():
                mark = AuthApplied(
                    revision=rev, tenants=sorted(self._tenants.get(bucket, {})), at=time.time()
                )
                with contextlib.suppress(Exception):
                    await self._kvs[bucket].put(applied_key(self.server.name), encode(mark))

    async def apply(self) -> None:
        """Render every namespace's tenants into auth.conf and reload the server."""
        conf = self.server.data_dir / AUTH_FILE
        tenants = [(ident, _bucket_names(bucket)) for bucket, ts in self._tenants.items()
                   for ident in ts.values()]
        await asyncio.to_thread(write_auth, conf, self.n, self.admin, self.service, tenants)
        await asyncio.to_thread(self.server.reload)
        self.reloads += 1
        log.info("authorization applied: %d tenant users", len(tenants))


def _bucket_names(bucket: str) -> Names:
    """``JNX_IDENTITIES`` -> ``Names("jnx")``."""
    return Names(bucket.removesuffix("_IDENTITIES").lower())
