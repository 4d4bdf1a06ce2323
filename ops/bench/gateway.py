"""``joynexus bench gateway``: a round trip through the policy gateway (openpi's
websocket protocol) against a direct SDK ``act`` for the same policy and the same
observation, interleaved in one run (order flipped every round), and the
gateway's added cost as a paired difference of medians with its bootstrap 95%
interval.

A fresh secured deployment (``SecuredDeployment``: scheduler, control plane,
inference engine on the tiny backbone in this process), one tenant with a
workload at version 1, an API key, and a :class:`PolicyGateway` in this process
on a free port. Both arms ask the same engine; the gateway's arm adds the
websocket hop, msgpack-numpy decoding, the key's session and the observation's
mapping. See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from joynexus.agents.gateway import GatewayOptions, PolicyGateway
from joynexus.agents.gateway.codec import pack_array
from joynexus.ops.admin.apikeys import add_key
from joynexus.ops.isolation import SecuredDeployment
from joynexus.ops.measure.stats import difference_ci, interleaved_async, load, summarize
from joynexus.schemas.workloads import WorkloadSpec


async def bench_gateway(*, repeats: int = 200, warmup: int = 20) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    state = rng.standard_normal(12).astype(np.float32)
    frame = msgspec.msgpack.encode({"observation/image": pack_array(img),
                                    "observation/state": pack_array(state),
                                    "prompt": "pick the cube"})
    async with SecuredDeployment() as dep:
        await dep.issue("acme")
        client = await dep.client("acme")
        await client.create_workload(WorkloadSpec(
            name="pick", task_type="sft", dataset=await dep.dataset("acme"), source="tenant",
            action_horizon=2, instruction="pick the cube"))
        key, _ = await add_key(dep.admin, "acme", workload="pick")
        assert dep.service is not None
        gw = PolicyGateway(dep.service, GatewayOptions(host="127.0.0.1", port=0))
        await gw.start()
        try:
            async with connect(f"ws://127.0.0.1:{gw.port}",
                               additional_headers={"Authorization": f"Api-Key {key}"},
                               compression=None, max_size=None) as ws:
                await ws.recv()  # the metadata

                async def via_gateway() -> None:
                    await ws.send(frame)
                    reply = await ws.recv()
                    if isinstance(reply, str):
                        raise RuntimeError(reply)

                async def via_sdk() -> None:
                    await client.act("pick", images={"base_camera": img.transpose(2, 0, 1)[None]},
                                     state=state[None], instruction="pick the cube")

                runs = await interleaved_async({"gateway": via_gateway, "sdk": via_sdk},
                                               repeats=repeats, warmup=warmup)
        finally:
            await gw.stop()
    g, s = summarize(runs["gateway"]), summarize(runs["sdk"])
    diff, lo, hi = difference_ci(runs["gateway"], runs["sdk"])
    return {
        "gateway_p50_ms": g["p50_ms"], "gateway_p99_ms": g["p99_ms"],
        "sdk_p50_ms": s["p50_ms"], "sdk_p99_ms": s["p99_ms"],
        "overhead_p50_ms": round(diff, 3), "overhead_ci95": [round(lo, 3), round(hi, 3)],
        "rounds": repeats, "gateway": g, "sdk": s, "load": load(),
        "note": "gateway, engine and SDK client in one process (tiny backbone, CPU)",
    }
