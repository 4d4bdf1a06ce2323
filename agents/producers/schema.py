"""A workload's sample layout: its feature schema (from its ManiSkill task, or
from its LeRobot dataset's ``meta/info.json``), the backbone's feature width,
normalisation statistics, and the pure builders of training targets (action
chunks, decision lengths). The field names live in :mod:`joynexus.schemas.samples`.

Light (no torch, no simulator, no lerobot): the control plane calls all of it. The
readers of a generated dataset's meta files (:func:`read_observation_meta`,
:func:`dataset_stats`) are :mod:`joynexus.agents.envs.lerobot_meta`'s, the light
module that :mod:`joynexus.agents.envs.lerobot_data` takes them from too.

See docs/ARCHITECTURE.md ("Layout and import root",
"Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from joynexus.agents.envs.lerobot_meta import (
    OBSERVATION_FILE,
    dataset_stats,
    read_observation_meta,
)
from joynexus.agents.featureschema import FeatureSchema, feature_dim
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.samples import ACTION, OBS_IMAGES, OBS_STATE
from joynexus.schemas.workloads import WorkloadSpec

__all__ = [
    "EXPLORATION_STD",
    "MAX_INFO_BYTES",
    "OBSERVATION_FILE",
    "chunk_targets",
    "dataset_stats",
    "decision_lengths",
    "feature_dim",
    "normalization_stats",
    "read_observation_meta",
    "unusable_dataset",
    "workload_schema",
]

#: RL: Gaussian exploration (env action units) for heads without a learned std.
EXPLORATION_STD = 0.1


def unusable_dataset(spec: WorkloadSpec) -> InvalidSpec:
    """The one error of a dataset that cannot be trained on (its contents and path unsaid)."""
    return InvalidSpec(
        f"the dataset of workload {spec.name!r} is not a usable LeRobot dataset: it needs "
        f"{OBS_IMAGES}.<camera>, {OBS_STATE} and {ACTION} features; ask your operator"
    )


#: meta/info.json larger than this is not read (a dataset's is a few KiB).
MAX_INFO_BYTES = 4 << 20



def _dataset_layout(root: Path) -> tuple[list[str], tuple[int, int], int, int]:
    """(cameras, image (h, w), state dim, action dim) from a LeRobot dataset's
    meta/info.json; any error if it is not one."""
    info_path = root / "meta" / "info.json"
    if not info_path.is_file() or info_path.stat().st_size > MAX_INFO_BYTES:
        raise ValueError("not a dataset")
    feats = json.loads(info_path.read_text())["features"]
    if not isinstance(feats, dict):
        raise ValueError("no features")
    cams = sorted(k.removeprefix(f"{OBS_IMAGES}.") for k in feats if k.startswith(f"{OBS_IMAGES}."))
    if not cams or OBS_STATE not in feats or ACTION not in feats:
        raise ValueError("missing features")
    h, w = feats[f"{OBS_IMAGES}.{cams[0]}"]["shape"][:2]
    dims = (int(h), int(w)), int(feats[OBS_STATE]["shape"][0]), int(feats[ACTION]["shape"][0])
    if min(*dims[0], dims[1], dims[2]) < 1:
        raise ValueError("bad shapes")
    return cams, dims[0], dims[1], dims[2]


def workload_schema(spec: WorkloadSpec) -> tuple[FeatureSchema, str]:
    """(schema, instruction) of a workload; a clear error if its env or dataset is unusable."""
    if spec.task_type in ("rl", "eval") or (spec.task_type == "custom" and spec.env):
        from joynexus.agents.envs.registry import task_spec

        env = task_spec(
            spec.env,
            obs="rgb",
            num_envs=spec.num_envs,
            image_size=spec.image_size,
            cameras=spec.cameras or None,
            state_keys=spec.state or None,
        )
        schema = FeatureSchema(
            camera_slots=env.cameras,
            image_hw=(env.image_size, env.image_size),
            state_dim=env.state_dim,
            action_dim=env.action_dim,
            action_horizon=spec.action_horizon,
            base_model=spec.base_model,
            state_keys=env.state_keys,
        )
        return schema, spec.instruction or env.instruction
    # spec.dataset is the path the control plane resolved inside the tenant's dataset
    # space (joynexus.agents.datasets); what is wrong with it is not echoed back.
    try:
        cams, hw, state_dim, action_dim = _dataset_layout(Path(spec.dataset))
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise unusable_dataset(spec) from None
    h, w = hw
    tasks_file = Path(spec.dataset) / "meta" / "tasks.parquet"
    instruction = ""
    try:
        if tasks_file.is_file():
            import pandas as pd

            tasks = pd.read_parquet(tasks_file)
            instruction = str(tasks.index[0]) if len(tasks) else ""
    except Exception:
        raise unusable_dataset(spec) from None
    state_keys = _dataset_state_keys(spec, state_dim)
    if spec.cameras and list(spec.cameras) != list(cams):
        raise InvalidSpec(
            f"workload {spec.name!r} names cameras {list(spec.cameras)} but its dataset recorded "
            f"{list(cams)}; drop cameras= (an SFT workload reads the dataset's) or generate a dataset with them"
        )
    schema = FeatureSchema(
        camera_slots=tuple(cams),
        image_hw=(int(h), int(w)),
        state_dim=state_dim,
        action_dim=action_dim,
        action_horizon=spec.action_horizon,
        base_model=spec.base_model,
        state_keys=state_keys,
    )
    return schema, spec.instruction or instruction


def _dataset_state_keys(spec: WorkloadSpec, state_dim: int) -> tuple[str, ...]:
    """The state keys a dataset recorded (generate_dataset's observation file), checked
    against the spec's ``state`` when it names one; () for a dataset made elsewhere."""
    from joynexus.agents.envs.maniskill import resolve_state_keys, state_key_dims

    meta = read_observation_meta(Path(spec.dataset)) or {}
    keys = meta.get("state_keys")
    task = meta.get("task")
    recorded: tuple[str, ...] = ()
    if isinstance(keys, list) and all(isinstance(k, str) for k in keys) and isinstance(task, str):
        try:
            dims = state_key_dims(task)
            if sum(dims[k] for k in keys) == state_dim:
                recorded = tuple(keys)
        except KeyError:
            recorded = ()
    if spec.state:
        try:
            wanted = resolve_state_keys(task, spec.state) if isinstance(task, str) else tuple(spec.state)
        except (InvalidSpec, KeyError):
            wanted = tuple(spec.state)
        if wanted != recorded:
            raise InvalidSpec(
                f"workload {spec.name!r} names state {list(spec.state)} but its dataset recorded "
                f"{list(recorded) or 'no state keys'}; drop state= (an SFT workload reads the "
                "dataset's) or generate a dataset with that state"
            )
    return recorded



def normalization_stats(spec: WorkloadSpec) -> dict[str, dict[str, list[float]]]:
    """Normalisation statistics for a new workload's head: an SFT dataset's LeRobot
    stats (meta/stats.json mean/std of state and action); {} otherwise (identity,
    or what ``init_from_workload``'s weights carry)."""
    if spec.task_type != "sft" or not spec.dataset:
        return {}
    return dataset_stats(Path(spec.dataset))


def chunk_targets(
    actions_M_A: np.ndarray,
    env_M: np.ndarray,
    episode_M: np.ndarray,
    frame_M: np.ndarray,
    horizon: int,
) -> np.ndarray:
    """For each executed step, the chunk of the next ``horizon`` actions of its episode
    [M, horizon, A] (past the episode's end the last action repeats, as LeRobot pads)."""
    m = len(actions_M_A)
    out_M_H_A = np.empty((m, horizon, actions_M_A.shape[1]), dtype=np.float32)
    order = np.lexsort((frame_M, episode_M, env_M))
    keys = (env_M.astype(np.int64) * 1_000_003 + episode_M)[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    for s, e in zip(starts, np.r_[starts[1:], m], strict=True):
        rows = order[s:e]
        idx_L_H = np.minimum(np.arange(e - s)[:, None] + np.arange(horizon)[None, :], e - s - 1)
        out_M_H_A[rows] = actions_M_A[rows][idx_L_H]
    return out_M_H_A


def decision_lengths(chunk_step_M: np.ndarray, env_M: np.ndarray, step_M: np.ndarray) -> np.ndarray:
    """Per row, the number of steps of its chunk that the decision taken there executed
    (rows with ``chunk_step`` 0), 0 on the other rows (pure).

    A decision's run is the row itself plus the rows of the same env that follow it
    with ``chunk_step`` 1, 2, ... (the chunk executed open loop until used up, the
    rollout's end or an episode's end)."""
    m = len(chunk_step_M)
    out_M = np.zeros(m, dtype=np.int64)
    if m == 0:
        return out_M
    order = np.lexsort((step_M, env_M))
    cs = np.asarray(chunk_step_M)[order]
    env = np.asarray(env_M)[order]
    starts = np.flatnonzero(np.r_[True, (cs[1:] == 0) | (env[1:] != env[:-1])])
    lengths = np.diff(np.r_[starts, m])
    is_decision = cs[starts] == 0
    out_M[order[starts[is_decision]]] = lengths[is_decision]
    return out_M


