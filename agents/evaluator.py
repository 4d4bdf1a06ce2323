"""The evaluator: runs eval workloads, pinned to one policy version throughout.

Evaluations share the evaluator fairly whatever their size, so a tenant's
huge evaluation takes turns with another's small one instead of holding it:
at most ``max_open`` evaluations have an env open at once and at most
``max_concurrent`` rounds (``num_envs`` episodes side by side) run at once,
both handed out round-robin by tenant (per-tenant bounds are the control
plane's, at create time). A cancelled evaluation stops before its next round
(within a step if one runs) and keeps the episodes finished so far as its
result; on ``stop`` every evaluation stops within a step and stays ``active``
for the next evaluator, and ``run`` returns within ``grace_s``. One
evaluation's run, its stop control and the fair turns are ``agents.evalrun``.

See docs/ARCHITECTURE.md, "Workloads, from the SDK to a new policy version"
(the evaluator, evaluation every K versions, videos).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from joynexus.agents.control.checks import periodic_to_forget, periodic_wait
from joynexus.agents.evalrun import (
    EvalControl,
    FairSlots,
    RunRecord,
    delete_videos,
    evaluate_record,
)
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.policy import PolicyRecords
from joynexus.broker.quotas import QuotaBook
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.workloads import (
    WorkloadRecord,
    WorkloadSpec,
    periodic_eval_name,
)

log = logging.getLogger(__name__)

#: Periodic evaluations of one workload at most (versions K, 2K, ... 64K).
MAX_PERIODIC_EVALS = 64


@dataclass
class _Running:
    task: asyncio.Task[None]
    control: EvalControl


class Evaluator:
    """Runs every active eval workload (see the module docstring for the sharing)."""

    def __init__(
        self,
        broker: Broker,
        *,
        instance: str,
        max_concurrent: int = 2,
        max_open: int = 16,
        grace_s: float = 10.0,
        run_record: RunRecord | None = None,
    ) -> None:
        self.b = broker
        self.instance = instance
        self.done = 0
        self.turns = FairSlots(max_concurrent)
        self.open = FairSlots(max_open)
        self.grace_s = grace_s
        self.run_record: RunRecord = run_record or evaluate_record
        self.running: dict[str, _Running] = {}
        self._kv: Any = None
        #: Training workloads with eval_every (key -> spec; specs do not change).
        self._trained: dict[str, WorkloadSpec] = {}
        self._untrained: set[str] = set()
        #: Periodic evaluations this evaluator created (for tests and logs).
        self.created: list[str] = []
        #: Every workload record as the watch last saw it (a tenant's evaluations and
        #: active workloads count against its quota before a periodic one starts).
        self.records: dict[str, WorkloadRecord] = {}
        #: Per tenant, the periodic evaluations due but not started (its quota's
        #: max_concurrent_evals reached), oldest first: queued, not dropped.
        self.due: dict[str, deque[tuple[WorkloadSpec, int, str]]] = {}
        self.quotas = QuotaBook(broker)
        self._admit = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        from joynexus.agents.producers import watch_workloads

        self._kv = await self.b.js.key_value(self.b.names.workloads_bucket)
        await self.quotas.start()
        versions = asyncio.create_task(self._watch_versions())
        admit = asyncio.create_task(self._admit_loop())
        try:
            async for key, rec in watch_workloads(self.b, stop, idle=self._reap):
                self._reap()
                self.records[key] = rec
                self._admit.set()  # an evaluation that ended frees a slot
                if rec.spec.eval_every:
                    self._trained[key] = rec.spec
                if rec.spec.task_type != "eval":
                    continue
                if rec.state == "active" and key not in self.running:
                    control = EvalControl(rec.tenant_id, turns=self.turns)
                    control.check = self._checker(key, control)
                    task = asyncio.create_task(self._evaluate(key, rec, control))
                    self.running[key] = _Running(task, control)
                elif rec.state != "active" and key in self.running:
                    self.running[key].control.cancel()
        finally:
            for t in (versions, admit):
                await cancel_and_wait(t)
            await self.quotas.stop()
            # Stopping (SIGTERM): every evaluation stops within a step; records stay active.
            for r in self.running.values():
                r.control.halt.set()
            tasks = [r.task for r in self.running.values()]
            if tasks:
                _, late = await asyncio.wait(tasks, timeout=self.grace_s)
                for t in late:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    # -- periodic evaluation (a training workload's eval_every)
    async def _watch_versions(self) -> None:
        """Every published policy version; the K-th, 2K-th... of a workload with
        ``eval_every`` = K get their evaluation record (once: see ``_periodic``).
        The first records the watch replays are each key's latest: for those, every
        retained multiple of K is looked at, so versions published while no evaluator
        ran are evaluated too (as far as the policy history still holds them)."""
        store = PolicyRecords(self.b)
        while True:
            ready = asyncio.Event()
            try:
                async for prec in store.watch(ready=ready):
                    try:
                        await self._version_published(store, prec, catch_up=not ready.is_set())
                    except asyncio.CancelledError:
                        raise
                    except Exception:  # one tenant's odd record must not stop the others'
                        log.exception("periodic evaluation of %s.%s v%d", prec.tenant_id,
                                      prec.workload, prec.version)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the broker went away: watch again
                log.warning("policy watch ended (%s); watching again", e)
                await asyncio.sleep(1.0)

    async def _training_spec(self, tenant: str, workload: str) -> WorkloadSpec | None:
        key = self.b.names.workload_key(tenant, workload)
        spec = self._trained.get(key)
        if spec is None and key not in self._untrained:
            try:
                rec = decode((await self._kv.get(key)).value, WorkloadRecord)
            except (KeyNotFoundError, JoyNexusError):
                return None  # not a workload's policy (yet: its record follows its v1)
            if rec.spec.eval_every:
                spec = self._trained[key] = rec.spec
            elif len(self._untrained) < 100_000:
                self._untrained.add(key)  # a spec never changes: no KV get per version
        return spec

    async def _version_published(self, store: PolicyRecords, prec: Any, *, catch_up: bool) -> None:
        spec = await self._training_spec(prec.tenant_id, prec.workload)
        if spec is None or spec.task_type not in ("sft", "rl") or not spec.eval_every:
            return
        k = spec.eval_every
        if catch_up:
            retained = [r.version for r in await store.history(prec.tenant_id, prec.workload)]
            due = sorted(v for v in retained if v % k == 0)
        else:
            due = [prec.version] if prec.version % k == 0 else []
        for version in due:
            if version // k > MAX_PERIODIC_EVALS:
                log.info("%s.%s: no evaluation of v%d (at most %d per workload)",
                         prec.tenant_id, spec.name, version, MAX_PERIODIC_EVALS)
                continue
            line = self.due.setdefault(prec.tenant_id, deque())
            if (spec.name, version) not in {(t.name, v) for t, v, _ in line}:
                line.append((spec, version, prec.schema_signature))
        self._admit.set()

    async def _admit_loop(self) -> None:
        """Start the queued periodic evaluations each tenant's quota has room for,
        whenever a record changes (and every second: a quota may have grown)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._admit.wait(), 1.0)
            self._admit.clear()
            try:
                await self.admit_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("admitting periodic evaluations")

    async def admit_due(self) -> None:
        """For each tenant with periodic evaluations due, oldest first: while its
        quota has room (``periodic_wait``), drop those whose version is gone from the
        policy history (nothing to evaluate), forget its oldest ended periodic records
        beyond ``max_workloads`` (``periodic_to_forget``) and create the next."""
        store = PolicyRecords(self.b)
        for tenant in list(self.due):
            line = self.due[tenant]
            q = self.quotas.get(tenant)
            while line:
                mine = [r for r in self.records.values() if r.tenant_id == tenant]
                if periodic_wait(tenant, mine, q) is not None:
                    break  # queued until one of its evaluations ends
                train, version, signature = line.popleft()
                try:
                    await store.get(tenant, train.name, version)
                except JoyNexusError:
                    log.info("%s.%s: v%d left the policy history before its evaluation "
                             "could start; skipped", tenant, train.name, version)
                    continue
                for old in periodic_to_forget(mine, q):
                    key = self.b.names.workload_key(tenant, old.spec.name)
                    with contextlib.suppress(KeyNotFoundError):
                        await self._kv.delete(key)
                    self.records.pop(key, None)
                    await delete_videos(self.b, old)
                await self._periodic(tenant, train, version, signature)
            if not line:
                del self.due[tenant]

    async def _periodic(self, tenant: str, train: WorkloadSpec, version: int, signature: str) -> bool:
        """Create the evaluation record of ``version`` unless it exists (a KV create:
        one record per (tenant, workload, version), however many evaluators or
        restarts see the version). The watch then runs it like any evaluation."""
        spec = WorkloadSpec(
            name=periodic_eval_name(train.name, version),
            task_type="eval",
            env=train.env,
            base_model=train.base_model,
            action_module=train.action_module,
            action_horizon=train.action_horizon,
            image_size=train.image_size,
            init_from_workload=train.name,
            init_from=version,
            episodes=train.eval_episodes,
            num_envs=max(1, min(train.num_envs, train.eval_episodes, 4)),
            seed=train.seed,
            instruction=train.instruction,
            eval_videos=train.eval_videos,
            eval_policy=train.eval_policy,
            video_frames=train.video_frames,
            video_size=train.video_size,
        )
        key = self.b.names.workload_key(tenant, spec.name)
        rec = WorkloadRecord(
            tenant_id=tenant, spec=spec, created_at=time.time(), schema_signature=signature,
            periodic=True,
        )
        try:
            await self._kv.create(key, encode(rec))
        except KeyWrongLastSequenceError:  # made already (or the tenant took the name)
            return False
        self.records[key] = rec  # counted at once, before the watch brings it back
        self.created.append(key)
        log.info("periodic evaluation %s of %s v%d", key, train.name, version)
        return True

    def _reap(self) -> None:
        for key in [k for k, r in self.running.items() if r.task.done()]:
            del self.running[key]

    def _checker(self, key: str, control: EvalControl) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            """The record left ``active`` (the watch would say so too; this is one KV get)."""
            try:
                entry = await self._kv.get(key)
                state = decode(entry.value, WorkloadRecord).state
            except KeyNotFoundError:
                state = "cancelled"
            except Exception:  # the broker is slow or away: the watch still decides
                return False
            if state != "active":
                control.cancel()
                return True
            return False

        return check

    async def _evaluate(self, key: str, rec: WorkloadRecord, control: EvalControl) -> None:
        if not await self.open.acquire(rec.tenant_id, control.halt):
            await self._stopped(key, control, {"episodes": 0.0})
            return
        try:
            why = ""
            try:
                result, finished = await self.run_record(self.b, rec, control)
                state = "done" if finished else "cancelled"
            except asyncio.CancelledError:
                raise
            except JoyNexusError as e:
                result, state, finished = {"error_code": 1.0}, "cancelled", True
                why = metrics.clip(f"the evaluation failed: {e}", 300)
                log.warning("eval %s failed: %s", key, e)
            except Exception as e:
                result, state, finished = {"error_code": 1.0}, "cancelled", True
                why = f"the evaluator crashed ({type(e).__name__}); operators: see its log"
                log.exception("eval %s crashed", key)
        finally:
            self.open.release()
        if not finished:
            await self._stopped(key, control, result)
            return
        await self._finish(key, state, result, control.videos, reason=why)
        self.done += 1
        await metrics.emit(
            self.b,
            "learning",
            rec.tenant_id,
            workload=rec.spec.init_from_workload,
            evaluation=rec.spec.name,
            eval_success=result.get("success_rate", 0.0),
            eval_return=result.get("mean_return", 0.0),
            version=result.get("version", 0.0),
        )

    async def _stopped(self, key: str, control: EvalControl, result: dict[str, float]) -> None:
        if control.cancelled:
            log.info("eval %s cancelled after %d episodes", key, int(result.get("episodes", 0)))
            await self._finish(key, "cancelled", {**result, "cancelled": 1.0})
        # else: the evaluator is stopping; the record stays active for the next one

    async def _finish(
        self,
        key: str,
        state: str,
        result: dict[str, float],
        videos: list[str] | None = None,
        *,
        reason: str = "",
    ) -> None:
        """Write the result into the record, never over a newer state (a cancel
        that came meanwhile stays a cancel)."""
        for _ in range(10):
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                return
            cur = decode(entry.value, WorkloadRecord)
            if cur.state == "done":
                return
            new_state = "cancelled" if cur.state != "active" else state
            if new_state == "cancelled" and state == "done":
                result = {**result, "cancelled": 1.0}
            finished = msgspec.structs.replace(
                cur, state=new_state, result=result, finished_at=time.time(),
                videos=list(videos or cur.videos), reason=reason or cur.reason,
            )
            try:
                await self._kv.update(key, encode(finished), last=entry.revision)
                return
            except KeyWrongLastSequenceError:
                continue
        log.warning("eval %s: could not write its result (the record kept changing)", key)


__all__ = ["MAX_PERIODIC_EVALS", "Evaluator"]
