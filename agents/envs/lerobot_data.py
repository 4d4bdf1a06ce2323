"""Demonstration datasets in LeRobot format: written from the scripted experts, read for SFT.

Tests, demos and benchmarks need datasets without a download: ``generate_dataset``
keeps a scripted expert's solved ManiSkill episodes and writes them with
lerobot's own ``LeRobotDataset`` API (PNG images, nothing pushed);
``load_dataset`` reads one back and gives each frame as a trainer batches it::

    "observation.images.<cam>"  uint8   [3, H, W]
    "observation.state"         float32 [S]
    "action"                    float32 [A], or [T, A] with action_horizon=T > 1
    "action_is_pad"             bool    [T]   (only with action_horizon > 1: steps past the episode end)
    "task"                      str
    "episode_index", "frame_index"  int64 []

HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set before lerobot is imported,
unless the caller set them. See docs/ARCHITECTURE.md, "Policies that learn".
"""

from __future__ import annotations

import os

# Before lerobot / huggingface_hub / datasets are imported: they read these at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from joynexus.agents.envs.experts import ScriptedExpert
from joynexus.agents.envs.lerobot_meta import (
    OBSERVATION_FILE,
    dataset_stats,
    read_observation_meta,
)
from joynexus.agents.envs.maniskill import (
    ACTION,
    OBS_IMAGES,
    OBS_STATE,
    TASK,
    EnvSpec,
    ObsMode,
    episode_seed,
    make_env,
)
from joynexus.schemas.errors import InvalidSpec

SUCCESS = "next.success"
REWARD = "next.reward"
DONE = "next.done"


@dataclass(frozen=True)
class DatasetInfo:
    """What ``generate_dataset`` wrote."""

    repo_id: str
    root: Path
    task: str
    instruction: str
    fps: int
    episodes: int
    frames: int
    attempts: int
    expert_success_rate: float
    #: LeRobot feature spec as written to meta/info.json (images: shape (H, W, 3)).
    features: dict[str, dict[str, Any]]
    spec: EnvSpec


#: What the dataset's observations are made of (task, state keys, cameras...), next to
#: LeRobot's own meta files; the service reads it to use the same choice in rollouts
#: and evaluation of a policy trained on the dataset.


def state_names(spec: EnvSpec) -> list[str]:
    """One name per state dimension, ``<key>.<i>`` (e.g. ``extra/obj_pose.3``)."""
    from joynexus.agents.envs.maniskill import state_key_dims

    if spec.state_keys == ("flat_state",):
        return [f"state_{i}" for i in range(spec.state_dim)]
    dims = state_key_dims(spec.task)
    return [f"{k}.{i}" for k in spec.state_keys for i in range(dims[k])]


def observation_meta(spec: EnvSpec) -> dict[str, Any]:
    return {
        "task": spec.task,
        "obs": spec.obs,
        "state_keys": list(spec.state_keys),
        "cameras": list(spec.cameras),
        "image_size": spec.image_size,
        "control_mode": spec.control_mode,
        "instruction": spec.instruction,
    }



def lerobot_features(spec: EnvSpec) -> dict[str, dict[str, Any]]:
    """The LeRobot feature spec of an env's frames (LeRobot's image convention: (H, W, C))."""
    feats: dict[str, dict[str, Any]] = {}
    for cam in spec.cameras:
        feats[f"{OBS_IMAGES}.{cam}"] = {
            "dtype": "image",
            "shape": (spec.image_size, spec.image_size, 3),
            "names": ["height", "width", "channels"],
        }
    feats[OBS_STATE] = {
        "dtype": "float32",
        "shape": (spec.state_dim,),
        "names": state_names(spec),
    }
    feats[ACTION] = {
        "dtype": "float32",
        "shape": (spec.action_dim,),
        "names": [f"action_{i}" for i in range(spec.action_dim)],
    }
    feats[REWARD] = {"dtype": "float32", "shape": (1,), "names": None}
    feats[SUCCESS] = {"dtype": "bool", "shape": (1,), "names": None}
    feats[DONE] = {"dtype": "bool", "shape": (1,), "names": None}
    return feats


