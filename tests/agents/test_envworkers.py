"""Environment worker pool decisions (no processes) and how status counts workers."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from joynexus.agents.envworkers import EnvSupervisor
from joynexus.ops.admin.status import env_workers, render
from joynexus.schemas.workloads import Scheduling, WorkloadRecord, WorkloadSpec


class _Manager:
    def __init__(self) -> None:
        self.details: dict[str, str] = {}
        self.added: list[str] = []

    def add_slot(self, slot: Any) -> None:
        self.added.append(slot.instance)

    async def remove_slot(self, instance: str) -> int:
        return 0


class _KV:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def delete(self, key: str) -> None:
        self.values.pop(key, None)


def _rec(tenant: str, rollouts: int, at: float) -> WorkloadRecord:
    spec = WorkloadSpec(
        name="rl", task_type="rl", env="PickCube-v1",
        scheduling=Scheduling(max_in_flight=4, max_active_rollouts=rollouts),
    )
    return WorkloadRecord(tenant_id=tenant, spec=spec, created_at=at)


async def test_pool_assigns_warm_spares_first_and_takes_workers_back() -> None:
    import asyncio
    from types import SimpleNamespace

    from joynexus.broker.subjects import Names

    b = SimpleNamespace(names=Names("jnx"))
    sup = EnvSupervisor(b, instance="p", url="nats://x", spares=1, max_workers=4, release_grace_s=0.0)  # type: ignore[arg-type]
    sup.manager, sup.kv = _Manager(), _KV()  # type: ignore[assignment]
    failed: list[tuple[Any, list[str]]] = []

    async def fail_jobs_of(instances: Any, keys: list[str]) -> bool:
        failed.append((instances, keys))
        return True

    sup._fail_jobs_of = fail_jobs_of  # type: ignore[method-assign]
    await sup.reconcile()  # nothing active: one spare
    assert sup.pool == {"p-w0": ""}
    sup.warm.add("p-w0")
    sup.active = {"acme.rl": _rec("acme", 2, 1.0), "bolt.rl": _rec("bolt", 1, 2.0)}
    await sup.reconcile()
    # acme (older) takes the warm spare and one new worker, bolt one, plus a new spare;
    # the cap (4) is reached, so no spare is left.
    assert sup.pool["p-w0"] == "acme.rl"
    assert sorted(sup.pool.values()).count("acme.rl") == 2
    assert list(sup.pool.values()).count("bolt.rl") == 1 and len(sup.pool) == 4
    # Jobs left by a previous incarnation's workers are failed before any assignment.
    assert (None, ["acme.rl"]) in failed and (None, ["bolt.rl"]) in failed
    assert sup.manager.details["p-w0"] == "acme.rl"  # type: ignore[attr-defined]
    # acme is done: its workers go back to standby; spares beyond 1 are stopped.
    sup.done.add("acme.rl")
    await sup.reconcile()
    assert list(sup.pool.values()).count("bolt.rl") == 1
    assert list(sup.pool.values()).count("") == 1 and len(sup.pool) == 2
    await asyncio.gather(*sup._tasks, *sup._releases)


async def test_a_worker_taken_off_a_cancelled_workload_has_its_jobs_failed() -> None:
    """A cancel puts the workload's workers on standby and stops the spares too many:
    the jobs a stopped worker left are looked for in the workload it served (not in
    the workloads still active), and a worker that stays on standby has whatever it
    still holds of that workload failed after the grace."""
    import asyncio
    from types import SimpleNamespace

    from joynexus.agents.envworkers import Assignment
    from joynexus.broker.subjects import Names

    b = SimpleNamespace(names=Names("jnx"))
    sup = EnvSupervisor(b, instance="p", url="nats://x", spares=1, max_workers=4, release_grace_s=0.0)  # type: ignore[arg-type]
    sup.manager, sup.kv = _Manager(), _KV()  # type: ignore[assignment]
    failed: list[tuple[Any, list[str]]] = []

    async def fail_jobs_of(instances: Any, keys: list[str]) -> bool:
        failed.append((instances, sorted(keys)))
        return True

    sup._fail_jobs_of = fail_jobs_of  # type: ignore[method-assign]
    sup.active = {"acme.rl": _rec("acme", 2, 1.0), "bolt.rl": _rec("bolt", 1, 2.0)}
    await sup.reconcile()
    acme = sorted(i for i, k in sup.pool.items() if k == "acme.rl")
    assert len(acme) == 2
    sup.warm.update(acme)  # warm: the cold spare is stopped first, then one of these
    failed.clear()
    del sup.active["acme.rl"]  # cancelled: the watcher drops it
    await sup.reconcile()
    await asyncio.gather(*sup._tasks, *sup._releases)
    # One of acme's two workers stays a spare, the other is stopped; both have their
    # acme jobs failed (the stopped one once it is gone, the spare after the grace).
    standby = [i for i in acme if sup.pool.get(i) == ""]
    stopped = [i for i in acme if i not in sup.pool]
    assert len(standby) == 1 and len(stopped) == 1
    for inst in acme:
        assert ({inst}, ["acme.rl"]) in failed, failed
    assert not any("bolt.rl" in keys for _, keys in failed)
    # The spare's assignment names what it served, for a restart that comes first.
    a = msgspec.json.decode(sup.kv.values[f"env.{standby[0]}"], type=Assignment)  # type: ignore[attr-defined]
    assert (a.workload, a.previous) == ("", "acme.rl")


def test_status_counts_env_workers_per_workload() -> None:
    managers = [
        {
            "instance": "producer-rl-0",
            "mode": "supervise",
            "slots": [
                {"role": "env-worker", "instance": "producer-rl-0-w0", "state": "running",
                 "detail": "acme.rl", "pid": 1, "restarts": 1},
                {"role": "env-worker", "instance": "producer-rl-0-w1", "state": "running",
                 "detail": "acme.rl", "pid": 2},
                {"role": "env-worker", "instance": "producer-rl-0-w2", "state": "starting",
                 "detail": "", "pid": 3},
            ],
            "decisions": [],
        }
    ]
    ew = env_workers(managers)
    assert ew["by_workload"] == {"acme.rl": 2} and ew["standby"] == 1
    text = render({
        "namespace": "jnx", "scheduler": {"error": "x"}, "streams": {}, "consumers": {},
        "env_workers": ew, "agents": {"heartbeats": [], "managers": managers},
    })
    assert "Environment workers: 3 (acme.rl 2; standby 1)" in text
    assert "Health manager producer-rl-0" not in text  # its slots are the table above


def test_main_job_accounts_worker_lanes_and_tenants_per_batch() -> None:
    from joynexus.ops.mainjob.accounting import account as _account
    from joynexus.ops.mainjob.config import PaperConfig, PhaseResult, base_tenant, plans

    assert base_tenant("acme2") == "acme" and [p.tenant for p in plans(PaperConfig(), "d", 1)] == [
        "acme1", "bolt1", "cora1", "dana1"]
    metrics = [
        {"kind": "system", "service": "env", "busy_start": 10.0, "busy_end": 12.0,
         "instance": "producer-rl-0-w1", "tenant": "acme1", "steps": 16},
        {"kind": "system", "service": "infer", "busy_start": 10.5, "busy_end": 10.6,
         "tenants": 2, "requests": 3},
        {"kind": "system", "service": "infer", "busy_start": 11.0, "busy_end": 11.1,
         "tenants": 1, "requests": 1},
        {"kind": "system", "service": "infer", "busy_start": 30.0, "busy_end": 30.1,
         "tenants": 3, "requests": 3},  # outside the window
    ]
    r = PhaseResult("shared")
    _account(r, metrics, [(10.0, 20.0)], {"acme1"})
    assert r.intervals["env acme w1"] == [(0.0, 2.0)] and r.env_steps == 16
    assert r.mean_tenants_per_batch() == 1.5


def test_the_main_job_draws_learning_curves_in_runs_of_a_few_minutes() -> None:
    """Curves are evaluated after the windows (no periodic evaluation inside one);
    the ManiSkill tenants start from their task's SFT head, critic first."""
    from joynexus.ops.mainjob.config import PaperConfig, plans
    from joynexus.ops.mainjob.phases import curve_versions

    cfg = PaperConfig.for_minutes(4)
    assert cfg.eval_points == 3 and cfg.eval_episodes == 10 and PaperConfig.for_minutes(0.4).eval_points == 2
    assert curve_versions(11, 3) == [1, 6, 11] and curve_versions(11, 2) == [1, 11]
    assert curve_versions(1, 3) == [1] and curve_versions(3, 5) == [1, 2, 3]
    rl = {p.spec.env: p.spec for p in plans(cfg, "d") if p.spec.task_type == "rl"}
    assert all(s.eval_every == 0 for s in rl.values())
    for env in ("PickCube-v1", "PushCube-v1"):
        s = rl[env]
        assert s.init_from_export == f"heads/{env}" and s.state == ["privileged"]
        assert s.warmup_updates() == cfg.rl_updates // 3 and s.learning_rate == 1e-4
    assert not rl["LIBERO-spatial-0"].init_from_export


