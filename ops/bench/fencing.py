"""What tenant fencing costs: figures of a secured embedded deployment (JSON).

- ``tenant_add_s``: issuing a tenant its user until the server applied it
  (bcrypt hash, identities bucket, auth.conf, SIGHUP reload, ``_applied``).
- ``connect_ms``: a tenant's ``Client.connect`` (the server checks a bcrypt
  hash on every connect), p50 over several connects.
- ``submit_mb_s`` vs ``direct_put_mb_s``: a tenant's ``submit_rollout``
  (rows relayed through the control plane) against the service writing the
  same rows straight into the Training Queue; ``relay_ratio`` = submit /
  direct, per size.
- ``event_latency_ms``: a job event's append to the tenant's ``events()``
  yielding it (long-polled through the control plane), p50/p99.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import uuid
from typing import Any

import numpy as np

from joynexus.agents.control import ControlPlane
from joynexus.agents.producers import PolicyInitializer
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.ops.admin.tenants import add_tenant
from joynexus.ops.measure.stats import percentile
from joynexus.ops.runtime.deploy import embedded
from joynexus.schemas.workloads import Scheduling, WorkloadSpec
from joynexus.sdk import Client

MB = 1024 * 1024
ROW_BYTES = 3 * 64 * 64 + 12 * 4 + 2 * 4 * 4 + 8 + 8 + 4 + 1  # one PickCube step


def _rollout(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs_image_base_camera": rng.integers(0, 255, (rows, 3, 64, 64), dtype=np.uint8),
        "obs_state": rng.standard_normal((rows, 12), dtype=np.float32),
        "actions": rng.uniform(-1, 1, (rows, 2, 4)).astype(np.float32),
        "env_id": np.zeros(rows, np.int64),
        "step": np.arange(rows, dtype=np.int64),
        "rewards": rng.standard_normal(rows).astype(np.float32),
        "dones": np.zeros(rows, bool),
    }


async def _run(url: str, admin: Broker, service: Broker, repeats: int) -> dict[str, Any]:
    sched = SchedulerAgent(service, instance="bench-sched", lease_ttl_s=60)
    await sched.start()
    control = ControlPlane(service, init_policy=PolicyInitializer(service), instance="bench-ctl")
    await control.start()
    try:
        t0 = time.perf_counter()
        creds, reply = await add_tenant(admin, "acme", url=url)
        tenant_add_s = time.perf_counter() - t0
        assert reply.applied == "yes", reply.applied
        connects = []
        for _ in range(5):
            t0 = time.perf_counter()
            c = await Client.connect(credentials=creds)
            connects.append((time.perf_counter() - t0) * 1000)
            await c.close()
        client = await Client.connect(credentials=creds)
        await client.create_workload(
            WorkloadSpec(
                name="own", task_type="rl", env="PickCube-v1", source="tenant", action_horizon=2,
                scheduling=Scheduling(max_in_flight=16, max_active_rollouts=4),
            )
        )
        latencies: list[float] = []
        seen = asyncio.Event()

        async def watch() -> None:
            async for ev in client.events("own", from_start=False):
                latencies.append((time.time() - ev.at) * 1000)
                seen.set()

        watcher = asyncio.ensure_future(watch())
        await asyncio.sleep(0.5)
        tq = TrainingQueue(service)
        sizes: dict[str, Any] = {}
        for mb in (1, 4, 8):
            rows = max(1, mb * MB // ROW_BYTES)
            data = _rollout(rows, mb)
            submit = direct = 0.0
            for i in range(repeats):
                t0 = time.perf_counter()
                await client.submit_rollout("own", data, behavior_policy_version=1)
                submit += time.perf_counter() - t0
                t0 = time.perf_counter()
                await tq.async_put(data, tenant_id="bench", partition_id=f"p{mb}-{i}")
                direct += time.perf_counter() - t0
                await tq.async_clear_partition("bench", f"p{mb}-{i}")
            nbytes = sum(a.nbytes for a in data.values()) / MB
            sizes[f"{mb}MB"] = {
                "submit_mb_s": round(nbytes * repeats / submit, 1),
                "direct_put_mb_s": round(nbytes * repeats / direct, 1),
                "relay_ratio": round(direct / submit, 3),
            }
        await asyncio.wait_for(seen.wait(), 10)
        watcher.cancel()
        await client.close()
        return {
            "tenant_add_s": round(tenant_add_s, 3),
            "connect_ms_p50": round(statistics.median(connects), 1),
            "put": sizes,
            "event_latency_ms": {
                "events": len(latencies),
                "p50": percentile(latencies, 50, digits=2),
                "p99": percentile(latencies, 99, digits=2),
            },
        }
    finally:
        await control.stop()
        await sched.stop()


async def bench_fencing(repeats: int = 3) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="jnx-fence-") as d:
        with embedded(d, namespace="jnx", act_as_admin=False) as ep:
            assert ep.admin and ep.service
            admin = await Broker.connect(ep.url, name="bench-admin", credentials=ep.admin)
            service = await Broker.connect(ep.url, name="bench-service", credentials=ep.control)
            try:
                return {"bench": "fencing", "run": uuid.uuid4().hex[:6],
                        **await _run(ep.url, admin, service, repeats)}
            finally:
                await service.close()
                await admin.close()


if __name__ == "__main__":
    import json

    print(json.dumps(asyncio.run(bench_fencing())))
