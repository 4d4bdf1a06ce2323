"""Metric events on ``<ns>.metrics.<kind>.<tenant>`` (captured by the metrics stream).

Fire-and-forget: a lost metric never blocks training. Every string published
is :func:`clip`-ped (bounded, printable), because refusals carry what an
attacker sent and must neither grow the stream nor forge log lines; identical
refusals are counted, not copied (:class:`RefusalCounter`: the first at once,
the repeats within :data:`REFUSAL_WINDOW_S` as one event with ``count``).

See docs/ARCHITECTURE.md, "Traces and monitoring".
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import orjson

from joynexus.broker import tracing
from joynexus.broker.connection import Broker

log = logging.getLogger(__name__)

#: A tenant id that can be a subject token (``schemas.jobs.check_name``), or ``_``.
_TENANT = re.compile(r"^(?:[a-z0-9][a-z0-9_-]{0,31}|_)$")
#: The bound on a string field of a metric event other than a security event's.
FIELD_LIMIT = 1024
#: The bound on a security event's strings (what an attacker controls).
SECURITY_LIMIT = 160
#: ... and on its ``reason`` (ours, but quoting what the attacker sent).
REASON_LIMIT = 400


def clip(value: object, limit: int = 160) -> str:
    """``value`` as a bounded, printable string: ``str()`` of it (``repr`` if that
    fails), each non-printable character (control, format, separator other than
    the space, lone surrogate) replaced by ``?``, and cut to ``limit`` characters
    with a marker ``...(+N chars)`` saying how many were cut (so at most
    ``limit`` + 24 characters)."""
    if isinstance(value, str):
        s = value
    else:
        try:
            s = str(value)
        except Exception:
            try:
                s = repr(value)
            except Exception:
                s = f"<{type(value).__name__}>"
    limit = max(0, int(limit))
    extra = len(s) - limit
    head = s[:limit] if extra > 0 else s
    if not head.isprintable():
        head = "".join(c if c.isprintable() else "?" for c in head)
    return f"{head}...(+{extra} chars)" if extra > 0 else head


def tenant_token(tenant_id: object) -> str:
    """``tenant_id`` if it is a valid tenant name (or ``_``), else ``_``: it becomes
    a subject token."""
    return tenant_id if isinstance(tenant_id, str) and _TENANT.match(tenant_id) else "_"


def _clip_fields(value: Any, limit: int, depth: int = 0) -> Any:
    if isinstance(value, str):
        return clip(value, limit)
    if depth >= 4:
        return value if isinstance(value, (int, float, bool)) or value is None else clip(value, limit)
    if isinstance(value, dict):
        return {clip(k, limit): _clip_fields(v, limit, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clip_fields(v, limit, depth + 1) for v in value]
    return value


async def emit(b: Broker, kind: str, tenant_id: str = "_", **fields: Any) -> None:
    tenant = tenant_token(tenant_id)
    body: dict[str, Any] = {"kind": clip(kind, 32), "tenant_id": tenant, "at": time.time()}
    for k, v in fields.items():  # as before: a field may override kind or at
        if k != "tenant_id":
            body[clip(k, 64)] = _clip_fields(v, FIELD_LIMIT)
    try:
        payload = orjson.dumps(body)
        await b.nc.publish(b.names.metrics(tenant_token(kind), tenant), payload,
                           headers=tracing.inject())
    except Exception as e:  # disconnected (or unencodable): drop the metric, keep working
        log.debug("metric %s dropped: %s", kind, e)


async def busy(b: Broker, service: str, start: float, end: float, **fields: Any) -> None:
    """A busy interval (wall-clock seconds) of a service: ``train`` or ``infer``.
    Utilization timelines and device-time accounting are built from these; pass
    ``cpu_s`` (the process's CPU seconds in the interval) where the "device" is a
    CPU shared with other services, whose wall-clock intervals stretch under
    contention."""
    await emit(b, "system", "_", service=service, busy_start=start, busy_end=end, **fields)


# -- security events, counted
#: A summary event names at most this many of the users its refusals claimed.
MAX_CLAIMED = 8
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|\S*[0-9]\S*")


def reason_kind(reason: str) -> str:
    """What kind of refusal ``reason`` is: its text without the quoted names and
    the numbers in it (``tenant 'a' named job 'j1' ...`` -> ``tenant ? named job ? ...``),
    so refusals that differ only in what was named count together."""
    return clip(_QUOTED.sub("?", reason[:REASON_LIMIT]), 80)


@dataclass
class _Pending:
    b: Broker
    #: refusals since the last event published for this key
    count: int = 0
    first_at: float = 0.0
    #: the newest refusal not published yet (its fields)
    last: dict[str, Any] = field(default_factory=dict)
    #: when the last event was published (monotonic)
    published: float = 0.0
    #: the distinct users the counted refusals claimed (at most MAX_CLAIMED)
    claimed: set[str] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


class RefusalCounter:
    """Counts identical refusals (namespace, tenant, action, source, reason kind)
    of this process: the first is published at once (``count`` 1), the repeats
    within ``window_s`` of it are counted and published as one summary event at
    the window's end (``count``: how many it stands for, ``first_at``/``at``:
    the first and last of them, the newest one's fields, and ``claimed_users``:
    up to :data:`MAX_CLAIMED` distinct users the counted refusals claimed). The ``count`` of a
    key's events adds up to its refusals. At most ``max_keys`` keys are held;
    past that, refusals share one overflow key per (namespace, source)."""

    def __init__(self, window_s: float | None = None, max_keys: int = 1024) -> None:
        self._window_s = window_s
        self.max_keys = max_keys
        self._keys: dict[tuple[str, ...], _Pending] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: refusals seen and events published, per process (for tests and logs)
        self.refusals = 0
        self.events = 0

    @property
    def window_s(self) -> float:
        return REFUSAL_WINDOW_S if self._window_s is None else self._window_s

    async def add(self, b: Broker, tenant: str, fields: dict[str, Any]) -> None:
        now = time.monotonic()
        self.refusals += 1
        key: tuple[str, ...] = (b.names.namespace, tenant, fields["action"], fields["source"],
                                reason_kind(fields["reason"]))
        if key not in self._keys and len(self._keys) >= self.max_keys:
            self._expire(now)
            if len(self._keys) >= self.max_keys:
                key = (b.names.namespace, "_", "*", fields["source"], "overflow")
                tenant = "_"
        p = self._keys.get(key)
        if p is None or (p.count == 0 and now - p.published >= self.window_s):
            # The first of its kind (in a window): published at once.
            p = self._keys[key] = _Pending(b=b, published=now)
            log.warning("security: %s refused %s %s of tenant %s: %s", fields["source"],
                        fields["action"], fields["target"], tenant, fields["reason"])
            await self._publish(b, tenant, {**fields, "count": 1})
            return
        p.b = b
        if p.count == 0:
            p.first_at = time.time()
        p.count += 1
        p.last = fields
        user = fields.get("claimed_user")
        if isinstance(user, str) and len(p.claimed) < MAX_CLAIMED:
            p.claimed.add(user)
        if p.timer is None:
            delay = max(0.0, p.published + self.window_s - now)
            loop = asyncio.get_running_loop()
            p.timer = loop.call_later(delay, self._spawn_flush, key, tenant)

    def _spawn_flush(self, key: tuple[str, ...], tenant: str) -> None:
        t = asyncio.ensure_future(self._flush(key, tenant))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _flush(self, key: tuple[str, ...], tenant: str) -> None:
        p = self._keys.get(key)
        if p is None or p.count == 0:
            return
        count, last, first_at, claimed = p.count, p.last, p.first_at, p.claimed
        p.count, p.last, p.timer, p.published = 0, {}, None, time.monotonic()
        p.claimed = set()
        log.warning("security: %s refused %s of tenant %s %d more times in %.1fs (last: %s %s)",
                    last["source"], last["action"], tenant, count, self.window_s,
                    last["target"], last["reason"])
        summary = {**last, "count": count, "first_at": first_at}
        if claimed:
            summary["claimed_users"] = sorted(claimed)
        await self._publish(p.b, tenant, summary)

    async def flush(self) -> None:
        """Publish every pending summary now (at shutdown; tests)."""
        for key, p in list(self._keys.items()):
            if p.count:
                if p.timer is not None:
                    p.timer.cancel()
                await self._flush(key, key[1])

    def _expire(self, now: float) -> None:
        for key, p in list(self._keys.items()):
            if p.count == 0 and now - p.published >= self.window_s:
                del self._keys[key]

    async def _publish(self, b: Broker, tenant: str, fields: dict[str, Any]) -> None:
        self.events += 1
        await emit(b, "security", tenant, **fields)


#: How long repeats of a refusal are counted before their summary is published.
REFUSAL_WINDOW_S = 2.0
_counters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RefusalCounter] = (
    weakref.WeakKeyDictionary()
)


def refusal_counter() -> RefusalCounter:
    """The counter of the running event loop (one per loop: a process may run
    several, e.g. the auth sync's thread, and a summary is published on the loop
    of its connection)."""
    loop = asyncio.get_running_loop()
    c = _counters.get(loop)
    if c is None:
        c = _counters[loop] = RefusalCounter()
    return c


async def security(
    b: Broker, tenant_id: str, *, action: str, subject: str, reason: str, source: str,
    **extra: Any,
) -> None:
    """A refused attempt (kind ``security``): who (``tenant_id``, ``_`` when
    unknown or not a valid tenant name), what they tried (``action``: publish,
    subscribe, connect, claim_tenant, ...), on which subject (field ``target``),
    why it was refused and who saw it (``source``: nats-server, control,
    inference); ``extra`` fields (e.g. ``claimed_user``) are clipped too.
    Identical refusals are counted (:class:`RefusalCounter`): each event's
    ``count`` says how many refusals it stands for."""
    tenant = tenant_token(tenant_id)
    fields: dict[str, Any] = {
        clip(k, 32): clip(v, SECURITY_LIMIT) if not isinstance(v, (int, float, bool)) else v
        for k, v in extra.items()
    }
    if tenant != tenant_id:
        fields["claimed_tenant"] = clip(tenant_id, SECURITY_LIMIT)
    fields.update(
        action=clip(action, 32),
        target=clip(subject, SECURITY_LIMIT),
        reason=clip(reason, REASON_LIMIT),
        source=clip(source, 32),
    )
    await refusal_counter().add(b, tenant, fields)
