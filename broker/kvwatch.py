"""A KV watch whose one ``None`` comes only once the current values are all in.

nats-py's ``KeyValue.watch`` marks the end of the current values with ``None``,
and it can send that marker too early (nats-io/nats.py#842; #995 is the open fix):
it compares the consumer's pending count from the server with the messages this
client has received so far, and messages the server has already sent (so no
longer pending) but that are still on their way count as neither. Under load the
marker then comes first, ahead of every current value, and whoever waits for it
(an inference engine that must load every tenant's current weights before it
joins; the auth sync that applies a bucket's identities at once) goes on with
none of them.

:func:`watch` keeps nats-py's watcher and drops its marker. It reads the
consumer's info once itself: the messages it has delivered plus those pending
are the current values (and anything written since), and the marker is given
once that many entries have been taken. If fewer ever come (a message removed
before it was delivered: a TTL, a purge), a quiet second in which the server has
nothing pending and has delivered no more than were taken ends them too.
:func:`keys` and :func:`history` read through it: nats-py's ``kv.keys()`` and
``kv.history()`` stop at the same early marker.

See docs/ARCHITECTURE.md, "The Inference Queue" (an engine joins with every
current policy loaded).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.js.errors import NotFoundError
from nats.js.kv import StopIterSentinel

log = logging.getLogger(__name__)

#: How long a watcher that has not seen all the current values waits quietly
#: before it asks the server whether anything is still pending.
RECHECK_S = 1.0


class CaughtUpWatcher:
    """nats-py's ``KeyWatcher`` (``updates``, ``async for``, ``stop``), with the
    marker (``None``) given once, after the current values. Deletes and purges are
    entries, as nats-py gives them (``entry.operation``)."""

    def __init__(self, inner: Any, initial: int) -> None:
        self._inner = inner
        self._initial = initial  # entries that make up the current values
        self._seen = 0
        self._caught_up = False
        self._marker_due = initial == 0  # an empty watch: the marker comes first

    @property
    def caught_up(self) -> bool:
        return self._caught_up or self._marker_due

    async def updates(self, timeout: float | None = 5.0) -> Any:  # noqa: ASYNC109 (nats-py's signature)
        """The next entry, or the marker; raises ``TimeoutError`` after ``timeout``
        seconds with neither (``None``: wait as long as it takes)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._marker_due:
                self._marker_due = False
                self._caught_up = True
                return None
            wait = None if deadline is None else max(0.0, deadline - loop.time())
            if not self._caught_up:
                wait = RECHECK_S if wait is None else min(wait, RECHECK_S)
            try:
                entry = await self._inner.updates(timeout=wait)
            except TimeoutError:
                if not self._caught_up and await self._nothing_pending():
                    self._marker_due = True
                    continue
                if deadline is not None and loop.time() >= deadline:
                    raise
                continue
            if entry is None:  # nats-py's own marker: it may come early
                continue
            if isinstance(entry, StopIterSentinel):
                return entry  # stopped: hand the sentinel on (see __anext__)
            self._seen += 1
            if not self._caught_up and self._seen >= self._initial:
                self._marker_due = True
            return entry

    async def _nothing_pending(self) -> bool:
        """Nothing pending on the server and nothing delivered that was not taken."""
        try:
            pending, delivered = await _counts(self._inner)
        except NotFoundError:  # the consumer went (a reset): its messages came or will
            log.debug("kv watch: its consumer is gone; taking the values as current")
            return True
        except Exception as e:  # a timeout under load, say: ask again after the next wait
            log.debug("kv watch: consumer info failed (%s); asking again", e)
            return False
        return pending == 0 and delivered <= self._seen

    def __aiter__(self) -> CaughtUpWatcher:
        return self

    async def __anext__(self) -> Any:
        entry = await self.updates(timeout=None)
        if isinstance(entry, StopIterSentinel):
            raise StopAsyncIteration
        return entry

    async def stop(self) -> None:
        await self._inner.stop()


async def watch(kv: Any, keys: str = ">", **kwargs: Any) -> CaughtUpWatcher:
    """``kv.watch(keys, **kwargs)``, its marker given after every current value.

    Not with ``ignore_deletes``: nats-py drops those entries without handing them
    on, so they could not be counted (skip deletes at the caller)."""
    if kwargs.get("ignore_deletes"):
        raise ValueError("kvwatch.watch counts every entry: skip deletes at the caller")
    inner = await kv.watch(keys, **kwargs)
    try:
        pending, delivered = await _counts(inner)
    except BaseException:
        await inner.stop()
        raise
    return CaughtUpWatcher(inner, delivered + pending)


async def _counts(inner: Any) -> tuple[int, int]:
    """(pending, delivered) of the watcher's consumer, from the server. ``_sub`` is
    nats-py's private subscription of the watcher (its ordered consumer): the only
    handle on the consumer whose counts are wanted."""
    info = await inner._sub.consumer_info()
    delivered = int(getattr(info.delivered, "consumer_seq", 0) or 0)
    return int(info.num_pending or 0), delivered


async def keys(kv: Any, keys: str = ">") -> list[str]:
    """The keys under ``keys`` that hold a value now, in the order the bucket has them
    (``[]`` for none). nats-py's ``kv.keys()`` stops at its own marker, so it can
    return a part of them, or raise ``NoKeysError`` on a bucket that has some."""
    w = await watch(kv, keys, meta_only=True)
    try:
        found: dict[str, None] = {}
        while (entry := await w.updates(timeout=None)) is not None:
            if entry.operation in ("DEL", "PURGE"):
                found.pop(entry.key, None)
            else:
                found[entry.key] = None
        return list(found)
    finally:
        await w.stop()


async def history(kv: Any, key: str) -> list[Any]:
    """Every retained entry of ``key``, oldest first, deletes and purges included
    (``[]`` for none; nats-py's ``kv.history()`` can stop short, as ``keys`` above)."""
    w = await watch(kv, key, include_history=True)
    try:
        out = []
        while (entry := await w.updates(timeout=None)) is not None:
            out.append(entry)
        return out
    finally:
        await w.stop()