def test_the_rl_producers_decisions_around_a_reserve() -> None:
    """RLProducer.run's pure steps: the backoff after refusals, which refusal ends
    the run, and where a produced job goes next."""
    from joynexus.agents.producers.rl import BACKOFF, after_rollout
    from joynexus.agents.scheduler_client import ends_run
    from joynexus.schemas.jobs import JobMetadata, JobState, TrainingJob

    waits = [BACKOFF.first_s]
    for _ in range(6):
        waits.append(BACKOFF.next(waits[-1]))
    assert waits == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    # Decided by the scheduler's refusal code, never its words.
    assert ends_run("ended", True) and ends_run("superseded", True)
    assert not ends_run("ended", False)
    for waited in ("in_flight", "rollouts", "global_rollouts", "completion_target", ""):
        assert not ends_run(waited, True)

    def job(extra: dict[str, str]) -> TrainingJob:
        return TrainingJob(
            job_id="j", tenant_id="acme", task_type="rl", workload="pick",
            partition_id="p", metadata=JobMetadata(extra=extra),
        )

    assert after_rollout(job({"actor_forward": "1"})) is JobState.NEEDS_ACTOR_FORWARD
    assert after_rollout(job({})) is JobState.NEEDS_ADVANTAGES
    assert after_rollout(job({"actor_forward": "0"})) is JobState.NEEDS_ADVANTAGES


