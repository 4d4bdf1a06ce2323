"""The evaluator shares itself fairly and stops when told: a cancelled evaluation
stops within a round, a stopping evaluator (SIGTERM) returns promptly, and one
tenant's endless evaluation does not hold up another tenant's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from joynexus.agents.envs.maniskill import run_episodes
from joynexus.agents.evalrun import EvalControl, FairSlots
from joynexus.agents.evaluator import Evaluator
from joynexus.broker.connection import Broker
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import Unavailable
from joynexus.schemas.workloads import WorkloadRecord, WorkloadSpec

pytestmark = pytest.mark.timeout(120)

STEP_S = 0.01


@dataclass
class _Spec:
    num_envs: int = 1
    action_dim: int = 2
    max_episode_steps: int = 3


@dataclass
class _Step:
    obs: dict[str, Any]
    reward_N: np.ndarray
    terminated_N: np.ndarray
    truncated_N: np.ndarray
    success_N: np.ndarray


class FakeEnv:
    """Episodes of 3 steps; success at the last one. Counts what it was asked."""

    def __init__(self, num_envs: int = 1) -> None:
        self.spec = _Spec(num_envs=num_envs)
        self.resets = 0
        self.t = 0
        self.closed = False

    def _obs(self) -> dict[str, Any]:
        return {"observation.state": np.zeros((self.spec.num_envs, 3), dtype=np.float32)}

    def reset(self, seeds: list[int]) -> dict[str, Any]:
        self.resets += 1
        self.t = 0
        return self._obs()

    def step(self, a: np.ndarray) -> _Step:
        time.sleep(STEP_S)
        self.t += 1
        n = self.spec.num_envs
        end = np.full(n, self.t >= 3)
        return _Step(self._obs(), np.ones(n), end, np.zeros(n, bool), end.copy())

    def close(self) -> None:
        self.closed = True


async def act(obs: dict[str, Any]) -> np.ndarray:
    await asyncio.sleep(0)
    return np.zeros((len(obs["observation.state"]), 2), dtype=np.float32)


async def test_run_episodes_matches_the_plain_statistics() -> None:
    env = FakeEnv(num_envs=2)
    result, finished = await run_episodes(
        lambda: env, act, episodes=5, control=EvalControl("acme", turns=FairSlots(1))
    )
    assert finished and result["episodes"] == 5 and result["success_rate"] == 1.0
    assert result["mean_length"] == 3.0 and result["mean_return"] == 3.0
    assert env.resets == 3 and env.closed


async def test_fair_slots_alternate_between_tenants() -> None:
    slots = FairSlots(1)
    order: list[str] = []

    async def rounds(tenant: str, n: int) -> None:
        for _ in range(n):
            assert await slots.acquire(tenant)
            order.append(tenant)
            await asyncio.sleep(0.01)
            slots.release()

    await asyncio.gather(rounds("acme", 6), rounds("bolt", 3))
    # bolt is never kept waiting for more than one of acme's rounds
    assert order[:6] == ["acme", "bolt"] * 3
    halt = asyncio.Event()
    assert await slots.acquire("acme")
    waiter = asyncio.create_task(slots.acquire("bolt", halt))
    await asyncio.sleep(0.05)
    halt.set()
    assert await waiter is False
    slots.release()
    assert slots.free == 1 and slots.waiting == 0


class Harness:
    def __init__(self, b: Broker) -> None:
        self.b = b
        self.envs: dict[str, FakeEnv] = {}
        self.started: dict[str, float] = {}

    async def run_record(
        self, b: Broker, rec: WorkloadRecord, control: EvalControl
    ) -> tuple[dict[str, float], bool]:
        env = FakeEnv()
        self.envs[f"{rec.tenant_id}.{rec.spec.name}"] = env
        res, finished = await run_episodes(
            lambda: env, act, episodes=rec.spec.episodes, control=control
        )
        return {k: float(v) for k, v in res.items()}, finished

    async def create(self, tenant: str, name: str, episodes: int) -> str:
        kv = await self.b.js.key_value(self.b.names.workloads_bucket)
        spec = WorkloadSpec(
            name=name,
            task_type="eval",
            env="PickCube-v1",
            init_from_workload="pick",
            episodes=episodes,
            num_envs=1,
        )
        key = self.b.names.workload_key(tenant, name)
        await kv.put(key, encode(WorkloadRecord(tenant_id=tenant, spec=spec, created_at=time.time())))
        return key

    async def record(self, key: str) -> WorkloadRecord:
        kv = await self.b.js.key_value(self.b.names.workloads_bucket)
        return decode((await kv.get(key)).value, WorkloadRecord)

    async def cancel(self, key: str) -> None:
        kv = await self.b.js.key_value(self.b.names.workloads_bucket)
        rec = await self.record(key)
        await kv.put(key, encode(WorkloadRecord(tenant_id=rec.tenant_id, spec=rec.spec, state="cancelled")))

    async def wait_state(self, key: str, state: str, within: float) -> WorkloadRecord:
        deadline = time.monotonic() + within
        while True:
            rec = await self.record(key)
            if rec.state == state and (state == "active" or rec.finished_at):
                return rec
            if time.monotonic() > deadline:
                raise AssertionError(f"{key} is {rec.state} {rec.result}, not {state}")
            await asyncio.sleep(0.05)


async def test_cancel_stops_a_huge_evaluation_and_others_still_finish(broker: Broker) -> None:
    h = Harness(broker)
    # one turn at a time: the two tenants must take turns to both progress
    ev = Evaluator(broker, instance="eval", max_concurrent=1, run_record=h.run_record)
    stop = asyncio.Event()
    task = asyncio.create_task(ev.run(stop))
    try:
        huge = await h.create("acme", "huge", episodes=10**9)
        await asyncio.sleep(0.5)  # acme's evaluation is well under way
        small = await h.create("bolt", "small", episodes=4)
        done = await h.wait_state(small, "done", within=20)
        assert done.result["episodes"] == 4.0 and done.result["success_rate"] == 1.0
        assert (await h.record(huge)).state == "active"
        before = h.envs["acme.huge"].resets
        await h.cancel(huge)
        t0 = time.monotonic()
        rec = await h.wait_state(huge, "cancelled", within=10)
        assert time.monotonic() - t0 < 3
        env = h.envs["acme.huge"]
        assert env.resets - before <= 3  # stopped within a few episodes of the cancel
        assert env.closed
        assert rec.result["cancelled"] == 1.0
        assert 1 <= rec.result["episodes"] <= env.resets
        resets = env.resets
        await asyncio.sleep(0.3)
        assert env.resets == resets  # nothing runs on
        assert not ev.running
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_stop_returns_promptly_and_leaves_evaluations_active(broker: Broker) -> None:
    h = Harness(broker)
    ev = Evaluator(broker, instance="eval", run_record=h.run_record)
    stop = asyncio.Event()
    task = asyncio.create_task(ev.run(stop))
    huge = await h.create("acme", "huge", episodes=10**9)
    await asyncio.sleep(0.5)
    assert h.envs["acme.huge"].resets > 0
    t0 = time.monotonic()
    stop.set()  # what SIGTERM does in `joynexus agent evaluator`
    await asyncio.wait_for(task, 10)
    assert time.monotonic() - t0 < 3
    assert h.envs["acme.huge"].closed
    rec = await h.record(huge)
    assert rec.state == "active" and not rec.result  # the next evaluator runs it afresh


async def test_kv_check_catches_a_cancel_the_watch_missed(broker: Broker) -> None:
    h = Harness(broker)
    ev = Evaluator(broker, instance="eval", run_record=h.run_record)
    ev._kv = await broker.js.key_value(broker.names.workloads_bucket)
    key = await h.create("acme", "huge", episodes=10**9)
    rec = await h.record(key)
    control = EvalControl("acme", turns=ev.turns)
    control.check = ev._checker(key, control)
    run = asyncio.create_task(ev._evaluate(key, rec, control))  # no watch running
    await asyncio.sleep(0.3)
    await h.cancel(key)
    await asyncio.wait_for(run, 5)
    rec = await h.wait_state(key, "cancelled", within=1)
    assert rec.result["cancelled"] == 1.0


async def test_a_failed_evaluation_says_why_in_its_record(broker: Broker) -> None:
    """What failed reaches the tenant (the record's ``reason``, which the SDK's
    ``evaluate`` raises), not only the evaluator's log; a crash names no internals."""
    h = Harness(broker)

    async def failing(b: Broker, rec: WorkloadRecord, control: EvalControl) -> Any:
        if rec.spec.name == "noengine":
            raise Unavailable("no inference engine serves 'qwen2.5-vl-tiny'")
        raise KeyError("internal detail")

    ev = Evaluator(broker, instance="eval", run_record=failing)
    ev._kv = await broker.js.key_value(broker.names.workloads_bucket)
    for name in ("noengine", "crash"):
        key = await h.create("acme", name, episodes=2)
        control = EvalControl("acme", turns=ev.turns)
        await ev._evaluate(key, await h.record(key), control)
    rec = await h.wait_state(broker.names.workload_key("acme", "noengine"), "cancelled", within=2)
    assert rec.result["error_code"] == 1.0
    assert "no inference engine serves" in rec.reason
    rec = await h.wait_state(broker.names.workload_key("acme", "crash"), "cancelled", within=2)
    assert "crashed (KeyError)" in rec.reason and "internal detail" not in rec.reason


