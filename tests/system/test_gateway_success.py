"""openpi's own client (its virtualenv, numpy < 2) drives ManiSkill's PushCube through
the policy gateway against a tenant's SFT policy trained through the SDK, and its
success over 30 episodes agrees with the service's evaluator on the same seeds (the
issue's target: within the evaluator's Wilson 95% interval). The simulator lives in
the service's virtualenv behind the environment proxy (``ops/bench/envproxy.py``),
which is checked here against hostile requests too.

On LIBERO (no scripted expert, no dataset: an RL workload's initial version,
which never succeeds) success agreement would be trivial, so the episodes
themselves are compared: the evaluator's saved videos against the client's
frames, byte for byte, with openpi's LIBERO keys and two cameras.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import numpy as np
import pytest

from joynexus.agents.gateway import codec
from joynexus.ops.bench.envproxy import MAX_MESSAGE, EnvProxy
from joynexus.ops.bench.gatewaysuccess import bench_success, openpi_python

pytestmark = pytest.mark.timeout(1200)


async def test_openpis_client_agrees_with_the_evaluator_on_the_same_seeds(tmp_path: Path) -> None:
    assert openpi_python() is not None, (
        "no .venv-openpi: run `bash ops/setup.sh` (it makes it), or set "
        "$JOYNEXUS_OPENPI_PYTHON to a python with openpi-client")
    # half-trained on purpose (about 0.4 success): a policy that always succeeds
    # agrees with anything
    out = await bench_success(episodes=30, seed=2027, demos=10, updates=20, budget_s=180.0,
                              data_dir=tmp_path)
    assert out["openpi_numpy"].startswith("1."), out  # openpi's own pinned numpy
    assert out["openpi_meta"]["version"] == out["version"] and out["updates"] >= 20, out
    assert out["episodes"] == out["openpi_episodes"] == 30, out
    lo, hi = out["evaluator_ci95"]
    assert lo <= out["openpi_success"] <= hi and out["agree"], out
    # the same initial states and the same chunks, executed open loop: the same episodes
    assert out["mean_length_openpi"] == pytest.approx(out["mean_length_evaluator"], abs=2.0), out
    assert out["mean_length_evaluator"] < 49.0, out  # not every episode ran to the limit
    # ActionChunkBroker asks once per chunk of 4 steps (and afresh after each episode)
    assert out["openpi_steps"] == round(out["mean_length_openpi"] * 30)
    assert out["openpi_steps"] / 4 <= out["openpi_policy_calls"] <= out["openpi_steps"] / 4 + 30


async def test_openpis_client_runs_the_evaluators_libero_episodes_frame_for_frame(
        tmp_path: Path) -> None:
    assert openpi_python() is not None, "no .venv-openpi: see the test above"
    out = await bench_success(task="LIBERO-spatial-0", episodes=5, seed=2027, max_steps=20,
                              data_dir=tmp_path)
    meta = out["openpi_meta"]
    assert out["openpi_numpy"].startswith("1."), out
    assert (meta["workload"], meta["version"]) == ("rl", out["version"]), out
    assert meta["cameras"] == ["agentview", "eye_in_hand"] and meta["action_dim"] == 7, out
    assert out["episodes"] == out["openpi_episodes"] == 5, out
    # an untrained policy: neither succeeds, every episode runs to the 20-step cap
    assert out["evaluator_success"] == out["openpi_success"] == 0.0 and out["agree"], out
    assert out["lengths_openpi"] == [20] * 5 and out["mean_length_evaluator"] == 20.0, out
    assert out["mean_return_evaluator"] == out["mean_return_openpi"], out
    # the same episodes: the first 4 (a tenant's video quota) identical frame for frame,
    # 21 frames each (the reset and 20 steps); they could differ: the episodes start
    # from different states, and the policy moves the robot within each
    assert out["videos"] == out["videos_openpi"] == 4, out
    assert out["video_frames_evaluator"] == out["video_frames_openpi"] == [21] * 4, out
    assert out["evaluator_videos_distinct"] and all(out["frames_change"]), out
    assert all(out["videos_identical"]) and out["video_max_abs_diff"] == [0] * 4, out
    assert out["same_episodes"], out
    # ActionChunkBroker: one call per chunk of 4 steps
    assert out["openpi_steps"] == 100 and out["openpi_policy_calls"] == 25, out


async def test_the_environment_proxy_refuses_what_a_client_should_not_send(tmp_path: Path) -> None:
    proxy = EnvProxy("PushCube-v1", episodes=1, seed=0, image_size=64,
                     cameras=["base_camera"], state_keys=["privileged"])
    sock = tmp_path / "env-socket"

    async def call(w: asyncio.StreamWriter, r: asyncio.StreamReader, **msg: object) -> dict:
        data = codec.encode({k: codec.pack_array(v) if isinstance(v, np.ndarray) else v
                             for k, v in msg.items()})
        w.write(struct.pack(">I", len(data)) + data)
        (n,) = struct.unpack(">I", await r.readexactly(4))
        return codec.decode_observation(await r.readexactly(n))

    async with proxy.serving(sock):
        r, w = await asyncio.open_unix_connection(str(sock))
        assert "reset first" in (await call(w, r, op="observe"))["error"]
        assert "reset first" in (await call(w, r, op="apply", action=np.zeros(4, np.float32)))["error"]
        assert "unknown op" in (await call(w, r, op="rm -rf"))["error"]
        assert (await call(w, r, op="reset")) == {"done": False}
        obs = await call(w, r, op="observe")
        assert obs["observation/images/base_camera"].shape == (64, 64, 3)
        assert obs["observation/state"].dtype == np.float32 and obs["prompt"]
        assert "ShapeMismatch" in (await call(w, r, op="apply", action=np.zeros(7, np.float32)))["error"]
        assert "non-finite" in (await call(w, r, op="apply", action=np.full(4, np.nan, np.float32)))["error"]
        assert (await call(w, r, op="apply", action=np.zeros(4, np.float32))) == {"done": False}
        assert (await call(w, r, op="reset")) == {"done": True}  # one episode asked: no more
        w.write(struct.pack(">I", MAX_MESSAGE + 1))  # too large: the proxy hangs up
        assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
    assert len(proxy.outcomes) == 1 and proxy.outcomes[0].length == 1
    assert proxy.finished() == []  # it did not run to its end: not counted
    assert proxy.env is None  # closed with the block
