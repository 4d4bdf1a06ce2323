"""Role ``env-worker``: a worker process that warms up, then runs an
:class:`~joynexus.agents.producers.rl.RLProducer` for whatever its
assignment names."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import msgspec

from joynexus.agents.envs.pool import EnvPool, build_key, close_env
from joynexus.agents.envworkers.assign import (
    ENV_ROLE,
    THREADS_ENV,
    Assignment,
    assignment_key,
    warm_envs,
)
from joynexus.agents.producers.rl import RLProducer
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.base import decode
from joynexus.schemas.workloads import WorkloadRecord

log = logging.getLogger(__name__)


def _die_hard_with_parent() -> None:
    """SIGKILL this worker when its supervisor dies (not SIGTERM: a worker stopping
    gracefully without its supervisor could outlive it; the next supervisor fails
    the jobs it left)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the supervisor died before that
        os._exit(1)


async def warm_up(instance: str, envs: tuple[str, ...],
                  pool: EnvPool | None = None) -> dict[str, float]:
    """Build and reset each of ``envs`` once (``$JOYNEXUS_ENV_WARM``): the first env of
    a kind starts its renderer and loads its assets (ManiSkill 15-30 s here, LIBERO
    about 40 s), so no tenant's first rollout pays that. Seconds per env.

    Each is built as a workload of that env with the default settings builds it (one
    env, rgb, 64 px, the task's own cameras and state) and, with ``pool``, kept there
    for it: closing a LIBERO env leaves most of its ~0.9 GB behind, so a worker that
    warmed one env and then built the workload's would hold both."""
    from joynexus.agents.envs.registry import make_env, task_spec

    took: dict[str, float] = {}
    for name in envs:
        t0 = time.perf_counter()
        log.info("%s: warming %s", instance, name)
        spec = task_spec(name, obs="rgb", num_envs=1, image_size=64)
        args: dict[str, Any] = dict(obs="rgb", num_envs=1, image_size=64, cameras=tuple(spec.cameras),
                    state_keys=tuple(spec.state_keys) or None)
        env = await asyncio.to_thread(make_env, name, **args)
        await asyncio.to_thread(env.reset, 0)
        if pool is not None:
            await pool.give(build_key(name, **args), env)
        else:
            await close_env(env)
        took[name] = round(time.perf_counter() - t0, 2)
        log.info("%s: %s warm in %.1f s", instance, name, took[name])
    return took


class EnvWorker:
    """Role ``env-worker``: rollouts of the workload its assignment names."""

    def __init__(self, broker: Broker, *, instance: str) -> None:
        self.b = broker
        self.instance = instance
        self.assignment = Assignment()
        self.changed = asyncio.Event()
        #: Built envs kept between workloads (``$JOYNEXUS_ENV_POOL``).
        self.pool = EnvPool()

    async def _watch(self, kv: Any) -> None:
        key = assignment_key(self.instance)
        while True:
            try:
                watcher = await kv.watch(key)
                while True:
                    try:
                        entry = await watcher.updates(timeout=5.0)
                    except Exception:  # nothing new
                        continue
                    if entry is None:
                        continue
                    a = Assignment()
                    if entry.value and entry.operation not in ("DEL", "PURGE"):
                        with contextlib.suppress(msgspec.DecodeError):
                            a = msgspec.json.decode(entry.value, type=Assignment)
                    if a.workload != self.assignment.workload:
                        self.assignment = a
                        self.changed.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the server went away: watch again
                log.debug("assignment watch failed: %s", e)
                await asyncio.sleep(1.0)

    async def _fail_own_orphans(self, health: Any, workloads: Any) -> None:
        """A restarted worker first frees the admission slots its previous incarnation
        held (before the slow warm-up)."""
        try:
            a = msgspec.json.decode(
                (await health.get(assignment_key(self.instance))).value, type=Assignment
            )
        except Exception:  # no assignment yet: nothing left behind
            return
        # Also the workload it served before: taken off it (a cancel) and killed before
        # it failed its own job, the job would stay producing.
        for key in dict.fromkeys(k for k in (a.workload, a.previous) if k):
            with contextlib.suppress(Exception):
                rec = decode((await workloads.get(key)).value, WorkloadRecord)
                await RLProducer(
                    self.b, rec, instance=self.instance, own_orphans_only=True
                )._fail_orphans()

    async def run(self, stop: asyncio.Event) -> None:
        _die_hard_with_parent()
        import torch

        torch.set_num_threads(max(1, int(os.environ.get(THREADS_ENV, "1"))))
        # What this worker does (start, warm-up, each rollout, waits) is in its log at INFO.
        logging.getLogger("joynexus.agents.envworkers").setLevel(logging.INFO)
        t0 = time.perf_counter()
        envs = warm_envs()  # a bad $JOYNEXUS_ENV_WARM is refused before anything else
        log.info("%s: starting (pid %d), warming %s", self.instance, os.getpid(), ", ".join(envs))
        health = await self.b.js.key_value(self.b.names.health_bucket)
        workloads = await self.b.js.key_value(self.b.names.workloads_bucket)
        await self._fail_own_orphans(health, workloads)
        warmed = await warm_up(self.instance, envs, self.pool)
        log.info("%s: ready in %.1f s", self.instance, time.perf_counter() - t0)
        await metrics.emit(
            self.b, "system", service=ENV_ROLE, ready=True, instance=self.instance,
            warm_s=warmed,
        )
        watch = asyncio.create_task(self._watch(health))
        stopper = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                self.changed.clear()
                key = self.assignment.workload
                if key:
                    await self._serve(key, workloads, stop)
                if stop.is_set():
                    break
                waiter = asyncio.create_task(self.changed.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            watch.cancel()
            stopper.cancel()
            await asyncio.gather(watch, stopper, return_exceptions=True)
            await self.pool.close()

    async def _serve(self, key: str, workloads: Any, stop: asyncio.Event) -> None:
        """Run the producer of workload ``key`` until the assignment changes, ``stop``,
        or the workload is done (reported, then wait for the next assignment)."""
        try:
            rec = decode((await workloads.get(key)).value, WorkloadRecord)
        except Exception as e:
            log.warning("%s: workload %s unreadable: %s", self.instance, key, e)
            return
        if rec.state != "active" or rec.spec.task_type != "rl":
            return
        spec = rec.spec
        local = asyncio.Event()

        async def relay() -> None:
            waiter = asyncio.create_task(self.changed.wait())
            stopper = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                stopper.cancel()
            local.set()

        relay_task = asyncio.create_task(relay())
        log.info("%s: rollouts of %s (%s)", self.instance, key, spec.env)
        try:
            producer = RLProducer(self.b, rec, instance=self.instance, own_orphans_only=True,
                                  pool=self.pool)
            if await producer.run(local, until_done=True):
                await metrics.emit(
                    self.b,
                    "system",
                    service=ENV_ROLE,
                    event="workload_done",
                    instance=self.instance,
                    workload=key,
                    # The envs it keeps built: the supervisor gives their next workload
                    # this worker first.
                    pooled=self.pool.names(),
                )
                log.info("%s: %s is done", self.instance, key)
        finally:
            await cancel_and_wait(relay_task)
