"""The Inference Queue benchmarks' shared parts: the sample tenants (observations,
feature schema, heads, one request's bytes), the engine child process (serve,
wait until it answers, stop, its RSS) and the closed-loop load on it.

Used by ops/bench/inference.py (whose ``--serve`` runs :func:`serve_engine`),
ops/bench/rr.py and ops/bench/engines.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from joynexus.ops.measure.stats import percentile

TENANTS = 8
SLOTS = ("front", "wrist")
HW = (56, 56)
INSTR = ("pick up the red cube", "open the drawer", "push the block left", "stack the cups")
HEAD_HIDDEN = 256  # heads of a realistic size, so their bytes show next to RSS noise


def sample_obs(i: int) -> dict[str, Any]:
    g = np.random.default_rng(i)
    return dict(
        images={s: g.integers(0, 256, (1, 3, *HW), dtype=np.uint8) for s in SLOTS},
        instruction=INSTR[i % len(INSTR)],
        state=g.standard_normal((1, 8)).astype(np.float32),
    )


def sample_schema(base_model: str) -> Any:
    from joynexus.agents.models.features import FeatureSchema

    return FeatureSchema(SLOTS, HW, 8, 7, 8, base_model=base_model)


def real_request_payload() -> bytes:
    """The bytes of one Inference Queue request as the bench's tenants send it."""
    from joynexus.schemas.inference import InferRequest, Observation, TensorBytes, encode_msgpack

    o = sample_obs(0)
    req = InferRequest(
        tenant_id="t0",
        workload="default",
        session_id="",
        schema_signature=sample_schema("qwen2.5-vl-tiny").signature(),
        policy_version=None,
        observation=Observation(
            images={s: TensorBytes.from_array(x) for s, x in o["images"].items()},
            instruction=o["instruction"],
            state=TensorBytes.from_array(o["state"]),
            history=None,
        ),
        noise=None,
    )
    return encode_msgpack(req)


def sample_module(tenant: str, i: int, feature_dim: int) -> Any:
    from joynexus.agents.models.heads.base import HeadConfig
    from joynexus.agents.models.heads.tenant import TenantModule

    head = ("oft_mlp", "flow_matching")[i % 2]
    return TenantModule(tenant, head, HeadConfig(feature_dim, 8, 7, 8, hidden=HEAD_HIDDEN, seed=i))


# ---------------------------------------------------------------- the engine process


def serve_engine(url: str, namespace: str, size: str, max_batch: int, max_wait_ms: float, threads: int) -> None:
    """Body of the engine child process: ``run_inference_agent`` until SIGTERM."""
    from joynexus.agents.inference import run_inference_agent
    from joynexus.broker.connection import Broker

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        b = await Broker.connect(url, name="bench-infer-engine", namespace=namespace)
        try:
            await run_inference_agent(b, stop, size=size, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                      instance="bench", threads=threads)
        finally:
            await b.close()

    asyncio.run(run())


async def wait_engine(b: Any, proc: asyncio.subprocess.Process, timeout_s: float = 120.0) -> None:
    """Until the engine answers $SRV.PING for the inference service (it joins after loading)."""
    from nats.micro.service import ServiceVerb, control_subject

    subject = control_subject(ServiceVerb.PING, name=b.names.inference_service)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.returncode is not None:
            raise RuntimeError(f"engine process exited with {proc.returncode}")
        try:
            await b.nc.request(subject, b"", timeout=0.5)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine process not serving after {timeout_s:.0f}s") from None
            await asyncio.sleep(0.1)


async def stop_engine(proc: asyncio.subprocess.Process, log: Any = None, grace_s: float = 30.0) -> None:
    """SIGTERM a bench's child (an engine drains), SIGKILL after ``grace_s``; its log
    file (if any) removed."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    if log is not None:
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def rss_mb(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).memory_info().rss) / 2**20


# ---------------------------------------------------------------- the load


async def closed_loop(client: Any, schema: Any, tenants: Sequence[str], concurrency: int,
                       total: int) -> dict[str, Any]:
    """``concurrency`` workers each send one request at a time until ``total`` are answered."""
    lat: list[float] = []
    sizes: list[int] = []
    counter = iter(range(total))
    obs = [sample_obs(i) for i in range(16)]

    async def worker(w: int) -> None:
        for j in counter:
            t0 = time.perf_counter()
            r = await client.request(tenants[(w + j) % len(tenants)], schema=schema, timeout_s=30,
                                     **obs[j % len(obs)])
            lat.append((time.perf_counter() - t0) * 1e3)
            sizes.append(r.batch.size)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": total,
        "p50_ms": percentile(lat, 50, digits=2),
        "p99_ms": percentile(lat, 99, digits=2),
        "throughput_rps": round(total / elapsed, 1),
        "mean_batch_size": round(statistics.fmean(sizes), 2),
    }
