"""Role ``producer-rl``: the pool of environment worker processes, assigned to
the active RL workloads the service feeds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Any

import msgspec
import orjson

from joynexus.agents.envs.registry import env_kind
from joynexus.agents.envworkers.assign import (
    ENV_ROLE,
    MAX_WORKERS_ENV,
    RELEASE_GRACE_ENV,
    SPARES_ENV,
    Assignment,
    assignment_key,
    prefer_warmed,
    warm_envs,
    warm_for,
    worker_env,
    workers_wanted,
)
from joynexus.agents.producers import watch_workloads
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.jobs import TrainingJob
from joynexus.schemas.workloads import WorkloadRecord

log = logging.getLogger(__name__)


def _kind_of(rec: WorkloadRecord) -> str:
    """The simulator kind of an RL workload's env ("" if it names none we know)."""
    try:
        return env_kind(rec.spec.env)
    except JoyNexusError:
        return ""


class EnvSupervisor:
    """Role ``producer-rl``: a pool of environment worker processes, assigned to the
    active RL workloads the service feeds (``max_active_rollouts`` workers each)."""

    def __init__(
        self,
        broker: Broker,
        *,
        instance: str,
        url: str,
        data_dir: Any = None,
        heartbeat_s: float = 1.0,
        spares: int | None = None,
        max_workers: int | None = None,
        log_dir: Any = None,
        release_grace_s: float | None = None,
    ) -> None:
        self.b = broker
        self.instance = instance
        self.url = url
        self.data_dir = data_dir
        self.heartbeat_s = heartbeat_s
        self.spares = int(os.environ.get(SPARES_ENV, "1")) if spares is None else spares
        self.max_workers = max(
            1, int(os.environ.get(MAX_WORKERS_ENV, "8")) if max_workers is None else max_workers
        )
        self.log_dir = log_dir
        #: instance -> workload key ("" = standby).
        self.pool: dict[str, str] = {}
        self.warm: set[str] = set()
        #: The env each new worker warms, in turn ($JOYNEXUS_ENV_WARM), and the
        #: simulator kind each worker warmed (assignment prefers a match).
        self.warm_plan = warm_envs()
        self._spawned = 0
        self.warmed: dict[str, str] = {}
        #: The env names each worker keeps built (said with its ``workload_done``).
        self.pooled: dict[str, set[str]] = {}
        #: Active service RL workloads: key -> record.
        self.active: dict[str, WorkloadRecord] = {}
        self.done: set[str] = set()
        self._changed = asyncio.Event()
        self.sched = SchedulerClient(broker, by=instance)
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Pending :meth:`_release` sweeps (cancelled when this supervisor stops: the
        #: next incarnation fails what its workers left, see :meth:`reconcile`).
        self._releases: set[asyncio.Task[Any]] = set()
        #: Workloads whose jobs left by a previous incarnation's workers were failed.
        self._cleaned: set[str] = set()
        #: instance -> the last workload it served (kept while it stands by).
        self.served: dict[str, str] = {}
        #: Ended workloads first seen by this incarnation, swept one at a time.
        self._ended: asyncio.Queue[str] = asyncio.Queue()
        self._ended_seen: set[str] = set()
        self.release_grace_s = (
            float(os.environ.get(RELEASE_GRACE_ENV, "15"))
            if release_grace_s is None
            else release_grace_s
        )

    def _argv(self, inst: str) -> list[str]:
        argv = [
            sys.executable, "-m", "joynexus.ops.cli", "agent", ENV_ROLE,
            "--nats", self.url, "--namespace", self.b.names.namespace, "--instance", inst,
            "--heartbeat", str(self.heartbeat_s),
        ]
        if self.data_dir is not None:
            argv += ["--data-dir", str(self.data_dir)]
        return argv

    def _new_instance(self) -> str:
        k = 0
        while f"{self.instance}-w{k}" in self.pool:
            k += 1
        return f"{self.instance}-w{k}"

    async def _assign(self, inst: str, key: str) -> None:
        left = self.pool.get(inst, "")
        previous = self.served.get(inst, "")
        self.pool[inst] = key
        self.manager.details[inst] = key
        if key:
            self.served[inst] = key
        a = Assignment(
            workload=key,
            previous=previous if previous != key else "",
            supervisor=self.instance,
            at=time.time(),
        )
        await self.kv.put(assignment_key(inst), msgspec.json.encode(a))
        if left and left != key:
            self._background(self._release(inst, left), self._releases)

    def _background(self, coro: Any, tasks: set[asyncio.Task[Any]] | None = None) -> None:
        into = self._tasks if tasks is None else tasks
        t = asyncio.create_task(coro)
        into.add(t)
        t.add_done_callback(into.discard)

    async def _release(self, inst: str, key: str) -> None:
        """A worker taken off workload ``key`` (cancelled, done, or its share shrank)
        fails its own rollout's job at its next policy call; whatever job of ``key``
        it still holds after the grace (it was killed, restarted with its new
        assignment, or hangs) is failed here, so a cancel ends every job in a bound."""
        await asyncio.sleep(self.release_grace_s)
        if self.pool.get(inst) == key:
            return  # serving it again (its jobs are live)
        await self._fail_jobs_retrying({inst}, [key])

    async def _sweep_ended(self) -> None:
        """Jobs a previous incarnation's workers left in workloads that ended since."""
        while True:
            key = await self._ended.get()
            if key not in self.active:  # made again meanwhile: reconcile cleans it first
                await self._fail_jobs_retrying(None, [key])

    async def _fail_jobs_retrying(
        self, instances: set[str] | None, keys: list[str], *, tries: int = 10
    ) -> None:
        """:meth:`_fail_jobs_of` until the scheduler answered for every job (it may be
        restarting), at most ``tries`` times."""
        for i in range(tries):
            if await self._fail_jobs_of(instances, keys):
                return
            await asyncio.sleep(min(1.0 * 2**i, 10.0))
        log.warning("%s: jobs of %s in %s may stay open", self.instance, instances, keys)

    async def _spawn(self, key: str) -> str:
        from joynexus.agents.health import RoleSlot

        inst = self._new_instance()
        warm = warm_for(self._spawned, self.warm_plan)
        self._spawned += 1
        self.warmed[inst] = env_kind(warm)
        await self._assign(inst, key)  # before it starts: it reads it once warm
        self.manager.add_slot(
            RoleSlot(role=ENV_ROLE, instance=inst, argv=self._argv(inst), env=worker_env(warm))
        )
        return inst

    def _remove(self, inst: str) -> None:
        # A worker on standby has key "": what it served last is where its jobs are
        # (a worker taken off a cancelled workload, then stopped as a spare too many).
        keys = [k for k in dict.fromkeys((self.pool.pop(inst, ""), self.served.pop(inst, ""))) if k]
        self.warm.discard(inst)
        self.warmed.pop(inst, None)
        self.pooled.pop(inst, None)

        async def gone() -> None:
            await self.manager.remove_slot(inst)  # returns once the process is gone
            with contextlib.suppress(Exception):
                await self.kv.delete(assignment_key(inst))
            if keys:
                await self._fail_jobs_retrying({inst}, keys)

        self._background(gone())

    async def _fail_jobs_of(self, instances: set[str] | None, keys: list[str]) -> bool:
        """Fail jobs left reserved/producing by these workers (None: by any of ours);
        False if the scheduler did not answer for some of them."""

        def ours(job: TrainingJob) -> bool:
            who = job.metadata.extra.get("producer", "")
            return who.startswith(f"{self.instance}-w") if instances is None else who in instances

        answered = True
        for key in keys:
            tenant, _, name = key.partition(".")
            try:
                await self.sched.fail_open(
                    tenant, name, "environment worker stopped mid-rollout", owned=ours
                )
            except JoyNexusError as e:  # the rest of this key is failed on the next try
                log.warning("%s: cannot fail the jobs of %s: %s", self.instance, key, e)
                answered = False
        return answered

    async def reconcile(self) -> None:
        """Workers to the workloads that want them, the rest to standby; spares kept."""
        active = dict(self.active)  # the watcher changes it while this awaits
        wanted = {k: workers_wanted(r) for k, r in active.items() if k not in self.done}
        for key in wanted:
            if key not in self._cleaned:  # first seen by this incarnation: before any worker
                await self._fail_jobs_of(None, [key])
                self._cleaned.add(key)
        for inst, key in list(self.pool.items()):
            if key and key not in wanted:
                await self._assign(inst, "")
        order = sorted(wanted, key=lambda k: (active[k].created_at, k))
        for key in order:
            have = [i for i, k in self.pool.items() if k == key]
            for inst in have[wanted[key]:]:
                await self._assign(inst, "")
            need = wanted[key] - len(have)
            idle = prefer_warmed([i for i, k in self.pool.items() if not k],
                                 _kind_of(active[key]), self.warmed, self.warm,
                                 env=active[key].spec.env, pooled=self.pooled)
            for inst in idle[:need]:
                await self._assign(inst, key)
                need -= 1
            while need > 0 and len(self.pool) < self.max_workers:
                await self._spawn(key)
                need -= 1
        idle = [i for i, k in self.pool.items() if not k]
        while len(idle) < self.spares and len(self.pool) < self.max_workers:
            idle.append(await self._spawn(""))
        # Spares beyond the target: stop the cold ones first.
        extra = sorted(idle, key=lambda i: (i in self.warm, i))[: max(0, len(idle) - self.spares)]
        for inst in extra:
            self._remove(inst)

    async def _on_metric(self, msg: Any) -> None:
        with contextlib.suppress(Exception):
            m = orjson.loads(msg.data)
            if m.get("service") != ENV_ROLE or m.get("instance") not in self.pool:
                return
            if m.get("ready"):  # a (re)started worker: it keeps no env built yet
                self.warm.add(m["instance"])
                self.pooled.pop(m["instance"], None)
                self._changed.set()
            elif m.get("event") == "workload_done" and m.get("workload") in self.active:
                self.pooled[m["instance"]] = {str(n) for n in m.get("pooled") or ()}
                self.done.add(m["workload"])
                self._changed.set()

    async def _watch(self, stop: asyncio.Event) -> None:
        async for key, rec in watch_workloads(self.b, stop):
            if rec.spec.task_type != "rl" or rec.spec.source != "service":
                continue
            if rec.state == "active":
                if key not in self.active or self.active[key].created_at != rec.created_at:
                    self.done.discard(key)
                self.active[key] = rec
            else:
                if key not in self.active and key not in self._ended_seen:
                    # Ended while no incarnation of ours watched it (this supervisor was
                    # being restarted): our previous workers are gone, fail what they left.
                    self._ended_seen.add(key)
                    self._ended.put_nowait(key)
                self.active.pop(key, None)
                self.done.discard(key)
            self._changed.set()

    async def run(self, stop: asyncio.Event) -> None:
        from joynexus.agents.health import HealthCore, HealthManager

        self.kv = await self.b.js.key_value(self.b.names.health_bucket)
        self.manager = HealthManager(
            self.b,
            instance=self.instance,
            # A worker's renderer start and simulator steps hold the GIL for long
            # stretches on a loaded machine: a runnable worker gets 2 minutes before
            # late beats count as death (an exit or a SIGSTOP is seen at once).
            core=HealthCore(heartbeat_s=self.heartbeat_s, busy_miss_s=120.0),
            log_dir=self.log_dir,
            kill_grace_s=3.0,  # within the launcher's grace for this process
            mode="supervise",
            watch_keys=f"hb.{ENV_ROLE}.>",
            owned_only=True,
        )
        sub = await self.b.nc.subscribe(self.b.names.metrics("system"), cb=self._on_metric)
        mgr_stop = asyncio.Event()
        manager = asyncio.create_task(self.manager.run(mgr_stop))
        watch = asyncio.create_task(self._watch(stop))
        sweeper = asyncio.create_task(self._sweep_ended())
        announced = False
        try:
            while not stop.is_set():
                await self.reconcile()
                idle_warm = [i for i, k in self.pool.items() if not k and i in self.warm]
                if not announced and len(idle_warm) >= min(self.spares, self.max_workers):
                    announced = True  # warm spares: the deployment can take RL workloads
                    await metrics.emit(
                        self.b, "system", service="producer-rl", ready=True,
                        instance=self.instance, env_workers=len(self.pool),
                    )
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), 1.0)
                if manager.done():
                    await manager  # raise what stopped it
                    raise JoyNexusError("the environment workers' manager stopped")
        finally:
            watch.cancel()
            sweeper.cancel()
            for t in list(self._releases):
                t.cancel()
            with contextlib.suppress(BaseException):
                await sub.unsubscribe()
            mgr_stop.set()
            await asyncio.gather(
                manager, watch, sweeper, *self._tasks, *self._releases, return_exceptions=True
            )
            for inst in list(self.pool):
                with contextlib.suppress(Exception):
                    await self.kv.delete(assignment_key(inst))
