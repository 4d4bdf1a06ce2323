"""The policy gateway on a live secured deployment (real nats-server with
authorization, control plane, inference engine on the tiny backbone): a Python
websockets client speaks openpi's protocol (metadata first, msgpack-numpy
observations, actions back, errors as text frames) with API keys the operator
issued through the admin API; hostile clients are refused or bounded and the
connection stays usable after a bad observation.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from joynexus.agents.gateway import GatewayOptions, PolicyGateway, codec
from joynexus.ops.admin.apikeys import add_key, list_keys, remove_key
from joynexus.ops.isolation import SecuredDeployment
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadSpec

pytestmark = [pytest.mark.security, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
MAX_FRAME = 1 << 20
IDLE_S = 3.0
TENANT_CONNS = 4


class Env:
    def __init__(self, dep: SecuredDeployment, gw: PolicyGateway, keys: dict[str, str]) -> None:
        self.dep, self.gw, self.keys = dep, gw, keys

    def url(self, query: str = "") -> str:
        return f"ws://127.0.0.1:{self.gw.port}/" + (f"?{query}" if query else "")

    def ws(self, key: str | None, query: str = "") -> Any:
        headers = {"Authorization": f"Api-Key {key}"} if key else None
        return connect(self.url(query), additional_headers=headers, max_size=None,
                       compression=None)


def unpack(data: bytes) -> Any:
    """As openpi_client.msgpack_numpy.unpackb does."""

    def conv(x: Any) -> Any:
        if isinstance(x, dict):
            if codec.ND_MARK in x:
                return np.ndarray(buffer=x[b"data"], dtype=np.dtype(x[b"dtype"]),
                                  shape=x[b"shape"])
            return {k: conv(v) for k, v in x.items()}
        return x

    return conv(msgspec.msgpack.decode(data))


def obs_frame(seed: int = 0, **patch: Any) -> bytes:
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {
        "observation/image": rng.integers(0, 255, (64, 64, 3), dtype=np.uint8),
        "observation/state": rng.standard_normal(12).astype(np.float32),
        "prompt": "pick the cube",
    }
    obs.update(patch)
    return msgspec.msgpack.encode(
        {k: codec.pack_array(v) if isinstance(v, np.ndarray) else v for k, v in obs.items()}
    )


@pytest.fixture(scope="module")
async def env(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Env]:
    async with SecuredDeployment(tmp_path_factory.mktemp("gateway")) as dep:
        keys = {}
        for tenant, workload in (("acme", "pick"), ("bolt", "secret")):
            await dep.issue(tenant)
            client = await dep.client(tenant)
            spec = WorkloadSpec(name=workload, task_type="sft", dataset=await dep.dataset(tenant),
                                source="tenant", action_horizon=2, instruction="pick the cube")
            await client.create_workload(spec)
        keys["acme"], _ = await add_key(dep.admin, "acme", workload="pick")
        keys["acme-any"], _ = await add_key(dep.admin, "acme")
        assert dep.service is not None
        gw = PolicyGateway(dep.service, GatewayOptions(
            host="127.0.0.1", port=0, max_frame_bytes=MAX_FRAME, idle_s=IDLE_S,
            max_conns_per_tenant=TENANT_CONNS))
        await gw.start()
        try:
            yield Env(dep, gw, keys)
        finally:
            await gw.stop()


async def test_round_trip_speaks_openpis_protocol_and_matches_the_sdk(env: Env) -> None:
    async with env.ws(env.keys["acme"]) as ws:
        meta = unpack(await ws.recv())
        assert meta["tenant"] == "acme" and meta["workload"] == "pick" and meta["version"] == 1
        assert (meta["action_horizon"], meta["action_dim"]) == (2, 4)
        assert meta["cameras"] == ["base_camera"] and meta["image_size"] == [64, 64]
        assert meta["state_dim"] == 12
        for seed in range(3):
            await ws.send(obs_frame(seed))
            reply = await ws.recv()
            assert isinstance(reply, bytes), reply
            out = unpack(reply)
            assert out["actions"].shape == (2, 4) and out["actions"].dtype == np.float32
            assert np.isfinite(out["actions"]).all() and out["policy_version"] == 1
            assert out["server_timing"]["infer_ms"] > 0
    # the same observation through the SDK's act: the same policy's answer
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    state = rng.standard_normal(12).astype(np.float32)
    sdk = await (await env.dep.client("acme")).act(
        "pick", images={"base_camera": img.transpose(2, 0, 1)[None]}, state=state[None],
        instruction="pick the cube")
    async with env.ws(env.keys["acme"]) as ws:
        await ws.recv()
        await ws.send(obs_frame(0))
        np.testing.assert_allclose(unpack(await ws.recv())["actions"], sdk[0], atol=1e-4)
    used = {k.key_id: k for k in await list_keys(env.dep.admin, "acme")}
    assert any(k.last_used_at > time.time() - 120 for k in used.values())


async def test_wrong_missing_and_revoked_keys(env: Env) -> None:
    for key in (None, "jnxk_000000000000_" + "A" * 43, env.keys["acme"][:-1] + "x", "garbage"):
        with pytest.raises(InvalidStatus) as e:
            async with env.ws(key):
                pass
        assert e.value.response.status_code == 401
    key, info = await add_key(env.dep.admin, "acme", workload="pick")
    async with env.ws(key) as ws:
        await ws.recv()
        await remove_key(env.dep.admin, "acme", info.key_id)
        t0 = time.perf_counter()
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        assert time.perf_counter() - t0 < 3.0
    with pytest.raises(InvalidStatus) as e:
        async with env.ws(key):
            pass
    assert e.value.response.status_code == 401
    assert info.key_id not in {k.key_id for k in await list_keys(env.dep.admin)}


async def test_keys_never_reach_another_tenants_workload(env: Env) -> None:
    with pytest.raises(InvalidSpec, match="tenant 'acme' has no workload 'secret'"):
        await add_key(env.dep.admin, "acme", workload="secret")
    with pytest.raises(InvalidStatus) as e:  # the key's workload is fixed
        async with env.ws(env.keys["acme"], "workload=secret"):
            pass
    assert e.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as e:  # bolt's workload name, under acme: nothing
        async with env.ws(env.keys["acme-any"], "workload=secret"):
            pass
    assert e.value.response.status_code == 404
    assert b"bolt" not in e.value.response.body
    async with env.ws(env.keys["acme-any"], "workload=pick") as ws:
        assert unpack(await ws.recv())["tenant"] == "acme"


async def test_bad_observations_get_error_strings_and_the_connection_stays_usable(
    env: Env,
) -> None:
    bad = [
        (b"\x91" * 50_000 + b"\xc0", "nested"),
        (b"\x81\xa1a" * 30 + b"\xc0", "deeper"),
        (b"\xdd\xff\xff\xff\xff\xc0", "msgpack"),
        (b"\xc6\x7f\xff\xff\xff", "msgpack"),
        (obs_frame(1, **{"observation/state": np.full(12, np.nan, np.float32)}), "NaN"),
        (obs_frame(1, **{"observation/state": np.full(12, np.inf)}), "NaN or inf"),
        (obs_frame(1, **{"observation/image": np.zeros((32, 32, 3), np.uint8)}), "64, 64, 3"),
        (obs_frame(1, **{"observation/state": np.zeros(5, np.float32)}), r"expected [12]"),
        (msgspec.msgpack.encode({"state": {**codec.pack_array(np.zeros(3)), b"dtype": "|O"}}),
         "dtype"),
    ]
    async with env.ws(env.keys["acme"]) as ws:
        await ws.recv()
        for frame, words in bad:
            await ws.send(frame)
            reply = await ws.recv()
            assert isinstance(reply, str) and words in reply, (words, reply[:200])
        await ws.send("a text frame")
        assert "binary" in await ws.recv()
        await ws.send(obs_frame(2))
        assert unpack(await ws.recv())["actions"].shape == (2, 4)


async def test_oversized_frames_idle_clients_and_connection_floods_are_bounded(env: Env) -> None:
    async with env.ws(env.keys["acme"]) as ws:
        await ws.recv()
        await ws.send(b"\x00" * (MAX_FRAME + 1))
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        # the close frame's reason says why (openpi's client raises it): the limit
        assert f"exceeds limit of {MAX_FRAME} bytes" in closed.value.rcvd.reason
    async with env.ws(env.keys["acme"]) as ws:  # idle: closed after IDLE_S
        await ws.recv()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), IDLE_S + 5)
    await asyncio.sleep(0.2)
    held = [await env.ws(env.keys["acme"]).__aenter__() for _ in range(TENANT_CONNS)]
    try:
        with pytest.raises(InvalidStatus) as e:
            async with env.ws(env.keys["acme"]):
                pass
        assert e.value.response.status_code == 429
        bolt_key, _ = await add_key(env.dep.admin, "bolt", workload="secret")
        async with env.ws(bolt_key) as ws:  # another tenant is not affected
            assert unpack(await ws.recv())["tenant"] == "bolt"
            await ws.send(obs_frame(3))
            assert unpack(await ws.recv())["actions"].shape == (2, 4)
    finally:
        for ws in held:
            await ws.close()


def openpi_python() -> Path | None:
    """openpi's own virtualenv (ops/setup.sh makes .venv-openpi; or $JOYNEXUS_OPENPI_PYTHON)."""
    env_py = os.environ.get("JOYNEXUS_OPENPI_PYTHON")
    py = Path(env_py) if env_py else ROOT / ".venv-openpi" / "bin" / "python"
    return py if py.is_file() else None


