"""A simulator served to another virtualenv: the environment proxy between openpi's
client (its own virtualenv, numpy < 2) and ManiSkill or LIBERO (the service's, numpy 2).

:class:`EnvProxy` owns one env built exactly as the evaluator builds it for an
evaluation of one env (``agents.evalrun.evaluate_record``: ``make_env(task,
obs="rgb", num_envs=1, image_size, seed, cameras, state_keys)``) and serves it on
a unix socket to one client, ``examples/openpi_sim.py``, whose openpi
``Environment`` forwards ``reset``, ``get_observation`` and ``apply_action`` to
it. Episode k resets with ``episode_seed(seed, 0, k)`` and runs until the task
terminates or truncates or ``max_episode_steps``, and counts as a success if the
task reported success at any step: the evaluator's ``run_episodes`` with one
env, so on the same seeds both see the same initial states. The outcomes are
counted here, by the process that owns the simulator, not by the client, and
with ``videos`` the first episodes' frames are kept as the evaluator keeps them
(``agents.envs.video.EpisodeVideos``, the policy's first camera), so the two can
be compared frame by frame.

Wire: each message is a 4-byte big-endian length and a msgpack map, arrays in
openpi's msgpack-numpy form. Requests ``{"op": "reset" | "observe" | "apply",
"action": [A] float32}``; replies ``{"done": bool}``, the observation (openpi's
keys: ``observation/images/<cam>`` H x W x 3 uint8, ``observation/state``,
``prompt``, the task's instruction; with ``keys="libero"`` the names of openpi's
LIBERO example instead: ``observation/image`` for the first camera and
``observation/wrist_image`` for ``eye_in_hand``), or ``{"error": str}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.agents.gateway import codec

MAX_MESSAGE = 1 << 20


@dataclass
class Episode:
    seed: int
    success: bool = False
    length: int = 0
    ret: float = 0.0
    #: it ran to its end (terminated, truncated or the step limit)
    ended: bool = False


@dataclass
class EnvProxy:
    """One env of ``task`` served on ``path`` for ``episodes`` episodes."""

    task: str
    episodes: int
    seed: int
    image_size: int
    cameras: Sequence[str]
    state_keys: Sequence[str]
    #: "openpi" (``observation/images/<cam>``) or "libero" (openpi's LIBERO example's names)
    keys: str = "openpi"
    #: the first ``videos`` episodes' frames kept, as the evaluator's ``eval_videos``
    videos: int = 0
    outcomes: list[Episode] = field(default_factory=list)
    env: Any = None
    obs: Any = None
    done: bool = True
    recorder: Any = None

    def __post_init__(self) -> None:
        import msgspec

        from joynexus.agents.envs.video import EpisodeVideos
        from joynexus.schemas.samples import OBS_IMAGES
        from joynexus.schemas.workloads import WorkloadSpec

        if self.keys not in ("openpi", "libero"):
            raise ValueError(f"keys={self.keys!r}: 'openpi' or 'libero'")
        if self.videos and self.cameras:  # as agents.evalrun records an SDK evaluation
            spec = {f.name: f.default for f in msgspec.structs.fields(WorkloadSpec)}
            self.recorder = EpisodeVideos(
                self.videos, f"{OBS_IMAGES}.{self.cameras[0]}",
                max_frames=spec["video_frames"], size=spec["video_size"])

    def _build(self) -> None:
        from joynexus.agents.envs.registry import make_env

        self.env = make_env(self.task, obs="rgb", num_envs=1, image_size=self.image_size,
                            seed=self.seed, cameras=list(self.cameras) or None,
                            state_keys=list(self.state_keys) or None)

    def reset(self) -> dict[str, Any]:
        from joynexus.agents.envs.maniskill.rollout import episode_seed

        if len(self.outcomes) >= self.episodes:  # openpi's Runtime resets once more at the end
            self.done = True
            return {"done": True}
        if self.env is None:
            self._build()
        ep = Episode(episode_seed(self.seed, 0, len(self.outcomes)))
        self.obs = self.env.reset([ep.seed])
        self.outcomes.append(ep)
        self._record()
        self.done = False
        return {"done": False}

    def _record(self) -> None:
        if self.recorder is not None:
            self.recorder.observe([len(self.outcomes) - 1], self.obs, np.ones(1, dtype=bool))

    def image_key(self, i: int, cam: str) -> str:
        if self.keys == "libero":  # openpi's examples/libero/main.py
            if i == 0:
                return "observation/image"
            if cam == "eye_in_hand":
                return "observation/wrist_image"
        return f"observation/images/{cam}"

    def observe(self) -> dict[str, Any]:
        from joynexus.schemas.samples import OBS_IMAGES, OBS_STATE

        if self.obs is None:
            raise RuntimeError("reset first")
        out: dict[str, Any] = {
            self.image_key(i, c): codec.pack_array(
                np.ascontiguousarray(self.obs[f"{OBS_IMAGES}.{c}"][0].transpose(1, 2, 0)))
            for i, c in enumerate(self.env.spec.cameras)
        }
        out["observation/state"] = codec.pack_array(
            np.ascontiguousarray(self.obs[OBS_STATE][0], dtype=np.float32))
        out["prompt"] = self.env.spec.instruction
        return out

    def step(self, action: Any) -> dict[str, Any]:
        from joynexus.agents.envs.maniskill.rollout import check_actions

        if self.done:
            raise RuntimeError("the episode is over: reset first")
        a = check_actions(np.asarray(action, dtype=np.float32)[None], self.env.spec)[:, 0]
        if not np.isfinite(a).all():
            raise ValueError("non-finite action")
        res = self.env.step(a)
        ep = self.outcomes[-1]
        ep.length += 1
        ep.ret += float(res.reward_N[0])
        ep.success |= bool(res.success_N[0])
        self.obs = res.obs
        self._record()
        self.done = bool(res.terminated_N[0] or res.truncated_N[0]
                         or ep.length >= self.env.spec.max_episode_steps)
        ep.ended = self.done
        return {"done": self.done}

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    def finished(self) -> list[Episode]:
        """The episodes that ran to their end."""
        return [e for e in self.outcomes if e.ended]

    def videos_encoded(self) -> list[bytes]:
        """The recorded episodes encoded as the evaluator encodes them, in episode order."""
        return [data for _, data in self.recorder.encoded()] if self.recorder else []

    # ---------------------------------------------------------------- serving
    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    (n,) = struct.unpack(">I", await reader.readexactly(4))
                    if n > MAX_MESSAGE:
                        return
                    data = await reader.readexactly(n)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    msg = codec.decode_observation(data)
                    op = msg.get("op")
                    if op == "reset":
                        reply = await asyncio.to_thread(self.reset)
                    elif op == "observe":
                        reply = self.observe()
                    elif op == "apply":
                        reply = await asyncio.to_thread(self.step, msg.get("action"))
                    else:
                        reply = {"error": f"unknown op {op!r:.40}"}
                except Exception as e:  # told to the client, which raises it
                    reply = {"error": f"{type(e).__name__}: {e}"}
                data = codec.encode(reply)
                writer.write(struct.pack(">I", len(data)) + data)
                await writer.drain()
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def serving(self, path: Path) -> Any:
        """Serve on unix socket ``path`` while the block runs; the env closed after."""
        server = await asyncio.start_unix_server(self._serve_one, path=str(path))
        try:
            yield self
        finally:
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)
            await asyncio.to_thread(self.close)


__all__ = ["MAX_MESSAGE", "EnvProxy", "Episode"]
