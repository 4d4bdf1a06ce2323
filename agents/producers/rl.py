"""One RL workload's rollouts (:class:`RLProducer`) and the pure decisions its
loop runs around (``next_backoff``, ``ends_run``, ``after_rollout``)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
from opentelemetry import trace

from joynexus.agents.actions import sample_around
from joynexus.agents.envs.pool import EnvPool, build_key, close_env
from joynexus.agents.models.policyio import PolicyStore
from joynexus.agents.producers.schema import (
    EXPLORATION_STD,
    chunk_targets,
    decision_lengths,
    workload_schema,
)
from joynexus.agents.scheduler_client import Backoff, SchedulerClient, reserve_until_admitted
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
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


class _Stopped(Exception):
    """Raised at the policy call of a rollout whose producer was told to stop."""


#: Waits between refused reserves: the default, 50 ms doubling to 1 s (the planner's
#: simulation, ``ops/plan/sim.py``, waits the same).
BACKOFF = Backoff()


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
        pool: EnvPool | None = None,
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
        #: The worker's idle envs: this workload's build is taken from it and given
        #: back when the workload ends cleanly (None: built here, closed at the end).
        self.pool = pool
        self.done = False
        from joynexus.agents.actor.forward import gaussian_head

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
        build = self._build_args(schema)
        key = build_key(**{k: v for k, v in build.items() if k != "seed"})
        env = self.env
        if env is None and self.pool is not None:
            env = self.pool.take(key)
            if env is not None:
                log.info("%s: %s/%s: %s reused from this worker's idle envs", self.instance,
                         self.tenant, self.spec.name, self.spec.env)
        if env is None:
            if self.pool is not None and await self.pool.evict(self.spec.env):
                log.info("%s: %s/%s: closed this worker's idle %s of another build",
                         self.instance, self.tenant, self.spec.name, self.spec.env)
            t0 = time.perf_counter()
            env = await self._make_env(schema)
            log.info("%s: %s/%s: %s built in %.1f s", self.instance, self.tenant,
                     self.spec.name, self.spec.env, time.perf_counter() - t0)
        broken = False
        try:
            return await self._loop(env, schema, instruction, stop, until_done)
        except BaseException:
            broken = True
            raise
        finally:
            if own_env:
                if self.pool is not None and not broken:
                    await self.pool.give(key, env)
                else:
                    await close_env(env)

    async def _loop(
        self, env: Any, schema: Any, instruction: str, stop: asyncio.Event, until_done: bool
    ) -> bool:
        async def attempt() -> tuple[Any, TrainingJob, int] | None:
            version = (await self.policies.latest(self.tenant, self.spec.name)).version
            span, job = await self._reserve(schema, instruction, version)
            if job is None:
                span.end()
                return None
            return span, job, version

        while True:
            admitted = await reserve_until_admitted(
                self.sched, attempt, stop, backoff=BACKOFF, until_done=until_done,
                who=f"{self.instance}: {self.tenant}/{self.spec.name}",
            )
            if admitted is None:
                if stop.is_set():
                    return False
                self.done = True  # the workload's generation ended: nothing more to make
                return True
            span, job, version = admitted
            with trace.use_span(span, end_on_exit=True):
                span.set_attribute("job_id", job.job_id)
                if not await self._produce(job, env, schema, instruction, version, stop):
                    break
        return False

    def _build_args(self, schema: Any) -> dict[str, Any]:
        """The ``make_env`` arguments of this workload's envs."""
        return dict(
            name=self.spec.env,
            obs="rgb",
            num_envs=self.spec.num_envs,
            image_size=self.spec.image_size,
            seed=self.spec.seed,
            # The observation the workload's policy takes (its schema), as evaluation does.
            cameras=schema.camera_slots,
            state_keys=getattr(schema, "state_keys", ()) or self.spec.state or None,
        )

    async def _make_env(self, schema: Any) -> Any:
        from joynexus.agents.envs.registry import make_env

        args = self._build_args(schema)
        return await asyncio.to_thread(make_env, args.pop("name"), **args)

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
                workload=self.spec.name,
                generation=self.rec.generation,
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
        log.info("%s: %s/%s: rollout of job %s (version %d) begins", self.instance,
                 self.tenant, self.spec.name, job.job_id, version)
        try:
            t0 = time.time()
            try:
                data = await self._rollout(env, schema, instruction, version, stop)
            except _Stopped:  # between two steps: no simulator step runs now
                await self.sched.fail(job.job_id, "producer stopped mid-rollout")
                return False
            rows = len(data[STATE_FIELD])
            log.info("%s: %s/%s: rollout of job %s (version %d) done: %d steps in %.2f s",
                     self.instance, self.tenant, self.spec.name, job.job_id, version, rows,
                     time.time() - t0)
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
            floor = float(self.spec.exploration_std or 0.0)
            self._std = (version, await self.policies.action_std(rec, floor))
        return self._std[1]

    async def _fail_orphans(self) -> None:
        """Jobs a previous incarnation reserved but never finished producing."""
        await self.sched.fail_open(
            self.tenant,
            self.spec.name,
            "producer restarted before the rollout finished",
            generation=self.rec.generation,
            owned=lambda job: (
                not self.own_orphans_only or job.metadata.extra.get("producer") == self.instance
            ),
        )

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
                    workload=self.spec.name,
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
            return sample_around(chunk_N_H_A, std, self.rng)

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
