"""The actor: the one consumer of RL and SFT jobs, and the only trainer.

It leases ready jobs from the scheduler (priority, RL before SFT, FIFO),
groups jobs of different tenants whose inputs share the backbone, runs ONE
frozen backbone forward for the group and then each tenant's own loss,
backward and optimizer step (``agents.models.grouped``). Only the job's
tenant's action module steps and only its version increments.

Exactly-once steps: after a step the tenant's checkpoint (module, optimizer,
version, the jobs it has applied) is committed to JetStream
(``broker.trainerstate``: bytes to the checkpoints object store, then a
compare-and-set of its record in the trainer KV, the commit point), cached
under ``<out>/<tenant>/<workload>/`` with a manifest, then the version is
published (weights to the object store, record to the policy KV), then the
job is completed. A restart - on this host or any other - reloads the
checkpoint from JetStream; a job it already applied (crash after the step,
before complete) is completed with the version it produced, without a
second step. An actor whose commit is refused (another committed this
tenant since it loaded) drops its copy and leaves the job to be retried.

SFT targets are the demonstrated action chunks. RL on a head with a
tractable likelihood (a Gaussian policy, ``oft_mlp``) whose job went through
the ``actor_forward`` stage is PPO: the clipped probability ratio of the taken
chunks against the behaviour log-probabilities that stage wrote, times the
advantages, plus the critic's loss to the returns (``TenantModule.stage_ppo``).
Other RL jobs (flow matching: no tractable likelihood; jobs without behaviour
log-probabilities) use advantage-weighted regression (AWR) on the executed
chunks: weights exp(A/beta) from the advantages the advantage stage wrote.

The loop here is named steps (lease, load a group, the grouped step, the busy
metric, each tenant's commit) around the pure decisions of
:mod:`.decisions` (which jobs form a group, which fields a step reads,
what a failure does: all-or-nothing per tenant); the tensors of a tenant's step
are built in :mod:`.batch`. See docs/ARCHITECTURE.md ("Workloads, from
the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace

from joynexus.agents.actor.batch import StepKnobs, train_item
from joynexus.agents.actor.calls import CallLog
from joynexus.agents.actor.custom import DEFER_POLL_S, CallTodo, CustomCalls, compute_call
from joynexus.agents.actor.decisions import (
    fields_to_read,
    form_group,
    is_ppo,
    load_failure,
    remember_applied,
    step_outcomes,
    tenant_rows,
)
from joynexus.agents.actor.forward import (
    OLD_LOGP_FIELD,
    extra_number,
    uses_actor_forward,
    uses_decisions,
)
from joynexus.agents.actor.state import TenantState
from joynexus.agents.leases import keep_leases
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.grouped import (
    TrainItem,
    isolated_train_step,
    plan_groups,
    shared_features,
)
from joynexus.agents.models.policyio import PolicyStore, feature_schema_of
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.broker.trainercalls import CallStore
from joynexus.broker.trainerstate import TrainerStateStore
from joynexus.schemas.errors import Conflict, InvalidSpec, JoyNexusError, StaleLease
from joynexus.schemas.jobs import TrainingJob

log = logging.getLogger(__name__)


#: A job of a group step: the job, its tenant's state, the item it trains on.
Todo = tuple[TrainingJob, TenantState, TrainItem]


class Actor(CustomCalls):
    def __init__(
        self,
        broker: Broker,
        backbone: Backbone,
        *,
        instance: str,
        out_dir: str | Path,
        max_group: int = 4,
        awr_beta: float = 1.0,
        lease_wait_s: float = 1.0,
        ppo_clip: float = 0.2,
        vf_coef: float = 0.5,
        ent_coef: float = 0.0,
        ppo_epochs: int = 1,
    ) -> None:
        self.b = broker
        self.backbone = backbone
        self.instance = instance
        self.out_dir = Path(out_dir)
        self.max_group = max_group
        self.awr_beta = awr_beta
        self.ppo_clip, self.vf_coef, self.ent_coef = ppo_clip, vf_coef, ent_coef
        #: Optimizer passes over an RL job's batch (PPO); the job still makes one version.
        self.ppo_epochs = max(1, min(int(ppo_epochs), 32))
        self.lease_wait_s = lease_wait_s
        self.sched = SchedulerClient(broker, by=instance)
        self.tq = TrainingQueue(broker)
        self.policies = PolicyStore(broker)
        self.trainer_state = TrainerStateStore(broker, instance=instance)
        self.calls = CallStore(broker)
        self.deferred_calls: list[TrainingJob] = []
        self.tenants: dict[tuple[str, str], TenantState] = {}
        self.steps = 0
        self.busy_s = 0.0

    # ------------------------------------------------------------ tenant state
    async def tenant(self, tenant_id: str, workload: str) -> TenantState:
        key = (tenant_id, workload)
        cached = self.tenants.get(key)
        if cached is not None:
            # Another actor may have committed this tenant since this copy was loaded
            # or committed here: use the copy only while its revision is in force.
            if await self.trainer_state.revision(tenant_id, workload) == cached.revision:
                return cached
            del self.tenants[key]
        d = self.out_dir / tenant_id / workload
        record = await self.policies.latest(tenant_id, workload)
        # The checkpoint in force is the cluster's (any host reads it); the local file
        # is a cache, used only where no checkpoint was ever committed (an older layout).
        loaded = await self.trainer_state.load(tenant_id, workload)
        ckpt = d / "checkpoint.pt"
        revision = None
        if loaded is not None:
            module, applied, calls = await asyncio.to_thread(TenantState.unpack, loaded.data)
            revision = loaded.revision
        elif ckpt.exists():
            module, applied, calls = await asyncio.to_thread(TenantState.unpack, ckpt.read_bytes())
        else:
            module, applied, calls = await self.policies.load_module(record), {}, CallLog()
        if module.version < record.version:
            # Someone published past the checkpoint: take theirs, fresh optimizer.
            module = await self.policies.load_module(record)
        state = TenantState(module=module, record=record, applied=applied, dir=d, revision=revision,
                            calls=calls)
        self.tenants[key] = state
        return state

    # ------------------------------------------------------------ loop
    async def run(self, stop: asyncio.Event) -> None:
        # The actor also publishes version 1 of new workloads' heads (fresh weights
        # need torch, which the control plane does not import): its endpoint.
        from joynexus.agents.producers.init import PolicyInitService

        init = PolicyInitService(self.b, instance=self.instance)
        await init.start()
        try:
            await self._train(stop)
        finally:
            await init.stop()

    async def _train(self, stop: asyncio.Event) -> None:
        pending: list[TrainingJob] = []
        while not stop.is_set():
            pending += await self._lease(wait=not pending, room=self.max_group - len(pending))
            if not pending:
                continue
            group, pending = form_group(pending, lambda j: (j.tenant_id, j.workload))
            await self.train_group(group)
            if self.deferred_calls:  # calls waiting for an earlier one: held, tried again
                back, self.deferred_calls = self.deferred_calls, []
                if not pending:
                    await asyncio.sleep(DEFER_POLL_S)
                pending += back

    async def _lease(self, *, wait: bool, room: int) -> list[TrainingJob]:
        """What is ready now, up to ``room`` jobs; with ``wait`` (nothing pending) up to
        ``lease_wait_s`` for a first one, and none more if none came."""
        jobs: list[TrainingJob] = []
        if wait:
            job = await self.sched.lease_next("actor", wait_s=self.lease_wait_s)
            if job is None:
                return jobs
            jobs.append(job)
        while len(jobs) < room:
            more = await self.sched.lease_next("actor")
            if more is None:
                break
            jobs.append(more)
        return jobs

    async def train_group(self, jobs: list[TrainingJob]) -> None:
        """Train on a group of leased jobs (distinct tenant policies) and complete them:
        load, one grouped step, metrics, then each tenant's commit on its own."""
        # A training client's calls (custom jobs): those with rows share the base forward.
        calls = [c for j in jobs if j.task_type == "custom" and (c := await self.prepare_call(j))]
        todo = await self._load_group([j for j in jobs if j.task_type != "custom"])
        if not todo and not calls:
            return
        losses, stats, busy, results = await self._step_group(todo, calls)
        await self._report_busy(todo, busy, calls)
        for call, result in zip(calls, results, strict=True):
            await self.settle_call(call, result)
        for (job, st, _), outcome, stat in zip(todo, step_outcomes(losses), stats, strict=True):
            if outcome.error is not None:
                # This tenant's item went wrong inside the step: its module did not step
                # (nothing to save or publish); its job fails, the others complete.
                await self._give_up(job, outcome.error)
                continue
            remember_applied(st.applied, job.job_id, st.module.version)
            if not await self._commit(job, st):
                continue
            await self._finish(job, st, loss=outcome.loss, group_size=len(todo), stats=stat)

    async def _load_group(self, jobs: list[TrainingJob]) -> list[Todo]:
        """Each job's tenant state and item. A job applied before a crash completes
        without a second step; a job whose state or data does not load fails alone."""
        todo: list[Todo] = []
        for job in jobs:
            try:
                st = await self.tenant(job.tenant_id, job.workload)
                if job.job_id in st.applied:  # applied before a crash: complete, do not step again
                    await self._finish(job, st, loss=None)
                    continue
                todo.append((job, st, await self._item(job, st)))
            except Exception as e:
                error = load_failure(e)
                if error is None:
                    raise
                await self._give_up(job, error)
        return todo

    async def _step_group(
        self, todo: list[Todo], calls: Sequence[CallTodo] = ()
    ) -> tuple[list[float | JoyNexusError], list[dict[str, float]], tuple[float, float, float],
               list[dict[str, Any] | JoyNexusError]]:
        """The grouped step on the worker thread, with the leases kept alive and one
        span per job in its own trace (the group's span links them). Returns each
        item's loss or error, each module's stats, and (wall start, wall end, CPU s)."""
        hb = asyncio.create_task(keep_leases(self.sched, [j for j, _, _ in todo] + [c.job for c in calls]))  # noqa: RUF006
        t0 = time.perf_counter()
        wall_start = time.time()
        cpu_start = time.process_time()  # CPU seconds of this process: compute, not waiting
        links, job_spans = [], []
        try:
            for job, _, _ in todo:
                job_span = tracing.tracer.start_span(
                    "actor.train",
                    context=tracing.job_context(job.metadata.extra),
                    attributes={"job_id": job.job_id, "tenant": job.tenant_id},
                )
                links.append(trace.Link(job_span.get_span_context()))
                job_spans.append(job_span)
            with tracing.tracer.start_as_current_span("actor.train_group", links=links) as span:
                span.set_attribute("jobs", len(todo))
                losses, results = await asyncio.to_thread(self._step, [it for _, _, it in todo], calls)
                stats = [dict(st.module.last_stats) for _, st, _ in todo]
        finally:
            for _, st, _ in todo:  # a step that never ran leaves nothing staged
                st.module.stage_ppo(None)
            for job_span in job_spans:
                job_span.end()
            hb.cancel()
            with contextlib.suppress(BaseException):
                await hb
        self.busy_s += time.perf_counter() - t0
        self.steps += 1
        return losses, stats, (wall_start, time.time(), time.process_time() - cpu_start), results

    async def _report_busy(self, todo: list[Todo], busy: tuple[float, float, float],
                           calls: Sequence[CallTodo] = ()) -> None:
        wall_start, wall_end, cpu_s = busy
        await metrics.busy(
            self.b,
            "train",
            wall_start,
            wall_end,
            cpu_s=cpu_s,
            instance=self.instance,
            jobs=len(todo),
            tenants=sorted({j.tenant_id for j, _, _ in todo} | {c.job.tenant_id for c in calls}),
            # rows per tenant in this step (usage metering splits the step's time by them)
            tenant_rows=tenant_rows([(j.tenant_id, int(it.target.shape[0])) for j, _, it in todo]
                                    + [(c.job.tenant_id, c.item.batch.batch_size) for c in calls if c.item]),
        )

    async def _commit(self, job: TrainingJob, st: TenantState) -> bool:
        """The step's commit point: the checkpoint into JetStream (compare-and-set on
        the revision this state came from), then the local cache. False when another
        actor committed this tenant meanwhile: this step is void (not published, the
        job not completed; its lease lapses and it is retried against the newer state)."""
        data = await asyncio.to_thread(st.blob)
        try:
            st.revision = await self.trainer_state.save(
                job.tenant_id,
                job.workload,
                version=st.module.version,
                data=data,
                expected_revision=st.revision,
                jobs_applied=len(st.applied),
                last_job=job.job_id,
                last_call_seq=st.calls.last_seq,
            )
        except Conflict as e:
            log.warning("job %s: step not committed: %s", job.job_id, e)
            self.tenants.pop((job.tenant_id, job.workload), None)
            return False
        await asyncio.to_thread(st.save, data)
        return True

    def _step(self, items: list[TrainItem], calls: Sequence[CallTodo] = ()
              ) -> tuple[list[float | JoyNexusError], list[dict[str, Any] | JoyNexusError]]:
        """Compatible items (and calls' rows) share one backbone forward; others get
        their own.

        Per item its loss, or the error that kept it from stepping (its module
        unchanged), and per call its result or error: one tenant's bad item never
        stops the others' steps.
        """
        every = [*items, *[c.item for c in calls if c.item is not None]]
        out: dict[int, Any] = {}
        for idx in plan_groups([it.batch for it in every]):
            feats = shared_features(self.backbone, [every[i] for i in idx])
            train = [k for k, i in enumerate(idx) if i < len(items)]
            for k, loss in zip(train, isolated_train_step(
                    self.backbone, [every[idx[k]] for k in train], [feats[k] for k in train]), strict=True):
                out[idx[k]] = loss
            for k, i in enumerate(idx):
                if i >= len(items):
                    out[i] = compute_call(calls[i - len(items)], feats[k])
        return [out[i] for i in range(len(items))], [out[len(items) + i] for i in range(len(calls))]

    @property
    def knobs(self) -> StepKnobs:
        return StepKnobs(
            awr_beta=self.awr_beta,
            ppo_clip=self.ppo_clip,
            vf_coef=self.vf_coef,
            ent_coef=self.ent_coef,
            ppo_epochs=self.ppo_epochs,
        )

    async def _item(self, job: TrainingJob, st: TenantState) -> TrainItem:
        """Fetch and decode one job's partition into its tenant's item (``actor.batch``)."""
        lr = extra_number(job, "learning_rate", 1e-9, 1.0, 0.0)
        if lr and st.revision is None and not st.applied and st.module.lr != lr:
            # A module the actor has never stepped (built from a published version, whose
            # weights do not say how to train them): the workload's learning rate.
            st.module.set_lr(lr)
        schema = feature_schema_of(st.record)
        ppo = is_ppo(job.task_type, gaussian=st.module.gaussian, actor_forward=uses_actor_forward(job))
        fields = fields_to_read(
            job.task_type,
            schema.camera_slots,
            ppo=ppo,
            decisions=uses_decisions(job),
            old_logp_field=OLD_LOGP_FIELD,
        )
        meta = await self.tq.async_get_meta(
            fields,
            job.sample_count or 1 << 30,
            tenant_id=job.tenant_id,
            partition_id=job.partition_id,
            task_name=f"actor-{job.attempt}",
        )
        if not meta.rows:
            raise InvalidSpec(f"job {job.job_id}: its partition has no rows with fields {fields}")
        data = await self.tq.async_get_data(meta)
        return train_item(job, st.module, schema, data, ppo=ppo, knobs=self.knobs)

    async def _finish(
        self,
        job: TrainingJob,
        st: TenantState,
        *,
        loss: float | None,
        group_size: int = 1,
        stats: dict[str, float] | None = None,
    ) -> None:
        version = st.applied[job.job_id]
        try:
            st.record = await self.policies.publish(
                job.tenant_id,
                job.workload,
                st.module,
                feature_schema_of(st.record),
                st.record.base_model,
                version=version,
            )
        except InvalidSpec:
            pass  # this version was published before a crash
        except Conflict:
            st.record = await self.policies.latest(job.tenant_id, job.workload)
        try:
            await self.sched.complete(job, result_version=version)
        except StaleLease as e:
            log.warning("job %s: %s (its step stays applied as version %d)", job.job_id, e, version)
            return
        if loss is not None:
            await metrics.emit(
                self.b,
                "learning",
                job.tenant_id,
                workload=job.workload,
                job_id=job.job_id,
                task_type=job.task_type,
                version=version,
                loss=loss,
                samples=job.sample_count,
                group_size=group_size,
                **{k: round(v, 6) for k, v in (stats or {}).items()},
            )

    async def _give_up(self, job: TrainingJob, error: JoyNexusError) -> None:
        log.warning("job %s failed: %s", job.job_id, error)
        with contextlib.suppress(JoyNexusError):
            await self.sched.fail(
                job.job_id, f"actor: {type(error).__name__}: {error}", attempt=job.attempt
            )

    def tenant_summary(self) -> dict[str, Any]:
        return {f"{t}.{k}": st.module.version for (t, k), st in self.tenants.items()}
