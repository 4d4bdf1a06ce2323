"""Environment workers: each RL workload's rollouts in processes of their own.

A ManiSkill step holds the GIL for its whole duration, so rollouts of
different tenants in one process run one after another. Here every RL
workload the service feeds gets worker processes of its own (as many as its
``scheduling.max_active_rollouts``), and their simulators run at the same
time.

* :class:`EnvSupervisor` is role ``producer-rl``. It owns a pool of worker
  processes (``joynexus agent env-worker --instance <sup>-w<k>``) under its own
  :class:`~joynexus.agents.health.HealthManager` (supervise mode, slots that
  come and go, heartbeats ``hb.env-worker.<instance>``): a worker that exits,
  stops beating or freezes is restarted in place, same instance, same
  arguments. It keeps ``spares`` warm idle workers (a worker's first rgb env
  starts the CPU renderer, 15-30 s here), hands them to workloads as they
  become active, takes them back when a workload is cancelled or done, and
  stops spares beyond the target. Its view (every slot with its workload) is
  ``mgr.<sup>`` in the health bucket, which ``joynexus status`` shows.
* The assignment of a worker is durable: key ``env.<instance>`` of the health
  bucket (:class:`Assignment`, written only by the supervisor). A restarted
  worker reads it and resumes the same workload.
* :class:`EnvWorker` is role ``env-worker``: warm up, announce ``ready``
  (a ``system`` metric, ``service="env-worker"``), then run an
  :class:`RLProducer` for whatever its assignment names; it reports a workload
  ``done`` when the scheduler refuses for the completion target and that many
  jobs completed. Every rollout is a busy interval (``service="env"``), the
  lanes of the main job's utilization plot.
* Jobs carry their producer (``metadata.extra["producer"]``): a restarted
  worker fails only the jobs its previous incarnation left reserved or
  producing (they hold admission slots), the supervisor fails those of a
  worker it removed and, when it starts, those of any worker of its previous
  incarnation. So a worker SIGKILLed mid-rollout loses no job (the job is
  failed, terminal) and none is trained twice (its data never reached
  ``needs_advantages``).

A cancelled workload's jobs all end in a bound: a worker taken off it fails its
rollout's job even inside a policy call that waits on a down engine; the
supervisor fails what a stopped worker left in the workload it *served*, and what
a standby worker still holds after ``JOYNEXUS_ENV_RELEASE_S``.

Knobs (environment): ``JOYNEXUS_ENV_SPARES`` (warm idle workers, default 1),
``JOYNEXUS_ENV_WORKERS_MAX`` (worker processes at most, default 8),
``JOYNEXUS_ENV_THREADS`` (compute threads per worker, default 1),
``JOYNEXUS_ENV_RELEASE_S`` (that grace, default 15 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Any

import msgspec
import numpy as np
import orjson
from opentelemetry import trace

from joynexus.agents.models.policyio import PolicyStore
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.agents.workloads import (
    EXPLORATION_STD,
    chunk_targets,
    decision_lengths,
    watch_workloads,
    workload_schema,
)
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.base import decode
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.jobs import JobMetadata, JobState, TrainingJob
from joynexus.schemas.samples import (
    ACTIONS_FIELD,
    CHUNK_STEP_FIELD,
    DECISION_FIELD,
    DONES_FIELD,
    ENV_ID_FIELD,
    EPISODE_INDEX_FIELD,
    EXECUTED_ACTION_FIELD,
    FRAME_INDEX_FIELD,
    OBS_IMAGES,
    OBS_STATE,
    REWARDS_FIELD,
    STATE_FIELD,
    STEP_FIELD,
    SUCCESS_FIELD,
)
from joynexus.schemas.workloads import WorkloadRecord

log = logging.getLogger(__name__)

ENV_ROLE = "env-worker"
#: Key prefix of the assignments in the health bucket: ``env.<instance>``.
ASSIGN_PREFIX = "env."
SPARES_ENV = "JOYNEXUS_ENV_SPARES"
MAX_WORKERS_ENV = "JOYNEXUS_ENV_WORKERS_MAX"
#: Seconds a worker taken off a workload has to end its own rollout before its
#: supervisor fails whatever job of that workload it still holds.
RELEASE_GRACE_ENV = "JOYNEXUS_ENV_RELEASE_S"


THREADS_ENV = "JOYNEXUS_ENV_THREADS"


def worker_env() -> dict[str, str]:
    """A worker's compute threads (default 1): several workers share the cores, and
    a simulator step gains little from intra-op threads while oversubscribed
    threads cost every process on the machine."""
    n = os.environ.get(THREADS_ENV, "1")
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, THREADS_ENV: n}


def assignment_key(instance: str) -> str:
    return f"{ASSIGN_PREFIX}{instance}"


class Assignment(msgspec.Struct, kw_only=True):
    """What one worker runs (value of ``env.<instance>``; the supervisor writes it)."""

    #: ``<tenant>.<workload>`` (a key of the workloads bucket); "" = standby.
    workload: str = ""
    #: The workload it served before this one (a restarted worker fails its orphans
    #: there too: a worker killed just after being taken off a cancelled workload).
    previous: str = ""
    supervisor: str = ""
    at: float = 0.0


def _workers_wanted(rec: WorkloadRecord) -> int:
    return max(1, int(rec.spec.scheduling.max_active_rollouts))


# ---------------------------------------------------------------- the producer


class _Stopped(Exception):
    """Raised at the policy call of a rollout whose producer was told to stop."""


#: Wait between refused reserves: from the first, doubling to the last (seconds).
RESERVE_BACKOFF_S = (0.05, 1.0)


def next_backoff(wait_s: float) -> float:
    """The wait after another refused reserve."""
    return min(wait_s * 2, RESERVE_BACKOFF_S[1])


def asks_if_done(until_done: bool, refusal: str) -> bool:
    """Does a refused reserve call for the completion check (the scheduler refused
    for the workload's completion target, and the caller stops once it is met)?"""
    return until_done and "completion target" in refusal


def after_rollout(job: TrainingJob) -> JobState:
    """Where a job goes once its rows are on the Training Queue: through the
    actor_forward stage when its route says so, else to the advantage stage."""
    if job.metadata.extra.get("actor_forward") == "1":
        return JobState.NEEDS_ACTOR_FORWARD
    return JobState.NEEDS_ADVANTAGES


class RLProducer:
    """One RL workload's rollouts: reserve (recording the behaviour version first),
    roll out in ManiSkill with actions from the Inference Queue pinned to that
    version plus Gaussian exploration, put num_envs x horizon samples into the
    partition, mark needs_advantages.

    ``own_orphans_only`` (an environment worker, one of several for a workload):
    on start fail only the jobs this instance left behind; otherwise every job of
    the workload still reserved or producing (one producer per workload)."""

    def __init__(
        self,
        broker: Broker,
        record: WorkloadRecord,
        *,
        instance: str,
        own_orphans_only: bool = False,
        env: Any = None,
    ) -> None:
        from joynexus.agents.inference import InferenceClient

        self.b = broker
        self.rec = record
        self.spec = record.spec
        self.tenant = record.tenant_id
        self.instance = instance
        self.own_orphans_only = own_orphans_only
        self.sched = SchedulerClient(broker, by=instance)
        self.tq = TrainingQueue(broker)
        self.policies = PolicyStore(broker)
        # A restarted engine (health manager) is waited for instead of failing the rollout.
        self.infer = InferenceClient(
            broker, base_model=self.spec.base_model, timeout_s=15.0, retry_for_s=90.0
        )
        # Workers of one workload explore differently (the seed includes the instance).
        self.seed_salt = sum(instance.encode()) % 997 if own_orphans_only else 0
        self.rng = np.random.default_rng(self.spec.seed * 7919 + self.seed_salt)
        self.rollouts = 0
        self.env = env
        self.done = False
        from joynexus.agents.actor_forward import gaussian_head

        # A Gaussian head samples from its own std (floored at exploration_std); with
        # GAE its jobs go through actor_forward (behaviour log-probs, critic values).
        self.gaussian = gaussian_head(self.spec.action_module)
        self._std: tuple[int, np.ndarray] | None = None  # (version, std [A] in action units)
        self._stage_seen = False

    async def run(self, stop: asyncio.Event, *, until_done: bool = False) -> bool:
        """Produce until ``stop``; with ``until_done`` return True once the workload's
        completion target is reached and that many jobs completed."""
        schema, instruction = await asyncio.to_thread(workload_schema, self.spec)
        await self._fail_orphans()
        own_env = self.env is None
        env = self.env or await self._make_env(schema)
        backoff = RESERVE_BACKOFF_S[0]
        try:
            while not stop.is_set():
                version = (await self.policies.latest(self.tenant, self.spec.name)).version
                span, job = await self._reserve(schema, instruction, version)
                if job is None:
                    span.end()
                    if asks_if_done(until_done, self.sched.last_refusal):
                        if await self._target_completed():
                            self.done = True
                            return True
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), backoff)
                    backoff = next_backoff(backoff)
                    continue
                backoff = RESERVE_BACKOFF_S[0]
                with trace.use_span(span, end_on_exit=True):
                    span.set_attribute("job_id", job.job_id)
                    if not await self._produce(job, env, schema, instruction, version, stop):
                        break
        finally:
            if own_env:
                await asyncio.to_thread(env.close)
        return False

    async def _make_env(self, schema: Any) -> Any:
        from joynexus.agents.envs.registry import make_env

        return await asyncio.to_thread(
            make_env,
            self.spec.env,
            obs="rgb",
            num_envs=self.spec.num_envs,
            image_size=self.spec.image_size,
            seed=self.spec.seed,
            # The observation the workload's policy takes (its schema), as evaluation does.
            cameras=schema.camera_slots,
            state_keys=getattr(schema, "state_keys", ()) or self.spec.state or None,
        )

    async def _reserve(
        self, schema: Any, instruction: str, version: int
    ) -> tuple[trace.Span, TrainingJob | None]:
        """A job for one rollout of ``version`` (None: refused), with its trace's root
        span (the caller ends it)."""
        span, traceparent = tracing.start_job_trace(
            "rl.job", tenant=self.tenant, workload=self.spec.name, behavior_version=version
        )
        with trace.use_span(span, end_on_exit=False):
            job = await self.sched.reserve(
                self.tenant,
                "rl",
                policy_key=self.spec.name,
                domain=self.spec.env,
                sample_count=self.spec.num_envs * self.spec.horizon,
                behavior_policy_version=version,
                metadata=JobMetadata(
                    schema_signature=schema.signature(),
                    extra={
                        "instruction": instruction,
                        "advantage": self.spec.advantage,
                        "traceparent": traceparent,
                        "producer": self.instance,
                        **await self._route_extra(),
                    },
                ),
            )
        return span, job

    async def _produce(
        self,
        job: TrainingJob,
        env: Any,
        schema: Any,
        instruction: str,
        version: int,
        stop: asyncio.Event,
    ) -> bool:
        """Roll out for ``job``, put its rows, hand it on; False once stopped mid-rollout
        (the job failed). A tenant-caused error fails this job only."""
        await self.sched.mark(job.job_id, JobState.PRODUCING)
        try:
            t0 = time.time()
            try:
                data = await self._rollout(env, schema, instruction, version, stop)
            except _Stopped:  # between two steps: no simulator step runs now
                await self.sched.fail(job.job_id, "producer stopped mid-rollout")
                return False
            rows = len(data[STATE_FIELD])
            await metrics.busy(
                self.b,
                "env",
                t0,
                time.time(),
                instance=self.instance,
                workload=self.spec.name,
                tenant=self.tenant,
                steps=rows,
            )
            await self.tq.async_put(data, tenant_id=self.tenant, partition_id=job.partition_id)
            await self.sched.mark(job.job_id, after_rollout(job), sample_count=rows)
        except JoyNexusError as e:
            await self.sched.fail(job.job_id, f"rl producer: {type(e).__name__}: {e}")
        return True

    async def _route_extra(self) -> dict[str, str]:
        """Job metadata of the route: through actor_forward when the head is Gaussian,
        the advantage is GAE and the deployment runs that stage (its durable consumer
        exists; jobs then wait in it across worker restarts)."""
        extra: dict[str, str] = {}
        if self.spec.exploration_std is not None:
            extra["exploration_std"] = repr(float(self.spec.exploration_std))
        extra["learning_rate"] = repr(float(self.spec.learning_rate))
        extra["gamma"] = repr(float(self.spec.gamma))
        extra["gae_lambda"] = repr(float(self.spec.gae_lambda))
        if not (self.gaussian and self.spec.advantage == "gae"):
            return extra
        if not self._stage_seen:
            n = self.b.names
            try:
                await self.b.js.consumer_info(n.jobs_stream, n.stage_consumer("actor_forward"))
                self._stage_seen = True
            except Exception:  # no such consumer: a deployment without the stage (AWR)
                return extra
        return {
            **extra,
            "actor_forward": "1",
            # Rows carry DECISION_FIELD: the policy's samples are the decisions only.
            "decisions": "1",
            "critic_warmup": str(self.spec.warmup_updates()),
            "target_kl": repr(float(self.spec.target_kl)),
        }

    async def _policy_std(self, version: int) -> np.ndarray:
        """The behaviour version's std per action dimension (env units, floored)."""
        if self._std is None or self._std[0] != version:
            rec = await self.policies.get(self.tenant, self.spec.name, version)
            module = await self.policies.load_module(rec)
            head: Any = module.head
            floor = float(self.spec.exploration_std or 0.0)
            self._std = (version, head.action_std_A(floor).detach().cpu().numpy().astype(np.float32))
        return self._std[1]

    async def _target_completed(self) -> bool:
        target = self.spec.scheduling.completion_target
        if target is None:
            return False
        done = await self.sched.list_jobs(
            self.tenant, policy_key=self.spec.name, states=[JobState.COMPLETED]
        )
        return len(done) >= target

    async def _fail_orphans(self) -> None:
        """Jobs a previous incarnation reserved but never finished producing."""
        for job in await self.sched.list_jobs(
            self.tenant, policy_key=self.spec.name, states=[JobState.RESERVED, JobState.PRODUCING]
        ):
            if self.own_orphans_only and job.metadata.extra.get("producer") != self.instance:
                continue
            await self.sched.fail(job.job_id, "producer restarted before the rollout finished")

    async def _rollout(
        self, env: Any, schema: Any, instruction: str, version: int, stop: asyncio.Event
    ) -> dict[str, np.ndarray]:
        from joynexus.agents.envs.maniskill import rollout

        async def act(obs: dict[str, Any]) -> np.ndarray:
            if stop.is_set():
                raise _Stopped
            # A stop (the workload cancelled, the worker taken off it) does not wait for
            # an engine that is down: the request retries for up to retry_for_s.
            chunk_N_H_A = await _unless_stopped(
                self.infer.act(
                    self.tenant,
                    schema=schema,
                    policy_key=self.spec.name,
                    policy_version=version,
                    images={c: obs[f"{OBS_IMAGES}.{c}"] for c in schema.camera_slots},
                    instruction=instruction,
                    state=obs[OBS_STATE],
                ),
                stop,
            )
            if self.gaussian:  # the policy's own distribution: N(mean chunk, its std)
                std: Any = await self._policy_std(version)
            else:
                std = EXPLORATION_STD if self.spec.exploration_std is None else self.spec.exploration_std
            noise = self.rng.normal(0.0, 1.0, chunk_N_H_A.shape).astype(np.float32) * std
            return np.clip(chunk_N_H_A + noise, -1.0, 1.0)

        seed = self.spec.seed * 100_003 + self.rollouts + self.seed_salt * 1_000_000
        out = await rollout(env, act, horizon=self.spec.horizon, seed=seed)
        self.rollouts += 1
        await metrics.emit(
            self.b,
            "learning",
            self.tenant,
            workload=self.spec.name,
            rollout_success=float(out[SUCCESS_FIELD].mean()),
            # episodes that ended in the rollout, and how many of them succeeded
            episodes_ended=int(out[DONES_FIELD].sum()),
            episodes_succeeded=int((out[SUCCESS_FIELD] & out[DONES_FIELD]).sum()),
            behavior_version=version,
            mean_reward=float(out[REWARDS_FIELD].mean()),
        )
        # Learn the chunk of actions executed from each step on (the head predicts
        # chunks): the executed action [M, A] becomes the chunk [M, H, A] and is not
        # put itself (one name, one shape: schemas/samples.py's FIELDS).
        out[ACTIONS_FIELD] = chunk_targets(
            out.pop(EXECUTED_ACTION_FIELD),
            out[ENV_ID_FIELD],
            out[EPISODE_INDEX_FIELD],
            out[FRAME_INDEX_FIELD],
            schema.action_horizon,
        )
        # Where the policy decided, and how much of its chunk ran (the PPO sample).
        out[DECISION_FIELD] = decision_lengths(
            out[CHUNK_STEP_FIELD], out[ENV_ID_FIELD], out[STEP_FIELD]
        )
        return out


