"""Light roles (issue 31, item 3): a role process imports torch, transformers, a
simulator (ManiSkill, LIBERO) or LeRobot only if it computes with them.

Each light role runs in a process of its own against the test nats-server
(``python -m joynexus.ops.runtime.roleprobe``, the role as ``joynexus agent`` runs it),
becomes ready, beats (RSS, ready_s), and says which heavy libraries it loaded:
none. The control plane also creates workloads meanwhile (fresh weights at an
init endpoint served here, a copy and an evaluation's check done in its own
process). The pure parts (feature widths, the dataset meta readers, the
safetensors retag) are tabled against the heavy modules they mirror.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from joynexus.broker.connection import Broker
from joynexus.ops.runtime.roleprobe import HEAVY_MODULES, heavy_loaded
from joynexus.schemas.health import Heartbeat

#: The roles that compute with none of HEAVY_MODULES (their children may: producer-rl's
#: environment workers simulate); the evaluator loads them with its first evaluation,
#: not before (an idle one held 670 MB through the main job's windows).
LIGHT_ROLES = ("scheduler", "control", "monitor", "producer-rl", "producer-sft", "advantage",
               "evaluator", "gateway")
#: A light role's resident memory stays well below one with torch loaded (~840 MiB here).
MAX_LIGHT_RSS_MB = 400


class Probe:
    """One role in a subprocess (``joynexus.ops.runtime.roleprobe --until-stdin``)."""

    def __init__(self, proc: asyncio.subprocess.Process, role: str) -> None:
        self.proc = proc
        self.role = role

    @classmethod
    async def start(cls, url: str, namespace: str, role: str, env: dict[str, str]) -> Probe:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "joynexus.ops.runtime.roleprobe", role, "--nats", url,
            "--namespace", namespace, "--until-stdin", "--timeout", "90",
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **env},
        )
        return cls(proc, role)

    async def line(self, timeout_s: float = 100.0) -> dict[str, Any]:
        """The next JSON line it prints (other output, e.g. ClearML's, is skipped)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), deadline - time.monotonic())
            if not raw:
                err = await self.stderr()
                raise AssertionError(f"{self.role}: exited {self.proc.returncode}:\n{err[-3000:]}")
            with contextlib.suppress(ValueError):
                line = json.loads(raw)
                if isinstance(line, dict) and "event" in line:
                    return line

    async def report(self) -> dict[str, Any]:
        """Ask it to report (a line on stdin) and read the report."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"report\n")
        await self.proc.stdin.drain()
        return await self.line(30)

    async def stderr(self) -> str:
        assert self.proc.stderr is not None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 20)
        return (await self.proc.stderr.read()).decode(errors="replace")

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _heartbeat(b: Broker, role: str, instance: str, timeout_s: float = 10.0) -> Heartbeat:
    """The first beat of ``role``/``instance`` that says it is ready."""
    from joynexus.schemas.base import decode

    kv = await b.js.key_value(b.names.health_bucket)
    deadline = time.monotonic() + timeout_s
    last: Heartbeat | None = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            last = decode((await kv.get(b.names.heartbeat_key(role, instance))).value, Heartbeat)
            if last.ready_s is not None:
                return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"no ready beat of {role}/{instance} in {timeout_s}s (last: {last})")


def _env() -> dict[str, str]:
    # producer-rl is ready without warm spares (a spare is a heavy child: it simulates).
    # The gateway on any free port.
    return {"JOYNEXUS_ENV_SPARES": "0", "JOYNEXUS_HEARTBEAT_S": "0.5", "JOYNEXUS_GATEWAY_PORT": "0"}


@pytest.mark.parametrize("role", LIGHT_ROLES)
async def test_a_light_role_serves_without_heavy_libraries(nats_server, broker, role) -> None:
    probe = await Probe.start(nats_server.url, broker.names.namespace, role, _env())
    try:
        ready = await probe.line()
        assert ready["event"] == "ready", ready
        beat = await _heartbeat(broker, role, f"{role}-probe")
        report = await probe.report()
    finally:
        await probe.close()
    assert report["event"] == "report", report
    assert report["heavy"] == [], f"{role} loaded {report['heavy']} ({report['rss_mb']} MiB)"
    assert report["rss_mb"] < MAX_LIGHT_RSS_MB, report
    assert 0 < report["ready_s"] < 90, report
    # Its heartbeat says the same: the RSS and the seconds from its start to serving.
    assert 0 < beat.rss_mb < MAX_LIGHT_RSS_MB and beat.ready_s == pytest.approx(ready["ready_s"], abs=0.5)
    print(f"{role}: ready in {report['ready_s']:.2f}s, {report['rss_mb']:.0f} MiB")


def _fake_sft_dataset(root: Path) -> Path:
    """A LeRobot dataset's meta files, as much as a workload's creation reads."""
    meta = root / "meta"
    meta.mkdir(parents=True)
    features = {
        "observation.images.front": {"dtype": "image", "shape": [56, 56, 3]},
        "observation.state": {"dtype": "float32", "shape": [9]},
        "action": {"dtype": "float32", "shape": [7]},
    }
    (meta / "info.json").write_text(json.dumps({"features": features}))
    stats = {
        "observation.state": {"mean": [0.5] * 9, "std": [2.0] * 9, "min": [0.0] * 9, "max": [1.0] * 9},
        "action": {"mean": [0.1] * 7, "std": [0.5] * 7, "min": [-1.0] * 7, "max": [1.0] * 7},
    }
    (meta / "stats.json").write_text(json.dumps(stats))
    return root


async def test_the_control_role_creates_workloads_without_torch(nats_server, broker, tmp_path) -> None:
    """Fresh weights come from the init endpoint (served here, as the actor role
    does); the copy (SFT then RL) and an evaluation's check run in the control
    process, which stays without torch."""
    from safetensors.torch import load

    from joynexus.agents.models.policyio import PolicyStore, module_from_weights
    from joynexus.agents.producers.init import PolicyInitService
    from joynexus.agents.scheduler import SchedulerAgent
    from joynexus.schemas.errors import InvalidSpec
    from joynexus.schemas.workloads import WorkloadSpec
    from joynexus.sdk import Client

    _fake_sft_dataset(tmp_path / "datasets" / "acme" / "demo")
    sched = SchedulerAgent(broker)
    await sched.start()
    init = PolicyInitService(broker, instance="actor-test")
    await init.start()
    env = {**_env(), "JOYNEXUS_DATASETS": str(tmp_path / "datasets")}
    probe = await Probe.start(nats_server.url, broker.names.namespace, "control", env)
    try:
        assert (await probe.line())["event"] == "ready"
        c = await Client.connect(nats_server.url, tenant="acme", namespace=broker.names.namespace)
        async with c:
            sft = await c.create_workload(WorkloadSpec(name="sft", task_type="sft", dataset="demo"))
            rl = await c.create_workload(WorkloadSpec(name="rl", task_type="rl", env="PickCube-v1"))
            await c.cancel_workload("rl")  # one active RL workload per tenant
            copy = await c.create_workload(
                WorkloadSpec(name="rl2", task_type="rl", env="PickCube-v1", init_from_workload="rl",
                             seed=7)
            )
            await c.cancel_workload("rl2")
            with pytest.raises(InvalidSpec, match=r"is 256 wide, this workload.s head_hidden is 64"):
                await c.create_workload(
                    WorkloadSpec(name="rl3", task_type="rl", env="PickCube-v1",
                                 init_from_workload="rl", head_hidden=64)
                )
            ev = await c.create_workload(
                WorkloadSpec(name="ev", task_type="eval", env="PickCube-v1", init_from_workload="rl",
                             episodes=1, num_envs=1)
            )
        report = await probe.report()
    finally:
        await probe.close()
        await init.stop()
        await sched.stop()
    assert report["heavy"] == [], report
    assert init.served == 2  # the SFT and the first RL workload: fresh weights
    sig = rl.record.schema_signature
    assert copy.record.schema_signature == ev.record.schema_signature == sig
    assert "cams=front" in sft.record.schema_signature
    store = PolicyStore(broker)
    src, dst = await store.get("acme", "rl", 1), await store.get("acme", "rl2", 1)
    src_w, dst_w = await store.load_weights(src), await store.load_weights(dst)
    a, b = load(src_w), load(dst_w)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    n = int.from_bytes(dst_w[:8], "little")
    meta = json.loads(dst_w[8 : 8 + n])["__metadata__"]
    assert meta["version"] == "1" and json.loads(meta["config"])["seed"] == 7
    assert dst.head_config["seed"] == 7 and dst.head_type == src.head_type
    module_from_weights(dst, dst_w)  # loads into the head its record describes
    # The SFT head was built with the dataset's statistics (read by the control plane).
    sft_rec = await store.get("acme", "sft", 1)
    sft_module = module_from_weights(sft_rec, await store.load_weights(sft_rec))
    norm = sft_module.normalization()
    assert norm["observation.state"]["mean"] == [0.5] * 9 and norm["action"]["std"] == [0.5] * 7


def test_the_sdk_imports_no_heavy_library() -> None:
    code = (
        "import joynexus.sdk, joynexus.sdk.sync; from joynexus.ops.runtime.roleprobe import heavy_loaded; "
        "print(heavy_loaded())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_heavy_loaded_names_top_level_packages() -> None:
    assert heavy_loaded({"torch.nn": 1, "numpy": 1, "sapien.core": 1, "torchvision": 1}) == [
        "sapien",
        "torch",
    ]
    assert "lerobot" in HEAVY_MODULES and "transformers" in HEAVY_MODULES


# ---------------------------------------------------------------- the light tables
def test_feature_dims_are_the_backbone_sizes() -> None:
    from joynexus.agents.featureschema import FEATURE_DIMS, feature_dim
    from joynexus.agents.models.backbone_config import SIZES
    from joynexus.schemas.catalog import BASE_MODELS

    assert FEATURE_DIMS == {size: s["text"]["hidden_size"] for size, s in SIZES.items()}
    assert set(BASE_MODELS.values()) <= set(FEATURE_DIMS)
    for base, size in BASE_MODELS.items():
        assert feature_dim(base) == SIZES[size]["text"]["hidden_size"]


def test_the_dataset_meta_readers_are_one_light_module(tmp_path) -> None:
    """lerobot_data (torch) and the light producers read a dataset's meta files
    through the same functions, and those read what they should."""
    from joynexus.agents.envs import lerobot_data, lerobot_meta
    from joynexus.agents.producers import schema

    for name in ("OBSERVATION_FILE", "read_observation_meta", "dataset_stats"):
        assert getattr(schema, name) is getattr(lerobot_meta, name) is getattr(lerobot_data, name)
    root = _fake_sft_dataset(tmp_path / "d")
    assert lerobot_meta.read_observation_meta(root) is None
    meta = {"task": "PickCube-v1", "state_keys": ["agent/qpos"], "cameras": ["front"]}
    (root / "meta" / lerobot_meta.OBSERVATION_FILE).write_text(json.dumps(meta))
    assert lerobot_meta.read_observation_meta(root) == meta
    (root / "meta" / "stats.json").write_text(json.dumps(
        {"observation.state": {"mean": [1, 2], "std": [0.5, 0.5]}}))
    assert lerobot_meta.dataset_stats(root) == {
        "observation.state": {"mean": [1.0, 2.0], "std": [0.5, 0.5]}}
    (root / "meta" / "stats.json").write_text("not json")
    assert lerobot_meta.dataset_stats(root) == {}


def test_retag_keeps_the_tensors_and_sets_the_metadata() -> None:
    import torch
    from safetensors.torch import load, save

    from joynexus.agents.producers.init import retag_safetensors
    from joynexus.schemas.errors import InvalidSpec

    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    data = save(tensors, metadata={"version": "4", "tenant": "acme"})
    out = retag_safetensors(data, {"version": "1"})
    n = int.from_bytes(out[:8], "little")
    assert n % 8 == 0
    assert json.loads(out[8 : 8 + n])["__metadata__"] == {"version": "1", "tenant": "acme"}
    back = load(out)
    assert all(back[k].equal(tensors[k]) for k in tensors)
    for bad in (b"", b"\xff" * 8 + b"{}", (2).to_bytes(8, "little") + b"[]"):
        with pytest.raises(InvalidSpec, match="not safetensors"):
            retag_safetensors(bad, {"version": "1"})


async def test_fresh_weights_without_an_actor_fail_unavailable_naming_it(broker, monkeypatch) -> None:
    import dataclasses

    from joynexus.agents.producers import init
    from joynexus.schemas.errors import Unavailable
    from joynexus.schemas.workloads import WorkloadRecord, WorkloadSpec

    monkeypatch.setattr(init, "INIT_RETRY", dataclasses.replace(init.INIT_RETRY, deadline_s=0.5))
    rec = WorkloadRecord(tenant_id="acme", spec=WorkloadSpec(name="rl", task_type="rl",
                                                             env="PickCube-v1"))
    with pytest.raises(Unavailable, match="joynexus agent actor"):
        await init.PolicyInitializer(broker, remote=True, timeout_s=0.5)(rec)