def test_the_envs_a_worker_warms() -> None:
    """$JOYNEXUS_ENV_WARM: the env each worker builds and resets before it is ready, one
    per worker in turn (LIBERO's first env costs ~40 s here, ManiSkill's ~18 s, and a
    worker holding both kinds ~3.5 GB); default PickCube-v1; a name that is no env is
    refused with the fix. A workload takes an idle worker warmed for its kind first."""
    from joynexus.agents.envworkers.assign import (
        WARM_ENV,
        prefer_warmed,
        warm_envs,
        warm_for,
        worker_env,
    )

    assert warm_envs({}) == ("PickCube-v1",)
    plan = warm_envs({WARM_ENV: " PickCube-v1, PushCube-v1,LIBERO-spatial-0 "})
    assert plan == ("PickCube-v1", "PushCube-v1", "LIBERO-spatial-0")
    assert [warm_for(k, plan) for k in range(4)] == [*plan, "PickCube-v1"]
    assert warm_envs({WARM_ENV: "PickCube-v1,PickCube-v1"}) == ("PickCube-v1",)
    with pytest.raises(ValueError, match="LIBERO-nope-3 not an environment name"):
        warm_envs({WARM_ENV: "PickCube-v1,LIBERO-nope-3"})
    assert worker_env("LIBERO-spatial-0")[WARM_ENV] == "LIBERO-spatial-0"
    assert WARM_ENV not in worker_env()
    warmed = {"w0": "maniskill", "w1": "maniskill", "w2": "libero", "w3": "libero"}
    started = {"w0", "w1", "w2"}  # w3 still starting
    assert prefer_warmed(["w0", "w1", "w2", "w3"], "libero", warmed, started)[:2] == ["w2", "w3"]
    assert prefer_warmed(["w3", "w2", "w0"], "maniskill", warmed, started) == ["w0", "w2", "w3"]
    assert prefer_warmed(["w3", "w0"], "libero", warmed, started) == ["w3", "w0"]


