"""The evaluator: runs eval workloads, pinned to one policy version throughout.

It watches the workloads bucket for active ``eval`` workloads, runs N
episodes in the workload's ManiSkill task with actions from the Inference
Queue pinned to the evaluated version (no exploration noise, nothing in the
Training Queue), and writes the result into the workload record (state
``done``), which the SDK's ``evaluate`` future waits for.

Evaluations share the evaluator fairly, whatever their size:

* each evaluation runs as a task of its own; at most ``max_open`` of them
  have an env open at once (admitted round-robin by tenant), and at most
  ``max_concurrent`` rounds (``num_envs`` episodes side by side) run at once,
  each round a turn handed out round-robin by tenant. A tenant's 10^9-episode
  evaluation takes turns with another tenant's 2-episode one instead of
  holding the evaluator (the control plane bounds episodes and concurrent
  evaluations per tenant at create time; here only the global bounds live).
* a cancelled evaluation (its record's state leaves ``active``: the watch
  sees it at once, and a KV get before every round checks again) stops
  before its next round, or within a step if a round is under way; its
  record keeps state ``cancelled`` and gets the episodes finished so far as
  its result (``cancelled`` = 1).
* on ``stop`` (SIGTERM of the role process: ``joynexus agent evaluator``)
  every evaluation stops within a step, the records stay ``active`` (the next
  evaluator starts them afresh), and ``run`` returns within ``grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from joynexus.agents.envs.maniskill import run_episodes
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.policy import PolicyStore, feature_schema_of
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import InvalidSpec, JoyNexusError
from joynexus.schemas.workloads import WorkloadRecord

log = logging.getLogger(__name__)


class FairSlots:
    """``n`` slots handed out round-robin by tenant: when one frees, it goes to the
    tenant (with a waiter) served longest ago, not to whoever asks again first."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise InvalidSpec(f"slots must be >= 1, got {n}")
        self.n = n
        self.free = n
        # tenant -> its waiters (FIFO); dict order is the round-robin order.
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, tenant: str, halt: asyncio.Event | None = None) -> bool:
        """Take a slot (True), or give up once ``halt`` is set (False)."""
        if halt is not None and halt.is_set():
            return False
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(fut)
        halted = asyncio.ensure_future(halt.wait()) if halt is not None else None
        waits: list[asyncio.Future[Any]] = [fut] if halted is None else [fut, halted]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._give_up(tenant, fut)
            raise
        finally:
            if halted is not None:
                halted.cancel()
        if fut.done() and not fut.cancelled():
            return True
        self._give_up(tenant, fut)
        return False

    def _give_up(self, tenant: str, fut: asyncio.Future[None]) -> None:
        if fut.done() and not fut.cancelled():
            self.release()  # it was granted meanwhile: pass it on
            return
        fut.cancel()
        q = self._waiting.get(tenant)
        if q is not None:
            with contextlib.suppress(ValueError):
                q.remove(fut)
            if not q:
                del self._waiting[tenant]

    def release(self) -> None:
        while self._waiting:
            tenant = next(iter(self._waiting))
            q = self._waiting.pop(tenant)
            fut = q.popleft()
            if q:
                self._waiting[tenant] = q  # back of the line: round-robin
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


@dataclass
class EvalControl:
    """What one evaluation consults between rounds and steps."""

    tenant: str
    #: Set when the evaluation must stop (cancelled, or the evaluator stops).
    halt: asyncio.Event = field(default_factory=asyncio.Event)
    #: Round turns (shared by all evaluations); None: no turns.
    turns: FairSlots | None = None
    #: Asked before every round; True stops the evaluation (a cheap KV get).
    check: Callable[[], Awaitable[bool]] | None = None
    #: The workload was cancelled (not merely the evaluator stopping).
    cancelled: bool = False
    #: A round turn is held (``begin_round`` took it, ``end_round`` gives it back).
    _turn: bool = field(default=False, init=False, repr=False)

    def cancel(self) -> None:
        self.cancelled = True
        self.halt.set()

    async def stopping(self) -> bool:
        if self.halt.is_set():
            return True
        if self.check is not None and await self.check():
            self.halt.set()
        return self.halt.is_set()

    # -- the episode loop's stop control (``maniskill.EpisodeControl``)
    async def begin_round(self) -> bool:
        """Before every round: not stopping (a KV get), then a turn (round-robin)."""
        if await self.stopping():
            return False
        if self.turns is None:
            return True
        self._turn = await self.turns.acquire(self.tenant, self.halt)
        return self._turn

    def end_round(self) -> None:
        if self._turn and self.turns is not None:
            self.turns.release()
        self._turn = False

    def halted(self) -> bool:
        return self.halt.is_set()