def generate_dataset(
    task: str,
    root: Path,
    *,
    episodes: int,
    obs: ObsMode = "rgb",
    image_size: int = 64,
    seed: int = 0,
    fps: int = 20,
    control_mode: str = "pd_ee_delta_pos",
    cameras: Sequence[str] | None = None,
    state_keys: Sequence[str] | None = None,
    repo_id: str | None = None,
    max_attempts: int | None = None,
    max_steps: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DatasetInfo:
    """Write ``episodes`` successful expert episodes of ``task`` as a LeRobot dataset at ``root``.

    Blocking (minutes for hundreds of rgb episodes; call it through
    ``asyncio.to_thread`` from async code). ``root`` must not exist yet; it
    becomes the dataset folder. Attempt k resets with ``episode_seed(seed, 0, k)``;
    failed attempts are discarded, up to ``max_attempts`` (default 2 * episodes + 5).
    Each frame is the observation an action was taken in, that action, and
    the step's outcome (next.reward, next.success, next.done). ManiSkill ends
    an episode at success, so episodes are short (PickCube ~20 steps).
    ``fps`` is metadata (ManiSkill's control rate is 20 Hz). ``state_keys`` may
    name presets ("proprio", "privileged"; see ``maniskill.STATE_PRESETS``); the
    choice is written to ``meta/joynexus_observation.json``. ``progress(kept,
    attempts)`` is called after every attempt.
    """
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = Path(root)
    if root.exists():
        raise InvalidSpec(
            f"dataset root {root} already exists; LeRobot creates the folder itself: "
            "pass a new path (or delete the old dataset)"
        )
    if episodes < 1:
        raise InvalidSpec(f"episodes={episodes}: must be at least 1")
    if fps < 1:
        raise InvalidSpec(f"fps={fps}: must be at least 1")
    attempts_limit = max_attempts if max_attempts is not None else 2 * episodes + 5
    suffix = f"rgb{image_size}" if obs == "rgb" else "state"
    repo_id = repo_id or f"joynexus/{task.split('-')[0].lower()}_{suffix}"

    env = make_env(
        task,
        obs=obs,
        image_size=image_size,
        control_mode=control_mode,
        cameras=cameras,
        state_keys=state_keys,
    )
    try:
        spec = env.spec
        expert = ScriptedExpert(env)
        limit = max_steps if max_steps is not None else spec.max_episode_steps
        features = lerobot_features(spec)
        ds = LeRobotDataset.create(
            repo_id=repo_id,
            fps=fps,
            features=features,
            root=root,
            robot_type=spec.robot,
            use_videos=False,
        )
        kept = frames = attempts = 0
        while kept < episodes:
            if attempts >= attempts_limit:
                ds.finalize()
                raise InvalidSpec(
                    f"the {task} expert solved only {kept} of {attempts} episodes (wanted {episodes}); "
                    "raise max_attempts, or check the control_mode (experts need pd_ee_delta_pos/pose)"
                )
            obs_b = env.reset([episode_seed(seed, 0, attempts)])
            attempts += 1
            episode: list[dict[str, Any]] = []
            solved = False
            for _ in range(limit):
                a_1_A = expert.actions()
                res = env.step(a_1_A)
                done = bool(res.terminated_N[0] or res.truncated_N[0])
                frame: dict[str, Any] = {
                    key: obs_b[key][0].transpose(1, 2, 0) for key in spec.image_keys
                }
                frame[OBS_STATE] = obs_b[OBS_STATE][0]
                frame[ACTION] = a_1_A[0]
                frame[REWARD] = np.array([res.reward_N[0]], dtype=np.float32)
                frame[SUCCESS] = np.array([res.success_N[0]], dtype=bool)
                frame[DONE] = np.array([done or bool(res.success_N[0])], dtype=bool)
                frame[TASK] = spec.instruction
                episode.append(frame)
                obs_b = res.obs
                if res.success_N[0]:
                    solved = True
                    break
                if done:
                    break
            if not solved:
                if progress is not None:
                    progress(kept, attempts)
                continue
            for frame in episode:
                ds.add_frame(frame)
            with warnings.catch_warnings():
                # lerobot's histogram of the bool features casts them to uint8, noisily
                warnings.filterwarnings("ignore", message="Converting input from bool")
                ds.save_episode()
            kept += 1
            frames += len(episode)
            if progress is not None:
                progress(kept, attempts)
        ds.finalize()
        (root / "meta" / OBSERVATION_FILE).write_text(json.dumps(observation_meta(spec), indent=2))
    finally:
        env.close()
    return DatasetInfo(
        repo_id=repo_id,
        root=root,
        task=task,
        instruction=spec.instruction,
        fps=fps,
        episodes=kept,
        frames=frames,
        attempts=attempts,
        expert_success_rate=kept / attempts,
        features=features,
        spec=spec,
    )


class DemoDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A LeRobot dataset as a trainer batches it (see the module docstring for the items).

    ``lerobot`` is the underlying ``LeRobotDataset``; its ``meta`` has fps,
    features, episode count and normalization stats.
    """

    def __init__(self, lerobot: Any, action_horizon: int) -> None:
        self.lerobot = lerobot
        self.action_horizon = action_horizon
        self.image_keys: tuple[str, ...] = tuple(lerobot.meta.camera_keys)

    def __len__(self) -> int:
        return len(self.lerobot)

    @property
    def num_episodes(self) -> int:
        return int(self.lerobot.meta.total_episodes)

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return dict(self.lerobot.meta.features)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        item = self.lerobot[idx]
        out: dict[str, Any] = {}
        for key in self.image_keys:
            img_C_H_W = item[key]  # float32 in [0, 1] from lerobot
            out[key] = (img_C_H_W * 255.0).round().clamp(0, 255).to(torch.uint8)
        out[OBS_STATE] = item[OBS_STATE].to(torch.float32)
        out[ACTION] = item[ACTION].to(torch.float32)
        if self.action_horizon > 1:
            out["action_is_pad"] = item["action_is_pad"].to(torch.bool)
        out[TASK] = item[TASK]
        out["episode_index"] = item["episode_index"].to(torch.int64)
        out["frame_index"] = item["frame_index"].to(torch.int64)
        return out


def load_dataset(root: Path, repo_id: str | None = None, *, action_horizon: int = 1) -> DemoDataset:
    """Open a LeRobot dataset at ``root`` offline, as a torch Dataset of training frames.

    ``repo_id`` defaults to the one recorded when it was generated (it is
    only a name here: nothing is fetched). With ``action_horizon`` T > 1,
    "action" is the chunk of the next T actions [T, A] (LeRobot's
    delta_timestamps; steps past the episode end repeat the last action and
    are flagged in "action_is_pad").
    """
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = Path(root)
    info_path = root / "meta" / "info.json"
    if not info_path.is_file():
        raise InvalidSpec(
            f"dataset {root.name!r} is not a LeRobot dataset (no meta/info.json); pass the "
            "folder generate_dataset wrote or one in LeRobot v3.0 format"
        )
    if action_horizon < 1:
        raise InvalidSpec(f"action_horizon={action_horizon}: must be at least 1")
    if repo_id is None:
        repo_id = f"local/{root.name}"
    delta_timestamps = None
    if action_horizon > 1:
        try:
            fps = int(json.loads(info_path.read_text())["fps"])
            if fps < 1:
                raise ValueError("fps < 1")
        except (OSError, ValueError, KeyError, TypeError):
            raise InvalidSpec(
                f"dataset {root.name!r} is not a usable LeRobot dataset (meta/info.json has no fps)"
            ) from None
        delta_timestamps = {ACTION: [t / fps for t in range(action_horizon)]}
    ds = LeRobotDataset(repo_id, root=root, delta_timestamps=delta_timestamps)
    return DemoDataset(ds, action_horizon)


__all__ = [
    "DONE",
    "OBSERVATION_FILE",
    "REWARD",
    "SUCCESS",
    "DatasetInfo",
    "DemoDataset",
    "dataset_stats",
    "generate_dataset",
    "lerobot_features",
    "load_dataset",
    "observation_meta",
    "read_observation_meta",
    "state_names",
]
