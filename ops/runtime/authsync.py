"""Authorization on the embedded server: bootstrap identities and the auth sync.

Only the process that owns the server can rewrite its ``auth.conf`` and
reload it, so it runs both: :func:`bootstrap` generates the service-side
identities into ``<data-dir>/credentials/`` (owner-only) and writes
``auth.conf`` if it does not exist yet; :class:`AuthSync` (as admin) renders
the identities bucket into it on every change, reloads the server with
SIGHUP, records the revision under ``_applied.<server name>`` (which the
control plane waits for), and turns the server's logged refusals into
``security`` events.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
from nats.js.errors import NotFoundError

from joynexus.broker import kvwatch, metrics
from joynexus.broker.connection import Broker, raise_if_cancelled
from joynexus.broker.credentials import Credentials
from joynexus.broker.natsapi import JS_STREAM_NAMES, STREAM_CREATED_ADVISORIES, kv_subject
from joynexus.broker.permissions import (
    parse_refusal,
)
from joynexus.broker.subjects import Names
from joynexus.broker.tasks import cancel_and_wait
from joynexus.ops.runtime.bootstrap import AUTH_FILE, credentials_path, write_auth
from joynexus.ops.runtime.conncap import Capped, ConnectionCap
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.base import decode, encode
from joynexus.schemas.identities import (
    AuthApplied,
    TenantIdentity,
    applied_key,
    is_applied_key,
)
from joynexus.schemas.jobs import check_name
from joynexus.schemas.quotas import DEFAULT_QUOTA

log = logging.getLogger(__name__)

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
        # The loop the refusals are reported on: the one constructing this (the
        # server's log is pumped from its start, before run() has begun), else run()'s.
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._lines: asyncio.Queue[str] = asyncio.Queue(maxsize=10_000)
        # bucket -> tenant -> identity; bucket -> revision seen but not yet applied
        self._tenants: dict[str, dict[str, TenantIdentity]] = {}
        self._dirty: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._kvs: dict[str, Any] = {}
        #: (bucket, key) -> why its record was not applied (the newest such record)
        self.rejected: dict[tuple[str, str], str] = {}
        self._reported: set[tuple[str, str, int]] = set()
        # bucket -> (watcher failures in a row, not restarted before this loop time)
        self._backoff: dict[str, tuple[int, float]] = {}
        #: refusal log lines dropped (the queue was full), reported as a count
        self.dropped = 0
        #: each tenant's connections capped (None: no system account on this server)
        self.conncap: ConnectionCap | None = None

    # -- the server's log (called from its pump thread)
    def on_log_line(self, line: str) -> None:
        """Queues a refusal line for reporting (any thread). Lines queued before
        run() starts are reported once it does (a login refused while the layout
        is still being made is not lost)."""
        if self._loop is None or parse_refusal(line) is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self._loop.call_soon_threadsafe(self._enqueue, line)

    def _enqueue(self, line: str) -> None:
        try:
            self._lines.put_nowait(line)
        except asyncio.QueueFull:  # a flood of refusals: drop (and count) the excess
            self.dropped += 1

    async def _report_refusals(self) -> None:
        """The server's refusals as security events (counted by ``metrics.security``).
        A failed login is filed under tenant ``_`` with the user it claimed
        (``claimed_user``): whoever sends a tenant's user name is not that tenant.
        Never stops on a bad line or a failed publish."""
        reported_drops = 0
        while True:
            line = await self._lines.get()
            try:
                await self._report_line(line)
                if self.dropped > reported_drops:
                    log.warning("auth sync: %d refusal log lines dropped (a flood)",
                                self.dropped - reported_drops)
                    reported_drops = self.dropped
            except Exception:
                raise_if_cancelled()
                log.exception("reporting a refusal failed")

    async def _report_line(self, line: str) -> None:
        r = parse_refusal(line)
        if r is None:
            return
        names = self._names_of_user(r.user)
        b = Broker(nc=self.b.nc, js=self.b.js, names=names)
        if r.action == "connect":
            await metrics.security(b, "_", action=r.action, subject=r.subject, reason=r.reason,
                                   source="nats-server", claimed_user=r.user)
            return
        await metrics.security(
            b,
            r.tenant(names),
            action=r.action,
            subject=r.subject,
            reason=f"{r.reason} (user {metrics.clip(r.user, 64)!r})",
            source="nats-server",
        )

    def caps(self) -> dict[str, Capped]:
        """Each tenant user's connection cap (its quota's ``max_connections``)."""
        out = {}
        for bucket, tenants in self._tenants.items():
            names = _bucket_names(bucket)
            for t in tenants.values():
                quota = t.quota or DEFAULT_QUOTA
                out[t.user] = Capped(names, t.tenant_id, quota.max_connections)
        return out

    def _names_of_user(self, user: str) -> Names:
        """The deployment a user belongs to (``<ns>.<tenant>``), when it is one this
        server has an identities bucket of; else this auth sync's own (a claimed
        user names whatever it likes: it does not choose where its refusal lands)."""
        ns = user.split(".", 1)[0] if "." in user else self.n.namespace
        try:
            names = Names(ns)
        except Exception:
            return self.n
        return names if names.identities_bucket in self._tenants else self.n

    # -- identities buckets -> auth.conf -> reload
    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        tasks = [
            asyncio.ensure_future(self._report_refusals()),
            asyncio.ensure_future(self._apply_loop()),
        ]
        system = credentials_path(self.server.data_dir, "system")
        if system.exists():  # each tenant's connections capped (its quota)
            cap = ConnectionCap(self.b, Credentials.load(system), self.server.url, self.caps)
            self.conncap = cap
            tasks.append(asyncio.ensure_future(cap.run(stop)))
        watchers: dict[str, asyncio.Task[None]] = {}
        # A new identities bucket (a deployment's ensure_layout) is found at once from
        # JetStream's stream-created advisory; the periodic listing is the fallback.
        wake = asyncio.Event()

        async def on_created(msg: Any) -> None:
            if msg.subject.endswith("_IDENTITIES"):
                wake.set()

        created = await self.b.nc.subscribe(STREAM_CREATED_ADVISORIES, cb=on_created)
        try:
            while not stop.is_set():
                wake.clear()
                listed = await self._identity_buckets()
                for bucket in listed or []:
                    if bucket not in watchers or self._restart_due(bucket, watchers[bucket]):
                        watchers[bucket] = asyncio.ensure_future(self._watch(bucket))
                if listed is not None:
                    await self._forget_deleted(watchers, set(listed))
                waits = [asyncio.ensure_future(e.wait()) for e in (stop, wake)]
                await asyncio.wait(waits, timeout=self.discover_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
        finally:
            with contextlib.suppress(Exception):
                await created.unsubscribe()
            await cancel_and_wait(*tasks, *watchers.values())
            # This server stops applying: nobody should wait for it any more.
            for kv in self._kvs.values():
                with contextlib.suppress(Exception):
                    await kv.delete(applied_key(self.server.name))

    def _restart_due(self, bucket: str, task: asyncio.Task[None]) -> bool:
        """Whether the watcher of ``bucket`` is to be (re)started now: it ended, and
        its backoff (1 s doubling to 30 s while it keeps failing before its first
        complete read) is over."""
        if not task.done():
            return False
        now = asyncio.get_running_loop().time()
        failures, not_before = self._backoff.get(bucket, (0, 0.0))
        if not_before >= 0:  # its end was looked at: restart once the backoff is over
            return now >= not_before
        err = None if task.cancelled() else task.exception()
        failures = failures + 1 if err is not None else 0
        if err is not None:
            log.warning("auth sync: the watcher of %s failed (%d in a row): %r", bucket,
                        failures, err)
        delay = min(30.0, 2.0 ** (failures - 1)) if failures else 0.0
        self._backoff[bucket] = (failures, now + delay)
        return delay == 0.0

    async def _forget_deleted(self, watchers: dict[str, asyncio.Task[None]], listed: set[str]) -> None:
        """A namespace whose identities bucket is gone (its layout deleted) has no
        tenants any more: stop following it and take its users out of auth.conf, so
        a deleted deployment's credentials stop working (and its watcher does not
        ask the server for a stream that is not there every few seconds)."""
        for bucket in [b for b in watchers if b not in listed]:
            # Missing from a listing is not proof (a cluster electing its meta leader
            # may list nothing): only the server's "stream not found" for it is.
            try:
                await self.b.js.stream_info(f"KV_{bucket}")
                continue
            except NotFoundError:
                pass
            except Exception as e:
                log.debug("auth sync: bucket %s not listed, and not confirmed gone: %s", bucket, e)
                continue
            task = watchers.pop(bucket)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self._kvs.pop(bucket, None)
            self._backoff.pop(bucket, None)
            self._dirty.pop(bucket, None)
            for key in [k for k in self.rejected if k[0] == bucket]:
                del self.rejected[key]
            if self._tenants.pop(bucket, None) is not None:
                log.info("auth sync: bucket %s is gone; its tenants are removed", bucket)
                self._changed.set()

    async def _identity_buckets(self) -> list[str] | None:
        """The identities buckets on the server; None if it could not be listed."""
        names: list[str] = []
        try:
            while True:  # the server answers a page at a time (1024 names)
                msg = await self.b.nc.request(
                    JS_STREAM_NAMES, orjson.dumps({"offset": len(names)}), timeout=5.0
                )
                page = orjson.loads(msg.data)
                if "error" in page:
                    raise RuntimeError(f"STREAM.NAMES: {page['error']}")
                got = page.get("streams") or []
                names += got
                if not got or len(names) >= int(page.get("total", 0)):
                    break
        except Exception as e:  # disconnected for a moment: try again later
            log.debug("listing streams failed: %s", e)
            return None
        return [n[3:] for n in names if n.startswith("KV_") and n.endswith("_IDENTITIES")]

    async def _watch(self, bucket: str) -> None:
        """Follow one identities bucket into ``self._tenants[bucket]``. A record that
        does not decode, or does not match its key, is skipped (and reported), the
        others are applied. A restarted watcher rebuilds the bucket's tenants from
        its current values (kept as they were until those are all in)."""
        self._backoff[bucket] = (self._backoff.get(bucket, (0, 0.0))[0], -1.0)
        kv = self._kvs[bucket] = await self.b.js.key_value(bucket)
        tenants: dict[str, TenantIdentity] = {}
        current = False  # the bucket's current values are not all in yet
        watcher = await kvwatch.watch(kv)  # nats-py's marker can come early
        last = 0
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=5.0)
                except TimeoutError:
                    continue
                if entry is None:  # the current values are all in: apply them
                    if not current:
                        self._tenants[bucket] = tenants
                        current = True
                        self._backoff[bucket] = (0, -1.0)  # it works: no backoff
                    # Everything up to `last` is in (the watcher delivers in order);
                    # never claim a revision not seen yet (an empty bucket: 0).
                    self._mark(bucket, last)
                    continue
                last = max(last, entry.revision or 0)
                key = entry.key
                if not isinstance(key, str) or is_applied_key(key):
                    continue
                if entry.operation in ("DEL", "PURGE") or not entry.value:
                    tenants.pop(key, None)
                    self.rejected.pop((bucket, key), None)
                else:
                    ident, why = self._identity(bucket, key, entry.value)
                    if ident is None:
                        # Not applied; an earlier record of this key goes too (what
                        # the bucket says of it now is not understood: fail closed).
                        tenants.pop(key, None)
                        await self._reject(bucket, key, entry.revision or 0, why)
                    else:
                        tenants[key] = ident
                        self.rejected.pop((bucket, key), None)
                if current:
                    self._mark(bucket, last)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def _identity(self, bucket: str, key: str, value: bytes) -> tuple[TenantIdentity | None, str]:
        """The identity a record holds, or None and why it is not one to apply."""
        try:
            names = _bucket_names(bucket)
            check_name("tenant", key)
        except Exception as e:
            return None, f"key is not a tenant name: {e}"
        try:
            ident = decode(value, TenantIdentity, what="tenant identity")
        except Exception as e:
            return None, f"record does not decode: {e}"
        if ident.tenant_id != key:
            return None, f"record names tenant {ident.tenant_id!r}, not its key"
        if ident.user != names.tenant_user(key):
            return None, (f"record names user {ident.user!r}, not "
                          f"{names.tenant_user(key)!r}")
        if not isinstance(ident.password_hash, str) or not ident.password_hash.startswith("$2"):
            return None, "record holds no bcrypt password hash"
        return ident, ""

    async def _reject(self, bucket: str, key: str, revision: int, why: str) -> None:
        self.rejected[(bucket, key)] = why
        if (bucket, key, revision) in self._reported:  # a restarted watcher sees it again
            return
        if len(self._reported) > 10_000:
            self._reported.clear()
        self._reported.add((bucket, key, revision))
        log.error("auth sync: identity record %s of %s (revision %d) not applied: %s",
                  metrics.clip(key, 64), bucket, revision, metrics.clip(why, 300))
        try:
            names = _bucket_names(bucket)
        except Exception:
            names = self.n
        with contextlib.suppress(Exception):
            await metrics.security(
                Broker(nc=self.b.nc, js=self.b.js, names=names),
                "_",
                action="identity_record",
                subject=kv_subject(bucket, key),
                reason=f"identity record not applied: {why}",
                source="auth-sync",
                key=key,
                revision=revision,
            )

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
        spaces = [_bucket_names(bucket).namespace for bucket in self._tenants]
        await asyncio.to_thread(write_auth, conf, self.n, self.admin, self.service, tenants, spaces)
        await asyncio.to_thread(self.server.reload)
        self.reloads += 1
        log.info("authorization applied: %d tenant users", len(tenants))


def _bucket_names(bucket: str) -> Names:
    """``JNX_IDENTITIES`` -> ``Names("jnx")``."""
    return Names(bucket.removesuffix("_IDENTITIES").lower())
