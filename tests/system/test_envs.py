"""Simulators and demonstration datasets: ManiSkill on CPU, scripted experts, LeRobot I/O.

Needs the system libraries from ``ops/system_setup.sh`` (lavapipe) on a
machine without a GPU. The first rgb env of the session starts the renderer
(~10-20 s); everything else is small on purpose (whole file ~1 min on 2 cores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from joynexus.agents.envs.experts import ScriptedExpert
from joynexus.agents.envs.lerobot_data import (
    DatasetInfo,
    generate_dataset,
    load_dataset,
)
from joynexus.agents.envs.maniskill import (
    ACTION,
    OBS_STATE,
    TASK,
    TASKS,
    ObsBatch,
    evaluate,
    make_env,
    policy_obs,
    random_policy,
    rollout,
    rollout_fields,
    task_spec,
)
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch

# Library noise under numpy 2 (ManiSkill's action check, datasets' scalar features).
pytestmark = [
    pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

ALL_TASKS = ["PickCube-v1", "PushCube-v1", "StackCube-v1"]


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(InvalidSpec) as err:
        make_env("OpenCabinetDrawer-v1", obs="state")
    msg = str(err.value)
    assert "OpenCabinetDrawer-v1" in msg and "PickCube-v1" in msg and "download" in msg
    assert isinstance(err.value, ValueError)
    with pytest.raises(InvalidSpec, match="cameras"):
        task_spec("PickCube-v1", obs="rgb", cameras=["wrist"])
    with pytest.raises(InvalidSpec, match="control_mode"):
        task_spec("PickCube-v1", control_mode="pd_ee_velocity")


@pytest.mark.parametrize("task", ALL_TASKS)
def test_state_env_steps(task: str) -> None:
    with make_env(task, obs="state", seed=1) as env:
        spec = env.spec
        assert spec.state_dim == TASKS[task].flat_state_dim and spec.action_dim == 4
        obs = env.reset(seed=3)
        assert obs[OBS_STATE].dtype == np.float32 and obs[OBS_STATE].shape == (1, spec.state_dim)
        assert obs[TASK] == [TASKS[task].instruction]
        assert not any(k.startswith("observation.images") for k in obs)
        res = None
        for _ in range(3):
            res = env.step(np.zeros((1, 4), np.float32))
        assert res is not None
        assert res.reward_N.shape == (1,) and res.reward_N.dtype == np.float32
        assert res.terminated_N.dtype == bool and res.success_N.shape == (1,)
        # the robot moved the state along (gripper opening from the zero action)
        assert res.obs[OBS_STATE].shape == (1, spec.state_dim)
        with pytest.raises(ShapeMismatch, match="action_dim"):
            env.step(np.zeros((1, 7), np.float32))


@pytest.mark.parametrize("task", ALL_TASKS)
def test_rgb_env_steps(task: str) -> None:
    size = 32
    with make_env(task, obs="rgb", image_size=size, seed=0) as env:
        spec = env.spec
        assert spec.image_keys == ("observation.images.base_camera",)
        obs = env.reset(seed=0)
        img = obs["observation.images.base_camera"]
        assert img.dtype == np.uint8 and img.shape == (1, 3, size, size)
        assert img.std() > 5  # a rendered scene, not a blank frame
        assert obs[OBS_STATE].shape == (1, spec.state_dim) and obs[OBS_STATE].dtype == np.float32
        res = env.step(np.array([[0.0, 0.0, 1.0, 1.0]], np.float32))  # move up
        img2 = res.obs["observation.images.base_camera"]
        assert img2.shape == (1, 3, size, size) and img2.dtype == np.uint8
        assert not np.array_equal(img, img2)  # the arm moved in view


async def test_rollout_batches_and_resets() -> None:
    env = make_env("PickCube-v1", obs="state", num_envs=2)
    expert = ScriptedExpert(env)
    calls: list[ObsBatch] = []

    async def act(obs: ObsBatch) -> np.ndarray:
        calls.append(obs)
        return await expert(obs)

    horizon = 45  # longer than one expert episode (~20 steps): forces auto-resets
    try:
        out = await rollout(env, act, horizon=horizon, seed=5)
    finally:
        env.close()
    M = 2 * horizon
    assert len(calls) == horizon  # single-step actions: one policy call per step
    assert calls[0][OBS_STATE].shape == (2, 42)
    assert calls[0][TASK] == [TASKS["PickCube-v1"].instruction] * 2
    assert set(out) == set(rollout_fields(env.spec))
    for key, arr in out.items():
        assert isinstance(arr, np.ndarray) and arr.dtype != object, key
        assert arr.shape[0] == M, key
    assert out["obs_state"].shape == (M, 42) and out["obs_state"].dtype == np.float32
    # the executed action is "action" [M, A]; "actions" is the chunk learned from it
    assert out["action"].shape == (M, 4) and out["action"].dtype == np.float32
    assert "actions" not in out
    assert out["rewards"].shape == (M,) and out["success"].dtype == bool
    # env-major layout, frame counters restart after each episode
    assert (out["env_id"][:horizon] == 0).all() and (out["env_id"][horizon:] == 1).all()
    assert (out["step"][:horizon] == np.arange(horizon)).all()
    assert out["success"].sum() >= 2  # the expert solved episodes in both envs
    ends = np.flatnonzero(out["dones"][:horizon])
    assert len(ends) >= 1 and out["frame_index"][ends[0] + 1] == 0
    assert out["episode_index"][ends[0] + 1] == out["episode_index"][ends[0]] + 1
    # distinct seeds per env: the two envs start from different states
    assert not np.allclose(out["obs_state"][0], out["obs_state"][horizon])
    # the recorded observation is the one the policy acted on
    assert np.array_equal(policy_obs(out, env.spec)[OBS_STATE][:1], calls[0][OBS_STATE][:1])


async def test_rollout_rgb_with_action_chunks(broker: Broker) -> None:
    env = make_env(
        "PushCube-v1",
        obs="rgb",
        num_envs=2,
        image_size=32,
        cameras=["base_camera", "render_camera"],
    )
    calls = 0

    async def act_chunk(obs: ObsBatch) -> np.ndarray:
        nonlocal calls
        calls += 1
        for cam in ("base_camera", "render_camera"):
            assert obs[f"observation.images.{cam}"].shape == (2, 3, 32, 32)
        return np.zeros((2, 3, 4), np.float32)  # a chunk of 3 steps

    try:
        out = await rollout(env, act_chunk, horizon=6, seed=0)
    finally:
        env.close()
    assert calls == 2  # executed open-loop: 6 steps / chunks of 3
    assert out["obs_image_render_camera"].shape == (12, 3, 32, 32)
    assert out["obs_image_base_camera"].dtype == np.uint8
    assert out["action"].shape == (12, 4) and out["obs_state"].shape == (12, 9)
    # ready for a Training Queue put: the fields go in and come back bit-exact
    tq = TrainingQueue(broker)
    put = await tq.async_put(out, tenant_id="acme", partition_id="rollout1")
    assert put.rows == list(range(12))
    meta = await tq.async_get_meta(
        list(out), 100, tenant_id="acme", partition_id="rollout1", task_name="train"
    )
    got = await tq.async_get_data(meta)
    for key, arr in out.items():
        assert got[key].dtype == arr.dtype and np.array_equal(got[key], arr), key


async def test_expert_beats_random_policy() -> None:
    def factory() -> Any:
        return make_env("PickCube-v1", obs="state")

    env = factory()
    expert_report = await evaluate(lambda: env, ScriptedExpert(env), episodes=6, seed=11)
    random_report = await evaluate(factory, random_policy(env.spec, seed=0), episodes=4, seed=11)
    # measured: the PickCube expert solves 100% of 30 seeded episodes on CPU backends
    assert expert_report["episodes"] == 6
    assert expert_report["success_rate"] >= 0.8, expert_report
    assert random_report["success_rate"] < expert_report["success_rate"], random_report
    assert expert_report["mean_return"] > random_report["mean_return"]
    assert expert_report["mean_length"] < 50  # PickCube ends an episode at success


async def test_push_cube_expert_succeeds() -> None:
    env = make_env("PushCube-v1", obs="state", control_mode="pd_ee_delta_pose")
    report = await evaluate(lambda: env, ScriptedExpert(env), episodes=5, seed=3)
    assert report["success_rate"] >= 0.8, report  # measured 100% of 30


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[DatasetInfo, DatasetInfo]:
    root = tmp_path_factory.mktemp("lerobot")
    pick = generate_dataset(
        "PickCube-v1", root / "pick", episodes=2, obs="rgb", image_size=64, seed=0
    )
    push = generate_dataset(
        "PushCube-v1",
        root / "push",
        episodes=2,
        obs="rgb",
        image_size=48,
        seed=0,
        cameras=["base_camera", "render_camera"],
        control_mode="pd_ee_delta_pose",
    )
    return pick, push


def test_dataset_roundtrip(datasets: tuple[DatasetInfo, DatasetInfo]) -> None:
    pick, _ = datasets
    assert pick.episodes == 2 and pick.frames > 2
    assert (pick.root / "meta" / "info.json").is_file()
    ds = load_dataset(pick.root, pick.repo_id)
    assert len(ds) == pick.frames and ds.num_episodes == 2
    assert set(ds.features) >= {"observation.images.base_camera", OBS_STATE, ACTION, "next.success"}
    item = ds[0]
    img = item["observation.images.base_camera"]
    assert img.dtype.is_floating_point is False and str(img.dtype) == "torch.uint8"
    assert tuple(img.shape) == (3, 64, 64) and img.float().std() > 5
    assert tuple(item[OBS_STATE].shape) == (12,) and str(item[OBS_STATE].dtype) == "torch.float32"
    assert tuple(item[ACTION].shape) == (4,) and item[TASK] == TASKS["PickCube-v1"].instruction
    # every kept episode ends in success
    last = ds.lerobot.hf_dataset[len(ds) - 1]
    assert bool(last["next.success"].reshape(-1)[0])


def test_dataset_action_chunks(datasets: tuple[DatasetInfo, DatasetInfo]) -> None:
    pick, _ = datasets
    ds = load_dataset(pick.root, pick.repo_id, action_horizon=5)
    last = ds[len(ds) - 1]
    assert tuple(last[ACTION].shape) == (5, 4)
    assert last["action_is_pad"].tolist() == [False, True, True, True, True]
    first = ds[0]
    assert not first["action_is_pad"].any()
    assert np.allclose(first[ACTION][1].numpy(), ds[1][ACTION][0].numpy())


def test_datasets_have_different_schemas(datasets: tuple[DatasetInfo, DatasetInfo]) -> None:
    pick, push = datasets
    ds = load_dataset(push.root, push.repo_id)
    item = ds[0]
    assert set(ds.image_keys) == {
        "observation.images.base_camera",
        "observation.images.render_camera",
    }
    assert tuple(item["observation.images.render_camera"].shape) == (3, 48, 48)
    assert tuple(item[OBS_STATE].shape) == (9,) and tuple(item[ACTION].shape) == (7,)
    assert pick.features.keys() != push.features.keys()
    assert pick.features[ACTION]["shape"] != push.features[ACTION]["shape"]


def test_dataset_root_must_be_new(
    datasets: tuple[DatasetInfo, DatasetInfo], tmp_path: Path
) -> None:
    pick, _ = datasets
    with pytest.raises(InvalidSpec, match="already exists"):
        generate_dataset("PickCube-v1", pick.root, episodes=1)
    with pytest.raises(InvalidSpec, match="not a LeRobot dataset"):
        load_dataset(tmp_path)


def test_privileged_state_is_the_simulators_and_presets_expand() -> None:
    from joynexus.agents.envs.experts import _p
    from joynexus.agents.envs.maniskill import STATE_PRESETS, resolve_state_keys

    assert resolve_state_keys("PushCube-v1", ["proprio"]) == ("agent/qpos",)
    keys = resolve_state_keys("PushCube-v1", ["agent/qpos", "privileged"])
    assert keys == STATE_PRESETS["privileged"]["PushCube-v1"]  # no repeats, in order
    with pytest.raises(InvalidSpec, match="does not exist in PushCube-v1"):
        task_spec("PushCube-v1", obs="rgb", state_keys=["extra/cubeA_pose"])
    spec = task_spec("PushCube-v1", obs="rgb", state_keys=["extra/tcp_to_obj_pos", "extra/goal_pos"])
    assert spec.state_dim == 6
    with make_env("PushCube-v1", obs="rgb", image_size=32,
                  state_keys=["extra/tcp_to_obj_pos", "extra/goal_pos"]) as env:
        obs = env.reset(seed=3)
        sim = env.sims[0]
        want = np.concatenate([_p(sim.obj) - _p(sim.agent.tcp), _p(sim.goal_region)])
        assert np.allclose(obs[OBS_STATE][0], want, atol=1e-5)
        res = env.step(np.array([[0.5, 0.0, 0.0, 1.0]], dtype=np.float32))
        sim = env.sims[0]
        want = np.concatenate([_p(sim.obj) - _p(sim.agent.tcp), _p(sim.goal_region)])
        assert np.allclose(res.obs[OBS_STATE][0], want, atol=1e-5)


def test_dataset_records_its_observation_and_stats(tmp_path: Path) -> None:
    from joynexus.agents.envs.lerobot_data import dataset_stats, read_observation_meta

    seen: list[tuple[int, int]] = []
    info = generate_dataset("PushCube-v1", tmp_path / "push", episodes=1, image_size=32,
                            state_keys=["privileged"], progress=lambda k, a: seen.append((k, a)))
    assert seen[-1] == (1, info.attempts)
    meta = read_observation_meta(info.root)
    assert meta is not None and meta["task"] == "PushCube-v1"
    assert tuple(meta["state_keys"]) == info.spec.state_keys and info.spec.state_dim == 32
    names = info.features[OBS_STATE]["names"]
    assert names[0] == "agent/qpos.0" and names[-1] == "extra/obj_to_goal_pos.2"
    stats = dataset_stats(info.root)
    assert len(stats[OBS_STATE]["mean"]) == 32 and len(stats[ACTION]["std"]) == 4
    assert read_observation_meta(tmp_path) is None
    # the service reads the same choice: an SFT workload's schema names the dataset's
    # state keys (so rollouts and evaluation of its policy get that state), and a spec
    # that names another state is refused
    from joynexus.agents.producers import normalization_stats, workload_schema
    from joynexus.schemas.workloads import WorkloadSpec

    sft = WorkloadSpec(name="s", task_type="sft", dataset=str(info.root))
    schema, _ = workload_schema(sft)
    assert schema.state_keys == info.spec.state_keys and schema.state_dim == 32
    assert "|obs=agent/qpos," in schema.signature()
    ev = WorkloadSpec(name="e", task_type="eval", env="PushCube-v1", init_from_workload="s",
                      state=["privileged"], image_size=32)
    assert workload_schema(ev)[0].signature() == schema.signature()
    with pytest.raises(InvalidSpec, match="dataset recorded"):
        workload_schema(WorkloadSpec(name="s", task_type="sft", dataset=str(info.root),
                                     state=["proprio"]))
    assert len(normalization_stats(sft)[OBS_STATE]["mean"]) == 32


def test_decision_lengths_mark_where_the_policy_decided_and_how_long_its_chunk_ran() -> None:
    from joynexus.agents.actor.forward import chunk_mask
    from joynexus.agents.producers import decision_lengths

    # two envs x 6 steps, rows shuffled: env 0 ran a 4-step chunk then 2 steps of the
    # next; env 1 ran a 1-step chunk (its episode ended), then a 4-step one, then 1 step.
    cs = np.array([0, 1, 2, 3, 0, 1, 0, 0, 1, 2, 3, 0])
    env = np.array([0] * 6 + [1] * 6)
    step = np.array(list(range(6)) * 2)
    perm = np.random.default_rng(0).permutation(12)
    n = decision_lengths(cs[perm], env[perm], step[perm])
    expect = np.array([4, 0, 0, 0, 2, 0, 1, 4, 0, 0, 0, 1])
    assert np.array_equal(n, expect[perm])
    assert chunk_mask(expect, 4)[0].tolist() == [True] * 4
    assert chunk_mask(expect, 4)[4].tolist() == [True, True, False, False]
    assert not chunk_mask(expect, 4)[1].any()


def test_concurrent_first_env_builds_in_a_fresh_process_all_succeed() -> None:
    """Three threads build their first ManiSkill env at once in a new interpreter, as the
    evaluator's concurrent evaluations do: every build succeeds (the first one holds
    a lock; concurrent first imports once left matplotlib half initialised and broke
    every later build in the process)."""
    import subprocess
    import sys

    code = (
        "import concurrent.futures as f\n"
        "from joynexus.agents.envs.maniskill.env import make_env\n"
        "def one(i):\n"
        "    env = make_env('PushCube-v1', obs='rgb', image_size=64, seed=i)\n"
        "    env.close()\n"
        "    return i\n"
        "with f.ThreadPoolExecutor(3) as ex:\n"
        "    print(sorted(ex.map(one, range(3))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[0, 1, 2]"