async def test_a_workers_idle_envs_are_bounded_and_keyed_by_their_build() -> None:
    """The env pool gives an env only to the same build (the seed aside), keeps at most
    its capacity idle (least recently used closed first), closes on replacement, and
    refuses a bad ``$JOYNEXUS_ENV_POOL``. A workload then takes the worker keeping its
    env built first."""
    from joynexus.agents.envs.pool import POOL_ENV, EnvPool, build_key, pool_capacity
    from joynexus.agents.envworkers.assign import prefer_warmed

    class Env:
        closed = 0

        def close(self) -> None:
            Env.closed += 1

    pick = build_key("PickCube-v1", obs="rgb", num_envs=2, image_size=64,
                     cameras=["base_camera"], state_keys=["privileged"])
    push = build_key("PushCube-v1", obs="rgb", num_envs=2, image_size=64,
                     cameras=["base_camera"])
    lib = build_key("LIBERO-spatial-0", obs="rgb", num_envs=1, image_size=64)
    assert pick == build_key("PickCube-v1", obs="rgb", num_envs=2, image_size=64,
                             cameras=("base_camera",), state_keys=("privileged",))
    assert pick != build_key("PickCube-v1", obs="rgb", num_envs=1, image_size=64,
                             cameras=["base_camera"], state_keys=["privileged"])
    pool = EnvPool(capacity=2)
    a, b, c = Env(), Env(), Env()
    await pool.give(pick, a)
    await pool.give(push, b)
    assert pool.names() == ["PickCube-v1", "PushCube-v1"] and Env.closed == 0
    assert pool.take(lib) is None  # another build: not given
    assert pool.take(pick) is a and pool.take(pick) is None  # once
    await pool.give(pick, a)
    await pool.give(lib, c)  # over capacity: push (least recently used) is closed
    assert Env.closed == 1 and pool.names() == ["LIBERO-spatial-0", "PickCube-v1"]
    await pool.give(pick, Env())  # the same build again: the older one is closed
    assert Env.closed == 2 and len(pool) == 2
    # A workload building PickCube another way closes the idle PickCube first.
    other_pick = build_key("PickCube-v1", obs="rgb", num_envs=1, image_size=64)
    assert pool.take(other_pick) is None
    assert await pool.evict("PickCube-v1") == 1 and Env.closed == 3
    assert pool.names() == ["LIBERO-spatial-0"] and await pool.evict("PickCube-v1") == 0
    await pool.close()
    assert Env.closed == 4 and len(pool) == 0
    off = EnvPool(capacity=0)
    await off.give(pick, Env())
    assert len(off) == 0 and Env.closed == 5
    assert (off.hits, off.misses, pool.hits, pool.misses) == (0, 0, 1, 3)
    assert pool_capacity({}) == 2 and pool_capacity({POOL_ENV: "0"}) == 0
    for bad in ("-1", "two"):
        with pytest.raises(ValueError, match=POOL_ENV):
            pool_capacity({POOL_ENV: bad})
    warmed = {"w0": "maniskill", "w1": "maniskill", "w2": "libero"}
    started = {"w0", "w1", "w2"}
    pooled = {"w1": {"PushCube-v1"}, "w2": {"PickCube-v1"}}
    assert prefer_warmed(["w0", "w1", "w2"], "maniskill", warmed, started,
                         env="PushCube-v1", pooled=pooled) == ["w1", "w0", "w2"]
    # A worker of the other kind that keeps the env built beats a warmed one without.
    assert prefer_warmed(["w0", "w1", "w2"], "maniskill", warmed, started,
                         env="PickCube-v1", pooled=pooled)[0] == "w2"
    assert prefer_warmed(["w0", "w1"], "maniskill", warmed, started) == ["w0", "w1"]
