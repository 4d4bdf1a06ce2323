"""Learning you can see: evaluation every K versions during training (pinned to
its version, once per version across evaluator restarts), the results through
the SDK, episode videos only for their own tenant, and the episode loop's stop
control. Real nats-server, real inference engine, real ManiSkill."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from joynexus.agents.control import ControlPlane
from joynexus.agents.envs.maniskill import make_env, random_policy, run_episodes, task_spec
from joynexus.agents.envs.video import EpisodeVideos, decode_frames
from joynexus.agents.evaluator import Evaluator
from joynexus.agents.inference import EnginePool
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.policyio import PolicyStore, feature_schema_of
from joynexus.agents.producers import PolicyInitializer
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.ops.cli import build_parser
from joynexus.ops.cli.learning import evals as _evals
from joynexus.ops.mainjob.report import write_paper_report
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.base import decode
from joynexus.schemas.errors import QuotaExceeded, UnknownTenant
from joynexus.schemas.workloads import WorkloadRecord, WorkloadSpec, periodic_eval_name
from joynexus.sdk import Client

pytestmark = pytest.mark.timeout(240)


class Service:
    """The roles periodic evaluation needs (no producers, no trainer: the test
    publishes the versions itself, so nothing but the evaluator can evaluate)."""

    def __init__(self, b: Broker, backbone: Backbone) -> None:
        self.b = b
        self.backbone = backbone
        self.stop = asyncio.Event()

    async def start(self) -> None:
        self.sched = SchedulerAgent(self.b, instance="sched", expire_every_s=0.5)
        await self.sched.start()
        self.control = ControlPlane(self.b, init_policy=PolicyInitializer(self.b), instance="control")
        await self.control.start()
        self.pool = EnginePool(self.b, self.backbone, max_batch=8, max_wait_ms=2)
        await self.pool.scale_to(1)

    def start_evaluator(self, instance: str) -> tuple[Evaluator, asyncio.Event, asyncio.Task[None]]:
        ev = Evaluator(self.b, instance=instance)
        stop = asyncio.Event()
        return ev, stop, asyncio.create_task(ev.run(stop))

    async def close(self) -> None:
        await self.pool.close()
        await self.control.stop()
        await self.sched.stop()


@pytest.fixture
async def service(broker: Broker) -> AsyncIterator[Service]:
    torch.manual_seed(0)
    s = Service(broker, Backbone.build(BackboneConfig(size="tiny")))
    await s.start()
    yield s
    await s.close()


async def record(b: Broker, name: str, tenant: str = "acme") -> WorkloadRecord | None:
    kv = await b.js.key_value(b.names.workloads_bucket)
    try:
        return decode((await kv.get(b.names.workload_key(tenant, name))).value, WorkloadRecord)
    except Exception:
        return None


async def wait_done(b: Broker, name: str, within: float) -> WorkloadRecord:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        rec = await record(b, name)
        if rec is not None and rec.state != "active":
            assert rec.state == "done", (rec.state, rec.result)
            return rec
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{name} not done within {within}s: {rec}")
        await asyncio.sleep(0.2)


async def publish_next(store: PolicyStore, n: int = 1) -> int:
    """``n`` more versions of acme's "push" (the latest weights, nudged)."""
    for _ in range(n):
        rec = await store.latest("acme", "push")
        module = await store.load_module(rec)
        with torch.no_grad():
            for p in module.head.parameters():
                p.add_(0.01)
        rec = await store.publish("acme", "push", module, feature_schema_of(rec))
    return rec.version


