"""Leases on single-instance roles: one live holder across hosts, and a fence for the deposed.

The Training Scheduler is the one decider of admission. With supervisors on
several hosts, each host may run a scheduler process; only the holder of the
lease serves, the others stand by and take over when the holder's host stops
renewing. Two pieces make this safe:

- **The lease** is a key in the health bucket (``lease.<role>``), written with
  a per-message TTL (``Nats-TTL``) and a compare-and-set on the key's last
  sequence. The server's clock ends it: when the holder stops renewing, the
  key expires and the server writes a delete marker, and a standby's create
  (CAS on that marker) wins. A renewal that finds another holder's write has
  lost the lease (:class:`Deposed`). A restart in place (same holder id) takes
  its own lease back at once.
- **The fence**: on taking over, the new holder appends an epoch message to
  ``<ns>.lease.<role>`` in the jobs stream. The scheduler guards every
  admission append (a new job's first event) with that subject's last sequence
  (``Nats-Expected-Last-Subject-Sequence-Subject``), so after a takeover the
  old holder's admissions are refused by the server itself, even if the old
  holder does not know yet that it was deposed (a paused process, a slow
  network). Every other append is already a per-job compare-and-append.

The job leases the scheduler grants (stage and actor leases) are kept alive by
:func:`keep_leases`, one loop for every holder: it touches each lease every
third of the TTL the scheduler's last lease reply carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import msgspec
from nats.js.errors import APIError, KeyDeletedError, KeyNotFoundError

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.errcodes import WRONG_LAST_SEQUENCE
from joynexus.broker.headers import EXPECTED_LAST_SUBJECT_SEQ, TTL
from joynexus.broker.natsapi import kv_subject
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.errors import JoyNexusError, Unavailable
from joynexus.schemas.jobs import TrainingJob

__all__ = ["Deposed", "LeaseRecord", "RoleLease", "host_id", "keep_leases", "leases_kept"]

#: A job lease is never touched more often than this (a tiny TTL from a test).
MIN_TOUCH_EVERY_S = 1.0

log = logging.getLogger(__name__)


def host_id() -> str:
    """This host's name in leases: ``$JOYNEXUS_HOST_ID`` (set by ``joynexus up
    --host-id``), else the machine's hostname."""
    return os.environ.get("JOYNEXUS_HOST_ID") or socket.gethostname()


class Deposed(Unavailable):
    """This holder's lease was taken by another: stop serving the role."""


class LeaseRecord(msgspec.Struct, kw_only=True):
    role: str
    holder: str
    acquired_at: float
    renewed_at: float
    ttl_s: int
    #: Sequence of the epoch message this holder wrote (the fence).
    epoch_seq: int = 0