async def evaluate_record(
    b: Broker, rec: WorkloadRecord, control: EvalControl | None = None
) -> tuple[dict[str, float], bool]:
    """Run ``rec``'s evaluation: (result, finished)."""
    from joynexus.agents.envs.registry import make_env
    from joynexus.agents.inference import InferenceClient
    from joynexus.agents.workloads import OBS_IMAGES, OBS_STATE, workload_schema

    control = control or EvalControl(rec.tenant_id)
    spec = rec.spec
    src = await PolicyStore(b).get(rec.tenant_id, spec.init_from_workload, spec.init_from)
    schema = feature_schema_of(src)
    _, instruction = workload_schema(spec)
    infer = InferenceClient(b, base_model=src.base_model, timeout_s=15.0, retry_for_s=90.0)

    async def act(obs: dict[str, Any]) -> np.ndarray:
        return await infer.act(
            rec.tenant_id,
            schema=schema,
            policy_key=spec.init_from_workload,
            policy_version=src.version,
            images={c: obs[f"{OBS_IMAGES}.{c}"] for c in schema.camera_slots},
            instruction=instruction,
            state=obs[OBS_STATE],
        )

    def factory() -> Any:
        return make_env(
            spec.env,
            obs="rgb",
            num_envs=spec.num_envs,
            image_size=schema.image_hw[0],
            seed=spec.seed,
            # The observation the policy was trained on (its record), not the task's default.
            cameras=schema.camera_slots,
            state_keys=schema.state_keys or spec.state or None,
        )

    result, finished = await run_episodes(
        factory, act, episodes=spec.episodes, seed=spec.seed, control=control
    )
    return {**{k: float(v) for k, v in result.items()}, "version": float(src.version)}, finished


RunRecord = Callable[[Broker, WorkloadRecord, EvalControl], Awaitable[tuple[dict[str, float], bool]]]


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

    async def run(self, stop: asyncio.Event) -> None:
        from joynexus.agents.workloads import watch_workloads

        self._kv = await self.b.js.key_value(self.b.names.workloads_bucket)
        try:
            async for key, rec in watch_workloads(self.b, stop, idle=self._reap):
                self._reap()
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
            # Stopping (SIGTERM): every evaluation stops within a step; records stay active.
            for r in self.running.values():
                r.control.halt.set()
            tasks = [r.task for r in self.running.values()]
            if tasks:
                _, late = await asyncio.wait(tasks, timeout=self.grace_s)
                for t in late:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

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
            try:
                result, finished = await self.run_record(self.b, rec, control)
                state = "done" if finished else "cancelled"
            except asyncio.CancelledError:
                raise
            except JoyNexusError as e:
                result, state, finished = {"error_code": 1.0}, "cancelled", True
                log.warning("eval %s failed: %s", key, e)
            except Exception:
                result, state, finished = {"error_code": 1.0}, "cancelled", True
                log.exception("eval %s crashed", key)
        finally:
            self.open.release()
        if not finished:
            await self._stopped(key, control, result)
            return
        await self._finish(key, state, result)
        self.done += 1
        await metrics.emit(
            self.b,
            "learning",
            rec.tenant_id,
            workload=rec.spec.init_from_workload,
            eval_success=result.get("success_rate", 0.0),
            version=result.get("version", 0.0),
        )

    async def _stopped(self, key: str, control: EvalControl, result: dict[str, float]) -> None:
        if control.cancelled:
            log.info("eval %s cancelled after %d episodes", key, int(result.get("episodes", 0)))
            await self._finish(key, "cancelled", {**result, "cancelled": 1.0})
        # else: the evaluator is stopping; the record stays active for the next one

    async def _finish(self, key: str, state: str, result: dict[str, float]) -> None:
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
                cur, state=new_state, result=result, finished_at=time.time()
            )
            try:
                await self._kv.update(key, encode(finished), last=entry.revision)
                return
            except KeyWrongLastSequenceError:
                continue
        log.warning("eval %s: could not write its result (the record kept changing)", key)


__all__ = ["EvalControl", "Evaluator", "FairSlots", "evaluate_record", "run_episodes"]