async def test_every_k_versions_once_across_a_restart_with_videos_for_its_tenant_only(
    service: Service, broker: Broker, nats_server: EmbeddedNats, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    b = broker
    ns = b.names.namespace
    acme = await Client.connect(nats_server.url, tenant="acme", namespace=ns)
    bolt = await Client.connect(nats_server.url, tenant="bolt", namespace=ns)
    store = PolicyStore(b)
    ev1, stop1, task1 = service.start_evaluator("eval-1")
    try:
        spec = WorkloadSpec(
            name="push", task_type="rl", env="PushCube-v1", num_envs=1, horizon=8,
            eval_every=2, eval_episodes=1, eval_videos=1, video_frames=12, video_size=32,
        )
        # The tenant's quota bounds what it asks of the evaluator.
        with pytest.raises(QuotaExceeded, match="eval_videos"):
            await acme.create_workload(
                WorkloadSpec(name="greedy", task_type="rl", env="PushCube-v1", eval_every=1,
                             eval_episodes=5, eval_videos=5)
            )
        await acme.create_workload(spec)  # publishes v1: not a multiple of 2
        assert await publish_next(store, 2) == 3  # v2 (evaluated), then v3 at once
        v2 = await wait_done(b, "push-v2", within=90)
        # Pinned to its version although v3 was the latest while it ran.
        assert v2.periodic and v2.spec.init_from == 2 and v2.result["version"] == 2.0
        assert v2.result["episodes"] == 1.0 and 0.0 <= v2.result["success_rate"] <= 1.0
        assert await record(b, "push-v1") is None and await record(b, "push-v3") is None
        assert not await TrainingQueue(b).list_partitions("acme")  # no training work
        assert ev1.created == [b.names.workload_key("acme", "push-v2")]

        # The evaluator stops; v4 and v5 are published while none runs; a new one starts.
        stop1.set()
        await asyncio.wait_for(task1, 20)
        assert await publish_next(store, 2) == 5
        ev2, stop2, task2 = service.start_evaluator("eval-2")
        try:
            v4 = await wait_done(b, "push-v4", within=90)
            assert v4.spec.init_from == 4 and v4.result["version"] == 4.0
            # v4 was not lost, v2 was not evaluated again.
            assert ev2.created == [b.names.workload_key("acme", "push-v4")]
            assert ev2.done == 1 and ev1.done == 1
            assert (await record(b, "push-v2")) == v2
        finally:
            stop2.set()
            await asyncio.wait_for(task2, 20)

        history = await acme.eval_history("push")
        assert [h["version"] for h in history] == [2, 4]
        assert all(h["state"] == "done" and "success_rate" in h and "mean_return" in h
                   for h in history)
        assert history[0]["videos"] == v2.videos and len(v2.videos) == 1

        # The video: its tenant fetches it through the control plane; another cannot.
        data = await acme.fetch_video("push-v2", 0)
        frames = decode_frames(data)
        assert 2 <= len(frames) <= 12 and frames[0].shape == (32, 32, 3)
        with pytest.raises(UnknownTenant):
            await bolt.fetch_video("push-v2", 0)
        assert await bolt.eval_history("push") == []

        # The tenant's CLI: the history, the plot (PNG) and the videos.
        args = build_parser().parse_args([
            "evals", "push", "--url", nats_server.url, "--tenant", "acme", "--namespace", ns,
            "--plot", str(tmp_path / "push.png"), "--videos", str(tmp_path / "videos"), "--json",
        ])
        assert await _evals(args) == 0
        shown = json.loads(capsys.readouterr().out)
        assert [h["version"] for h in shown["history"]] == [2, 4]
        assert (tmp_path / "push.png").read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / "videos" / "push-v2" / v2.videos[0]).read_bytes() == data
    finally:
        stop1.set()
        await asyncio.wait_for(task1, 20)
        await acme.close()
        await bolt.close()


async def test_periodic_evaluations_run_within_the_tenants_eval_quota(
    service: Service, broker: Broker, nats_server: EmbeddedNats
) -> None:
    """eval_every=1 on a fast trainer (issue 24): at most max_concurrent_evals (2) of the
    tenant's evaluations run at once, its own included; the rest queue and all run,
    none lost; the tenant cannot add its own past the quota meanwhile."""
    b = broker
    acme = await Client.connect(nats_server.url, tenant="acme", namespace=b.names.namespace)
    store = PolicyStore(b)
    ev, stop, task = service.start_evaluator("eval-q")
    most = 0
    try:
        await acme.create_workload(WorkloadSpec(
            name="push", task_type="rl", env="PushCube-v1", num_envs=1, horizon=8,
            eval_every=1, eval_episodes=1))
        # v2..v4: three evaluations due at once (v1 is published before its record
        # exists: the evaluator sees no eval_every for it, as before)
        assert await publish_next(store, 3) == 4
        names = {periodic_eval_name("push", v) for v in range(2, 5)}
        refused = False
        deadline = asyncio.get_running_loop().time() + 180
        while True:
            # The records are read one KV get at a time, so one read can catch v2 active
            # and, a moment later, v4 active after v2 ended: never at once. Counted as
            # running together are those active in two reads in a row (each was active
            # from its first read to its second, so all were at the turn between them).
            before = {n for n, r in zip(names, [await record(b, n) for n in names], strict=True)
                      if r is not None and r.state == "active"}
            recs = [r for r in [await record(b, n) for n in names] if r is not None]
            running = [r for r in recs if r.spec.task_type == "eval" and r.state == "active"
                       and r.spec.name in before]
            most = max(most, len(running))
            if len(running) == 2 and not refused:
                with pytest.raises(QuotaExceeded, match="evaluations running"):
                    await acme.create_workload(WorkloadSpec(
                        name="mine", task_type="eval", env="PushCube-v1",
                        init_from_workload="push", episodes=1))
                refused = True
            done = {r.spec.name for r in recs if r.periodic and r.state == "done"}
            if done >= names:
                break
            assert asyncio.get_running_loop().time() < deadline, (done, ev.due)
            await asyncio.sleep(0.1)
        assert most == 2 and refused, most
        assert sorted(ev.created) == sorted(b.names.workload_key("acme", n) for n in names)
        assert [h["version"] for h in await acme.eval_history("push")] == [2, 3, 4]
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await acme.close()


