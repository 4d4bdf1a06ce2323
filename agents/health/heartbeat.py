"""An agent process's heartbeat: beats into KV ``<NS>_HEALTH`` from a thread
of its own, and the count of the errors the process logs.

A thread with its own connection, so that an agent that blocks its event loop
(a simulator step, an import of torch) still beats and is not taken for dead;
the beat carries the loop's lag instead. A beat's key has a per-message TTL,
so a dead or stopped agent's key expires. Each beat also carries the process's
resident memory (``rss_mb``) and, once its role serves (:meth:`Heartbeater.mark_ready`),
the seconds from the process's start to then (``ready_s``). See docs/ARCHITECTURE.md
("Health: heartbeats and in-place restarts", "Light roles").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator

import msgspec

from joynexus.agents.health.core import HEARTBEAT_S, ttl_for
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.headers import TTL
from joynexus.broker.natsapi import kv_subject
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.health import Heartbeat

log = logging.getLogger(__name__)


def rss_mb() -> float:
    """This process's resident memory now, in MiB (/proc; elsewhere its peak)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def process_age_s() -> float | None:
    """Seconds since this process started (its exec: interpreter start and imports
    included), from /proc to 10 ms; None where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            # Fields after the command name (which may hold spaces), from field 3:
            # starttime (field 22) is the 20th, in clock ticks since boot.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class _ErrorCounter(logging.Handler):
    """Counts the process's ERROR records and keeps the last (carried by every beat)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        with contextlib.suppress(Exception):
            self.last = f"{record.name}: {record.getMessage()}"[:500]


class Heartbeater:
    """Beats for one agent process from a thread with its own NATS connection.

    A thread, so that an agent that blocks its event loop for a while (a
    simulator step, an import) is not taken for dead; the beat carries the
    event loop's lag (``loop_lag_s``), and the manager restarts an agent
    whose loop stays frozen past ``HealthCore.hang_after_s``. SIGSTOP or a
    crash stops the thread too.
    """

    def __init__(
        self, b: Broker, role: str, instance: str, *, interval_s: float = HEARTBEAT_S
    ) -> None:
        self.b = b
        self.role, self.instance = role, instance
        self.interval_s = interval_s
        self.key = b.names.heartbeat_key(role, instance)
        self.subject = kv_subject(b.names.health_bucket, self.key)
        self.started_at = time.time()
        self.beats = 0
        self.errors = _ErrorCounter()
        self._reported = 0
        self._loop_seen = time.monotonic()
        self._done = threading.Event()
        self._final_state = "stopped"
        #: When the process started (the beats' ``ready_s`` counts from it).
        self.process_started_at = self.started_at - (process_age_s() or 0.0)
        #: Seconds from the process's start to its role serving; None until then.
        self.ready_s: float | None = None
        #: Where the role serves clients outside NATS (the gateway's URL), for status.
        self.address = ""

    def mark_ready(self) -> float:
        """The role serves from now on: later beats carry ``ready_s`` (the first
        call counts); the seconds since the process started."""
        if self.ready_s is None:
            self.ready_s = round(time.time() - self.process_started_at, 3)
        return self.ready_s

    async def beat(self, b: Broker, state: str = "running", ttl_s: int | None = None) -> None:
        self.beats += 1
        hb = Heartbeat(
            role=self.role,
            instance=self.instance,
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=self.started_at,
            at=time.time(),
            beats=self.beats,
            interval_s=self.interval_s,
            state=state,  # type: ignore[arg-type]
            errors=self.errors.count,
            last_error=self.errors.last,
            loop_lag_s=round(max(0.0, time.monotonic() - self._loop_seen - self.interval_s), 3),
            rss_mb=round(rss_mb(), 1),
            ready_s=self.ready_s,
            address=self.address,
        )
        ttl = ttl_s or ttl_for(self.interval_s)
        await b.js.publish(
            self.subject,
            msgspec.json.encode(hb),
            headers={TTL: f"{ttl}s"},
            timeout=max(0.25, 0.9 * self.interval_s),
        )
        if self.errors.count > self._reported:
            await metrics.emit(
                b,
                "system",
                event="error",
                role=self.role,
                instance=self.instance,
                errors=self.errors.count,
                new=self.errors.count - self._reported,
                last_error=self.errors.last,
            )
            self._reported = self.errors.count

    async def _beat_forever(self, servers: list[str]) -> None:
        b = await Broker.connect(
            servers, name=f"{self.instance}-heartbeat", namespace=self.b.names.namespace
        )
        loop = asyncio.get_running_loop()
        try:
            while not self._done.is_set():
                t0 = loop.time()
                try:
                    await self.beat(b)
                except Exception as e:  # disconnected: the next beat tries again
                    log.debug("heartbeat %s failed: %s", self.key, e)
                # A fixed cadence: a slow publish does not stretch the interval.
                await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - t0)))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.beat(b, self._final_state, ttl_s=60), 2.0)
        finally:
            await b.close()

    def _thread(self, servers: list[str]) -> None:
        try:
            asyncio.run(self._beat_forever(servers))
        except Exception as e:
            log.warning("heartbeat thread of %s ended: %s", self.key, e)

    async def _tick(self) -> None:
        while True:
            self._loop_seen = time.monotonic()
            await asyncio.sleep(self.interval_s / 2)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Heartbeater]:
        servers = [u.geturl() for u in self.b.nc.servers] or ["nats://127.0.0.1:4222"]
        logging.getLogger().addHandler(self.errors)
        tick = asyncio.create_task(self._tick(), name=f"heartbeat-tick-{self.key}")
        thread = threading.Thread(
            target=self._thread, args=(servers,), name=f"heartbeat-{self.key}", daemon=True
        )
        thread.start()
        try:
            yield self
        except BaseException as e:
            self._final_state = "crashed"
            self.errors.count += 1
            self.errors.last = f"{type(e).__name__}: {e}"[:500]
            raise
        finally:
            await cancel_and_wait(tick)
            logging.getLogger().removeHandler(self.errors)
            self._done.set()
            await asyncio.to_thread(thread.join, 5.0)
