"""One evaluation's run, and what it consults between rounds.

``evaluate_record`` runs an eval workload's episodes against its pinned policy
version (through the Inference Queue) and saves its videos (``save_videos``);
:class:`EvalControl` is its stop control (cancelled, or the evaluator
stopping: checked before every round and within steps) and its round turns,
handed out by :class:`FairSlots` round-robin by tenant, so a huge evaluation
takes turns with a small one. The evaluator (``agents.evaluator``) admits and
schedules evaluations and writes their results.

See docs/ARCHITECTURE.md, "Workloads, from the SDK to a new policy version"
(the evaluator, evaluation every K versions, videos).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from joynexus.agents.actions import sample_around
from joynexus.agents.envs.maniskill import run_episodes
from joynexus.agents.featureschema import feature_schema_of
from joynexus.broker.connection import Broker
from joynexus.broker.policy import PolicyRecords
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadRecord, video_object_name

__all__ = ["EvalControl", "FairSlots", "RunRecord", "delete_videos", "evaluate_record", "save_videos"]


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
    #: The saved episode videos (file names; ``evaluate_record`` fills it).
    videos: list[str] = field(default_factory=list)
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
    from joynexus.agents.producers import workload_schema
    from joynexus.schemas.samples import OBS_IMAGES, OBS_STATE

    control = control or EvalControl(rec.tenant_id)
    spec = rec.spec
    src = await PolicyRecords(b).get(rec.tenant_id, spec.init_from_workload, spec.init_from)
    schema = feature_schema_of(src)
    _, instruction = workload_schema(spec)
    infer = InferenceClient(b, base_model=src.base_model, timeout_s=15.0, retry_for_s=90.0)
    std = None
    rng = np.random.default_rng([spec.seed, 0x5A3D])  # the sampled policy's noise: seeded
    if spec.eval_policy == "sampled":  # the stochastic policy, as its rollouts act
        from joynexus.agents.models.policyio import PolicyStore  # torch: only when sampling

        std = await PolicyStore(b).action_std(src)

    async def act(obs: dict[str, Any]) -> np.ndarray:
        mean = await infer.act(
            rec.tenant_id,
            schema=schema,
            workload=spec.init_from_workload,
            policy_version=src.version,
            images={c: obs[f"{OBS_IMAGES}.{c}"] for c in schema.camera_slots},
            instruction=instruction,
            state=obs[OBS_STATE],
        )
        return mean if std is None else sample_around(mean, std, rng)

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

    recorder = None
    if spec.eval_videos and schema.camera_slots:
        from joynexus.agents.envs.video import EpisodeVideos

        recorder = EpisodeVideos(
            spec.eval_videos, f"{OBS_IMAGES}.{schema.camera_slots[0]}",
            max_frames=spec.video_frames, size=spec.video_size,
        )
    result, finished = await run_episodes(
        factory, act, episodes=spec.episodes, seed=spec.seed, control=control, recorder=recorder
    )
    if recorder is not None and finished:
        control.videos = await save_videos(b, rec, await asyncio.to_thread(recorder.encoded))
    return {**{k: float(v) for k, v in result.items()}, "version": float(src.version)}, finished


async def save_videos(b: Broker, rec: WorkloadRecord, files: list[tuple[str, bytes]]) -> list[str]:
    """Put an evaluation's videos into the object store (``video_object_name``);
    returns their file names, for the record."""
    store = await b.js.object_store(b.names.weights_store)
    for name, data in files:
        await store.put(video_object_name(rec.tenant_id, rec.spec.name, name), data)
    return [name for name, _ in files]


async def delete_videos(b: Broker, rec: WorkloadRecord) -> int:
    """Delete an evaluation's videos from the object store (its record is being
    forgotten: what it saved goes with it, so a tenant's stored videos stay within
    ``max_workloads`` records' worth); how many were deleted."""
    if not rec.videos:
        return 0
    store = await b.js.object_store(b.names.weights_store)
    gone = 0
    for name in rec.videos:
        with contextlib.suppress(Exception):  # already gone
            await store.delete(video_object_name(rec.tenant_id, rec.spec.name, name))
            gone += 1
    return gone


RunRecord = Callable[[Broker, WorkloadRecord, EvalControl], Awaitable[tuple[dict[str, float], bool]]]