class CountingStop:
    """A stop control: ``rounds`` rounds, then stop; halts after ``queries`` policy queries."""

    def __init__(self, rounds: int, queries: int | None = None) -> None:
        self.rounds, self.queries = rounds, queries
        self.begun = self.ended = self.asked = 0

    async def begin_round(self) -> bool:
        if self.begun >= self.rounds:
            return False
        self.begun += 1
        return True

    def end_round(self) -> None:
        self.ended += 1

    def halted(self) -> bool:
        self.asked += 1
        return self.queries is not None and self.asked > self.queries


async def test_the_shared_episode_loop_stops_when_its_control_says() -> None:
    def factory() -> Any:
        return make_env("PushCube-v1", obs="state", num_envs=1)

    policy = random_policy(task_spec("PushCube-v1", obs="state", num_envs=1), seed=1)
    # Stopped before its third round: two rounds (one episode each) counted, unfinished.
    ctl = CountingStop(rounds=2)
    result, finished = await run_episodes(factory, policy, episodes=6, max_steps=5, control=ctl)
    assert not finished and result["episodes"] == 2 and ctl.ended == 2
    # Halted within a round: the round is dropped, the turn handed back.
    ctl = CountingStop(rounds=5, queries=3)
    result, finished = await run_episodes(
        factory, policy, episodes=4, control=ctl, chunk="first"
    )
    assert not finished and result["episodes"] == 0 and ctl.begun == ctl.ended == 1
    assert ctl.asked == 4
    # No control: every episode, the statistics evaluate() returns.
    result, finished = await run_episodes(factory, policy, episodes=2, max_steps=5)
    assert finished and result["episodes"] == 2 and result["mean_length"] == 5.0


def test_episode_videos_keep_only_the_bounded_frames() -> None:
    videos = EpisodeVideos(1, "observation.images.cam", max_frames=5, size=16)
    rng = np.random.default_rng(0)
    for t in range(9):
        obs = {"observation.images.cam": rng.integers(0, 255, (2, 3, 64, 64), dtype=np.uint8)}
        videos.observe([0, 1], obs, np.array([t < 7, True]))  # episode 1 is not recorded
    (name, data), = videos.encoded()
    frames = decode_frames(data)
    assert name.startswith("episode-0.") and len(frames) == 5 and frames[0].shape == (16, 16, 3)
    assert periodic_eval_name("a" * 32, 10**6).endswith("-v1000000")
    assert len(periodic_eval_name("a" * 32, 10**6)) == 32


def test_the_main_job_report_plots_success_against_version(tmp_path: Path) -> None:
    history = [{"version": 4, "success_rate": 0.5, "mean_return": 9.0},
               {"version": 2, "success_rate": 0.25, "mean_return": 7.0},
               {"version": 6, "state": "active"}]  # not done yet: no point
    md = write_paper_report(tmp_path, {
        "runs": {"shared": {"tenants": {"acme": {"eval_history": history},
                                        "bolt": {"final_version": 9, "eval_success": 1.0}}}},
    })
    png = tmp_path / "plots" / "eval_curves.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = md.read_text()
    assert "## Evaluation by version" in text and "plots/eval_curves.png" in text
    assert "| acme | 2 | - | 0.25 | - | 7 |" in text and "| bolt | 9 | - | 1 | - | - |" in text


def test_dataset_generate_progress_bar_shows_from_the_start() -> None:
    import io

    from joynexus.ops.admin.progress import Progress

    out = io.StringIO()
    bar = Progress(4, "PushCube-v1", out)
    for kept, tried in ((0, 0), (1, 1), (2, 3), (4, 5)):
        bar(kept, tried)
    lines = out.getvalue().splitlines()
    assert "0/4 episodes, starting the simulator" in lines[0]
    assert lines[-1].startswith("PushCube-v1 [" + "#" * 30 + "] 4/4 episodes (5 tried)")


def test_evaluations_are_clearml_scalars_against_their_version() -> None:
    from joynexus.agents.monitor import Metric, MetricAggregates

    agg = MetricAggregates()
    scalars = agg.apply(Metric("learning", "acme", 1.0, {
        "workload": "push", "evaluation": "push-v4", "eval_success": 0.5, "eval_return": 3.0,
        "version": 4,
    }))
    got = {(s.title, s.series, s.iteration, s.value) for s in scalars}
    assert {("eval_success", "acme", 4, 0.5), ("eval_return", "acme", 4, 3.0)} <= got
    assert agg.tenants["acme"].evals[-1]["evaluation"] == "push-v4"
