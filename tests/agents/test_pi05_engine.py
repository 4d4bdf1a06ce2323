"""The Inference Queue on a real nats-server with the π0.5 base resident: tenants'
``pi05_expert`` policies decode over one shared prefix forward, equal to each request
alone in process; the engine announces its base (``joynexus status``'s ``base``)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from joynexus.agents.inference import InferenceClient, InferenceEngine
from joynexus.agents.models.families import build_base
from joynexus.agents.models.features import FeatureSchema, canonicalize_request
from joynexus.agents.models.grouped import ActRequest, serial_forward
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import PolicyStore
from joynexus.broker.connection import Broker
from joynexus.ops.admin.bases import base_of
from joynexus.ops.admin.status import collect

pytestmark = pytest.mark.timeout(90)

CAMS = ("front",)
H, A = 4, 3


@pytest.fixture(scope="module")
def base() -> Any:
    return build_base("pi05", "tiny")


def schema(state_dim: int) -> FeatureSchema:
    return FeatureSchema(CAMS, (56, 56), state_dim, A, H, base_model="pi05-tiny")


def module(base: Any, tenant: str, state_dim: int, seed: int) -> TenantModule:
    cfg = HeadConfig(base.feature_dim, state_dim, A, H, hidden=32, flow_steps=3, seed=seed, kv_layers=base.kv_layout[0])
    m = TenantModule(tenant, "pi05_expert", cfg)
    with torch.no_grad():  # a trained-looking expert (the adaptive norms start at zero)
        for p in m.head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    return m


def obs(seed: int, b: int, state_dim: int) -> dict[str, Any]:
    g = np.random.default_rng(seed)
    return dict(images={c: g.integers(0, 256, (b, 3, 56, 56), dtype=np.uint8) for c in CAMS},
                instruction=[f"push the cube {'left' if i % 2 else 'right'}" for i in range(b)],
                state=g.standard_normal((b, state_dim)).astype(np.float32))


async def test_pi05_policies_share_one_prefix_forward_in_the_engine(broker: Broker, base: Any) -> None:
    store = PolicyStore(broker)
    tenants = {"t0": (5, 0), "t1": (7, 1)}
    mods = {t: module(base, t, sd, seed) for t, (sd, seed) in tenants.items()}
    for t, (sd, _) in tenants.items():
        await store.publish(t, "default", mods[t], schema(sd))
    engine = InferenceEngine(broker, base, instance="e0", max_batch=2, max_wait_ms=2000)
    await engine.start()
    try:
        client = InferenceClient(broker, base_model="pi05-tiny")
        o = {t: obs(i, 2, sd) for i, (t, (sd, _)) in enumerate(tenants.items())}
        noise = {t: np.random.default_rng(20 + i).standard_normal((2, H, A)).astype(np.float32)
                 for i, t in enumerate(tenants)}
        replies = await asyncio.gather(*(client.request(t, schema=schema(tenants[t][0]), noise=noise[t], **o[t])
                                         for t in tenants))
        # One batch: the two tenants' rows went through one prefix forward.
        assert {r.batch.batch_id for r in replies} == {replies[0].batch.batch_id}
        assert all(r.batch.size == 2 and r.batch.rows == 4 and not r.batch.fallback for r in replies)
        for t, r in zip(tenants, replies, strict=True):
            sd = tenants[t][0]
            fb = canonicalize_request(schema(sd), {c: torch.from_numpy(v) for c, v in o[t]["images"].items()},
                                      o[t]["instruction"], o[t]["state"])
            (alone,) = serial_forward(base, [ActRequest(mods[t], fb, torch.from_numpy(noise[t]))])
            got = r.actions.to_array()
            assert got.shape == (2, H, A) and r.policy_version == 1
            np.testing.assert_allclose(got, alone.numpy(), atol=1e-5, rtol=0)
        assert not np.allclose(replies[0].actions.to_array(), replies[1].actions.to_array()[:, :, :A])
        # The deployment's base, as `joynexus status --json` shows it.
        status = await collect(broker)
        assert status["base"] == {"family": "pi05", "params": base.num_params(), "base_model": "pi05-tiny"}
        assert status["inference_engines"][0]["base_model"] == "pi05-tiny"
    finally:
        await engine.close()


def test_base_of_reads_the_engines_metadata() -> None:
    assert base_of([]) == {"error": "no inference engine answering"}
    q = {"metadata": {"base_model": "qwen2.5-vl-tiny", "base_family": "qwen2_5_vl", "base_params": "182272"}}
    p = {"metadata": {"base_model": "pi05-tiny", "base_family": "pi05", "base_params": "oops"}}
    assert base_of([q, q]) == {"family": "qwen2_5_vl", "params": 182272, "base_model": "qwen2.5-vl-tiny"}
    assert base_of([q, p])["bases"][0] == {"family": "pi05", "params": None, "base_model": "pi05-tiny"}