async def _unless_stopped(aw: Any, stop: asyncio.Event) -> Any:
    """``await aw``, or raise :class:`_Stopped` (cancelling it) as soon as ``stop`` is set."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this rollout itself is cancelled
        task.cancel()
        stopper.cancel()
        raise
    stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    raise _Stopped


# ---------------------------------------------------------------- the worker


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


async def warm_up() -> None:
    """Start the CPU renderer (the first rgb env of a process: 15-30 s here)."""
    from joynexus.agents.envs.maniskill import make_env

    env = await asyncio.to_thread(make_env, "PickCube-v1", obs="rgb", num_envs=1, image_size=64)
    await asyncio.to_thread(env.reset, 0)
    await asyncio.to_thread(env.close)


class EnvWorker:
    """Role ``env-worker``: rollouts of the workload its assignment names."""

    def __init__(self, broker: Broker, *, instance: str) -> None:
        self.b = broker
        self.instance = instance
        self.assignment = Assignment()
        self.changed = asyncio.Event()

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
        health = await self.b.js.key_value(self.b.names.health_bucket)
        workloads = await self.b.js.key_value(self.b.names.workloads_bucket)
        await self._fail_own_orphans(health, workloads)
        await warm_up()
        await metrics.emit(
            self.b, "system", service=ENV_ROLE, ready=True, instance=self.instance
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
            producer = RLProducer(self.b, rec, instance=self.instance, own_orphans_only=True)
            if await producer.run(local, until_done=True):
                await metrics.emit(
                    self.b,
                    "system",
                    service=ENV_ROLE,
                    event="workload_done",
                    instance=self.instance,
                    workload=key,
                )
                log.info("%s: %s is done", self.instance, key)
        finally:
            relay_task.cancel()
            with contextlib.suppress(BaseException):
                await relay_task


# ---------------------------------------------------------------- the supervisor


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
        await self._assign(inst, key)  # before it starts: it reads it once warm
        self.manager.add_slot(
            RoleSlot(role=ENV_ROLE, instance=inst, argv=self._argv(inst), env=worker_env())
        )
        return inst

    def _remove(self, inst: str) -> None:
        # A worker on standby has key "": what it served last is where its jobs are
        # (a worker taken off a cancelled workload, then stopped as a spare too many).
        keys = [k for k in dict.fromkeys((self.pool.pop(inst, ""), self.served.pop(inst, ""))) if k]
        self.warm.discard(inst)

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
        from joynexus.schemas.errors import IllegalTransition, UnknownJob

        answered = True
        for key in keys:
            tenant, _, name = key.partition(".")
            try:
                jobs = await self.sched.list_jobs(
                    tenant, policy_key=name, states=[JobState.RESERVED, JobState.PRODUCING]
                )
            except JoyNexusError as e:
                log.warning("%s: cannot list %s: %s", self.instance, key, e)
                answered = False
                continue
            for job in jobs:
                who = job.metadata.extra.get("producer", "")
                ours = who.startswith(f"{self.instance}-w") if instances is None else who in instances
                if not ours:
                    continue
                try:
                    await self.sched.fail(job.job_id, "environment worker stopped mid-rollout")
                except (IllegalTransition, UnknownJob):
                    pass  # ended meanwhile (by its worker): terminal either way
                except JoyNexusError as e:
                    log.warning("%s: cannot fail %s: %s", self.instance, job.job_id, e)
                    answered = False
        return answered

    async def reconcile(self) -> None:
        """Workers to the workloads that want them, the rest to standby; spares kept."""
        active = dict(self.active)  # the watcher changes it while this awaits
        wanted = {k: _workers_wanted(r) for k, r in active.items() if k not in self.done}
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
            idle = sorted((i for i, k in self.pool.items() if not k), key=lambda i: i not in self.warm)
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
            if m.get("ready"):
                self.warm.add(m["instance"])
                self._changed.set()
            elif m.get("event") == "workload_done" and m.get("workload") in self.active:
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


__all__ = [
    "ASSIGN_PREFIX",
    "ENV_ROLE",
    "Assignment",
    "EnvSupervisor",
    "EnvWorker",
    "RLProducer",
    "assignment_key",
]