class RoleLease:
    """The lease on ``role`` for ``holder`` (e.g. ``"<host>/<instance>"``)."""

    def __init__(self, b: Broker, role: str, holder: str, *, ttl_s: int = 6) -> None:
        if ttl_s < 2:
            raise ValueError("a lease TTL under 2 s cannot be renewed in time")
        self.b = b
        self.role = role
        self.holder = holder
        self.ttl_s = int(ttl_s)
        self.key = b.names.lease_key(role)
        self.subject = kv_subject(b.names.health_bucket, self.key)
        self._seq = 0  # sequence of our last write of the lease key
        self.epoch_seq = 0
        self.acquired_at = 0.0
        self.takeovers = 0

    # ------------------------------------------------------------ reading
    async def current(self) -> tuple[LeaseRecord | None, int]:
        """(the live record or None, the key's last sequence: the CAS token)."""
        kv = await self.b.js.key_value(self.b.names.health_bucket)
        try:
            entry = await kv.get(self.key)
        except KeyNotFoundError as e:
            # A delete marker (the TTL ran out) is "not found" too; its sequence is the token.
            seq = int(getattr(getattr(e, "entry", None), "revision", 0) or 0)
            if isinstance(e, KeyDeletedError) or seq:
                return None, seq
            return None, await self._last_seq()
        if entry.operation in ("PURGE", "DEL") or not entry.value:
            return None, int(entry.revision or 0)
        return msgspec.json.decode(entry.value, type=LeaseRecord), int(entry.revision or 0)

    async def _last_seq(self) -> int:
        try:
            msg = await self.b.js.get_last_msg(f"KV_{self.b.names.health_bucket}", self.subject)
        except Exception:  # no message on the subject at all
            return 0
        return int(msg.seq or 0)

    # ------------------------------------------------------------ writing
    async def _write(self, expected: int, acquired_at: float) -> int:
        rec = LeaseRecord(
            role=self.role,
            holder=self.holder,
            acquired_at=acquired_at,
            renewed_at=time.time(),
            ttl_s=self.ttl_s,
            epoch_seq=self.epoch_seq,
        )
        ack = await self.b.js.publish(
            self.subject,
            msgspec.json.encode(rec),
            headers={TTL: f"{self.ttl_s}s", EXPECTED_LAST_SUBJECT_SEQ: str(expected)},
        )
        return int(ack.seq)

    async def try_acquire(self) -> bool:
        """Take the lease if it is free (or already ours: a restart in place)."""
        rec, seq = await self.current()
        if rec is not None and rec.holder != self.holder:
            return False
        try:
            self._seq = await self._write(seq, time.time())
        except APIError as e:
            if e.err_code == WRONG_LAST_SEQUENCE:
                return False  # another standby won the race
            raise
        self.acquired_at = time.time()
        await self.write_epoch()
        self._seq = await self._write(self._seq, self.acquired_at)  # record the epoch in it
        self.takeovers += 1
        log.info("lease %s acquired by %s (epoch seq %d)", self.role, self.holder, self.epoch_seq)
        return True

    async def acquire(
        self, stop: asyncio.Event | None = None, *, on_wait: Callable[[LeaseRecord], None] | None = None
    ) -> bool:
        """Wait until this holder has the lease (True), or ``stop`` is set (False)."""
        while True:
            if await self.try_acquire():
                return True
            if on_wait is not None:
                rec, _ = await self.current()
                if rec is not None:
                    on_wait(rec)
            if stop is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.ttl_s / 4)
                if stop.is_set():
                    return False
            else:
                await asyncio.sleep(self.ttl_s / 4)

    async def write_epoch(self) -> int:
        """Append a new epoch message (the fence) while holding the lease."""
        ack = await self.b.js.publish(
            self.b.names.lease_epoch(self.role),
            msgspec.json.encode({"holder": self.holder, "at": time.time()}),
            stream=self.b.names.jobs_stream,
        )
        self.epoch_seq = int(ack.seq)
        return self.epoch_seq

    async def renew(self) -> None:
        """Extend the lease; raise :class:`Deposed` if another holder wrote it since."""
        try:
            self._seq = await self._write(self._seq, self.acquired_at)
        except APIError as e:
            if e.err_code == WRONG_LAST_SEQUENCE:
                rec, _ = await self.current()
                who = rec.holder if rec is not None else "nobody (it expired)"
                raise Deposed(f"lease on {self.role} lost: held by {who}, not {self.holder}") from e
            raise

    async def keep(self, stop: asyncio.Event, on_lost: Callable[[Deposed], Awaitable[None]]) -> None:
        """Renew every TTL/3 until ``stop``; on losing the lease call ``on_lost`` and return."""
        every = self.ttl_s / 3
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
            if stop.is_set():
                return
            try:
                await self.renew()
            except Deposed as e:
                await on_lost(e)
                return
            except Exception as e:  # disconnected: retry; the TTL decides if it was too long
                log.warning("lease %s: renewal failed: %s", self.role, e)

    async def release(self) -> None:
        """Give the lease up (a clean stop): a standby takes over without waiting the TTL."""
        kv = await self.b.js.key_value(self.b.names.health_bucket)
        with contextlib.suppress(Exception):
            await kv.delete(self.key, last=self._seq)


# ------------------------------------------------------------ job leases
def touch_every_s(ttl_s: float, every_s: float | None = None) -> float:
    """How often a job lease of ``ttl_s`` is touched: a third of it (at least
    MIN_TOUCH_EVERY_S), or ``every_s`` when that is sooner (the holder has something
    else to keep alive, e.g. a JetStream message's ack wait)."""
    period = max(MIN_TOUCH_EVERY_S, ttl_s / 3)
    return period if every_s is None else min(period, every_s)


async def keep_leases(
    sched: SchedulerClient,
    jobs: Sequence[TrainingJob],
    *,
    also: Callable[[], Awaitable[object]] | None = None,
    every_s: float | None = None,
) -> None:
    """Touch every job's lease until cancelled, driven by the scheduler's lease TTL
    (``sched.lease_ttl_s``, from its last lease reply); ``also()`` runs first on each
    beat (it ends the loop if it fails). A touch the scheduler refuses (the lease
    moved on) is logged and the others go on; completing says the rest."""
    while True:
        await asyncio.sleep(touch_every_s(sched.lease_ttl_s, every_s))
        if also is not None:
            await also()
        for job in jobs:
            try:
                await sched.touch(job)
            except JoyNexusError as e:
                log.info("touching the lease of job %s failed: %s", job.job_id, e)


@contextlib.asynccontextmanager
async def leases_kept(
    sched: SchedulerClient,
    jobs: Sequence[TrainingJob],
    *,
    also: Callable[[], Awaitable[object]] | None = None,
    every_s: float | None = None,
) -> AsyncIterator[None]:
    """:func:`keep_leases` while the block runs."""
    task = asyncio.create_task(keep_leases(sched, jobs, also=also, every_s=every_s))
    try:
        yield
    finally:
        await cancel_and_wait(task)
