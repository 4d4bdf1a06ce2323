"""The producer agent: watches the workloads bucket and runs a producer (RL in
:mod:`joynexus.agents.envworkers`, SFT in :mod:`joynexus.agents.producers.sft`)
per active service-fed workload of its kind, restarting one that crashes.

See docs/ARCHITECTURE.md ("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from joynexus.agents.producers.sft import SFTProducer
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import CURSOR_KEYS
from joynexus.schemas.base import decode
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.workloads import WorkloadRecord

log = logging.getLogger(__name__)

#: producer-sft loads LeRobot's dataset reader before it says it is ready ("1"), not
#: when its first SFT workload comes (the default: the role stays light until then).
SFT_WARM_ENV = "JOYNEXUS_SFT_WARM"


async def watch_workloads(
    b: Broker, stop: asyncio.Event, *, idle: Any = None
) -> AsyncIterator[tuple[str, WorkloadRecord]]:
    """Every workload record as it is written (the current ones first) until
    ``stop``; ``idle()`` is called whenever nothing changed for half a second."""
    kv = await b.js.key_value(b.names.workloads_bucket)
    watcher = await kv.watchall()
    try:
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=0.5)
            except Exception:  # nothing new within the timeout
                entry = None
            if entry is None or not entry.value or entry.key.startswith(CURSOR_KEYS):
                if idle is not None:
                    idle()
                continue
            try:
                rec = decode(entry.value, WorkloadRecord)
            except JoyNexusError as e:
                log.warning("workload %s: %s", entry.key, e)
                continue
            yield entry.key, rec
    finally:
        await watcher.stop()


class ProducerAgent:
    """Runs a producer for every active workload of ``task_type`` (rl or sft)."""

    def __init__(self, broker: Broker, task_type: str, *, instance: str) -> None:
        self.b = broker
        self.task_type = task_type
        self.instance = instance
        #: (workload key, generation) -> its producer's task and stop event.
        self.running: dict[tuple[str, int], tuple[asyncio.Task[None], asyncio.Event]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        if self.task_type == "rl":
            # The first rgb env of a process starts the CPU renderer (10-30 s): pay it
            # now, before taking workloads, not inside the first tenant's rollout.
            from joynexus.agents.envs.maniskill import make_env

            env = await asyncio.to_thread(
                make_env, "PickCube-v1", obs="rgb", num_envs=1, image_size=64
            )
            await asyncio.to_thread(env.reset, 0)
            await asyncio.to_thread(env.close)
        if self.task_type == "sft" and os.environ.get(SFT_WARM_ENV, "").strip() in ("1", "true"):
            # LeRobot's dataset reader (torch and lerobot, ~5 s and ~850 MiB): a
            # deployment that wants its first SFT job not to pay it asks for it now.
            await asyncio.to_thread(importlib.import_module, "joynexus.agents.envs.lerobot_data")
        await metrics.emit(
            self.b,
            "system",
            service=f"producer-{self.task_type}",
            ready=True,
            instance=self.instance,
        )
        try:
            async for key, rec in watch_workloads(self.b, stop, idle=self._reap):
                if rec.spec.task_type != self.task_type or rec.spec.source != "service":
                    continue
                run = (key, rec.generation)
                for other in [r for r in self.running if r[0] == key and r != run]:
                    self.running[other][1].set()  # a generation since replaced
                if rec.state == "active" and run not in self.running:
                    ev = asyncio.Event()
                    cls: Any = SFTProducer
                    if self.task_type == "rl":  # on first use: it imports torch
                        from joynexus.agents.producers.rl import RLProducer as cls

                    def make(cls: Any = cls, rec: WorkloadRecord = rec, ev: asyncio.Event = ev) -> Any:
                        return cls(self.b, rec, instance=f"{self.instance}-{rec.tenant_id}").run(ev)

                    self.running[run] = (
                        asyncio.create_task(self._guard(make, key, ev, record=rec)),
                        ev,
                    )
                elif rec.state != "active" and run in self.running:
                    self.running[run][1].set()
        finally:
            for _task, ev in self.running.values():
                ev.set()
            await asyncio.gather(*(t for t, _ in self.running.values()), return_exceptions=True)

    async def _guard(
        self, make: Any, key: str, stop: asyncio.Event, *, record: WorkloadRecord | None = None
    ) -> None:
        """Run a workload's producer; one that crashes (the scheduler or NATS did not
        answer in time under load...) is started afresh while the workload is active,
        with backoff: it fails the job it left reserved and resumes from its cursor.
        (A producer that died here used to stay dead while its process kept beating, so
        its workload's training stopped for good: the PickCube SFT stall of issue 12.)
        One that crashed and is not started again (the workload was cancelled or ended
        meanwhile) has the jobs it left reserved or producing failed here instead."""
        delay = 1.0
        crashed = False
        while not stop.is_set():
            try:
                await make()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                crashed = True
                log.exception("producer for %s crashed; starting it again in %.0f s", key, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 30.0)
        if crashed and record is not None:
            await self._fail_left(record)

    async def _fail_left(self, rec: WorkloadRecord, *, tries: int = 5) -> None:
        """Fail the jobs a crashed producer of ``rec`` left open (one producer per
        workload: every reserved or producing job of it is that producer's)."""
        from joynexus.agents.scheduler_client import SchedulerClient

        sched = SchedulerClient(self.b, by=self.instance)
        for i in range(tries):
            try:
                await sched.fail_open(
                    rec.tenant_id, rec.spec.name, "producer crashed; its workload ended",
                    generation=rec.generation,
                )
                return
            except JoyNexusError as e:
                log.warning("%s: jobs of %s left open: %s", self.instance, rec.spec.name, e)
                await asyncio.sleep(min(2.0**i, 10.0))

    def _reap(self) -> None:
        for key in [k for k, (t, _) in self.running.items() if t.done()]:
            del self.running[key]