async def test_openpis_own_client_runs_episodes_through_the_gateway(env: Env) -> None:
    py = openpi_python()
    assert py is not None, ("no .venv-openpi: run `bash ops/setup.sh` (it makes it), or set "
                            "$JOYNEXUS_OPENPI_PYTHON to a python with openpi-client")
    episodes, steps = 3, 7
    proc = await asyncio.create_subprocess_exec(
        str(py), str(Path(__file__).with_name("openpi_driver.py")),
        f"ws://127.0.0.1:{env.gw.port}", env.keys["acme"], str(episodes), str(steps),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    got = json.loads(out.decode().strip().splitlines()[-1])
    assert got["numpy"].startswith("1."), got  # its own pinned numpy, not the service's
    assert got["meta"] == {"tenant": "acme", "workload": "pick", "version": 1,
                           "action_horizon": 2, "action_dim": 4}
    assert got["steps"] == episodes * steps
    # ActionChunkBroker asks once per chunk of 2 steps: ceil(7 / 2) per episode; then the
    # bad observation and the one after it
    assert got["calls"] == episodes * 4 + 2
    assert "Error in inference server" in got["error"] and "NaN" in got["error"]
    assert got["after_error"] == [2, 4]


async def test_bench_gateway_reports_the_paired_overhead() -> None:
    from joynexus.ops.bench.gateway import bench_gateway

    out = await bench_gateway(repeats=6, warmup=1)
    assert out["gateway"]["n"] == out["sdk"]["n"] == 6
    lo, hi = out["overhead_ci95"]
    assert lo <= out["overhead_p50_ms"] <= hi and out["gateway_p50_ms"] > 0