async def test_a_forgotten_evaluations_videos_go_with_it(broker: Broker) -> None:
    """Videos are stored per evaluation; deleting them with its record keeps a tenant's
    stored videos within its records (issue 24: a forgotten periodic record's videos
    stayed in the object store)."""
    from nats.js.errors import ObjectNotFoundError

    from joynexus.agents.evalrun import delete_videos, save_videos
    from joynexus.schemas.workloads import video_object_name

    rec = WorkloadRecord(tenant_id="acme", spec=WorkloadSpec(
        name="pick-v3", task_type="eval", env="PickCube-v1", init_from_workload="pick"))
    names = await save_videos(broker, rec, [("ep0.mp4", b"a" * 100), ("ep1.mp4", b"b" * 50)])
    rec = WorkloadRecord(tenant_id="acme", spec=rec.spec, videos=names)
    other = WorkloadRecord(tenant_id="bolt", spec=rec.spec, videos=["ep0.mp4"])
    await save_videos(broker, other, [("ep0.mp4", b"c")])
    store = await broker.js.object_store(broker.names.weights_store)
    assert (await store.get(video_object_name("acme", "pick-v3", "ep1.mp4"))).data == b"b" * 50
    assert await delete_videos(broker, rec) == 2
    for name in names:
        with pytest.raises(ObjectNotFoundError):
            await store.get(video_object_name("acme", "pick-v3", name))
    assert (await store.get(video_object_name("bolt", "pick-v3", "ep0.mp4"))).data == b"c"
