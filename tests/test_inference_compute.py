"""The engine's compute without a server: each policy's head runs once per batch over
all its requests' rows (agents/inference/compute.py), and the replies are what each
request would have got alone; a failing grouped call falls back to one call per
request, so the error stays with the request that caused it. Real tiny backbone and
real heads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from joynexus.agents.inference.batcher import Pending
from joynexus.agents.inference.compute import decode_grouped, decode_one, forward_grouped
from joynexus.agents.inference.policies import LoadedPolicy
from joynexus.agents.models.backbone import Backbone, BackboneConfig
from joynexus.agents.models.features import FeatureSchema, canonicalize_request, concat_batches
from joynexus.agents.models.heads import HeadConfig, TenantModule
from joynexus.schemas.inference import InferRequest, Observation, TensorBytes

SCHEMA = FeatureSchema(("front",), (28, 28), 8, 7, 8)


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.build(BackboneConfig(size="tiny"))


def policy(tenant: str, head: str, seed: int) -> LoadedPolicy:
    module = TenantModule(tenant, head, HeadConfig(64, 8, 7, 8, seed=seed))
    return LoadedPolicy(record=None, schema=SCHEMA, module=module)  # type: ignore[arg-type]


def pending(lp: LoadedPolicy, seed: int, rows: int = 1, noise: bool = False) -> Pending:
    g = np.random.default_rng(seed)
    state = g.standard_normal((rows, 8)).astype(np.float32)
    batch = canonicalize_request(
        SCHEMA, {"front": torch.from_numpy(g.integers(0, 256, (rows, 3, 28, 28), dtype=np.uint8))},
        "pick up the cube", state,
    )
    req = InferRequest(tenant_id=lp.module.tenant, schema_signature="s",
                       observation=Observation(images={}, instruction="x", state=TensorBytes.from_array(state)))
    n = torch.from_numpy(g.standard_normal((rows, 8, 7)).astype(np.float32)) if noise else None
    return Pending(None, req, lp, batch, n, SCHEMA.backbone_key(), None, 0.0)  # type: ignore[arg-type]


def count_calls(lp: LoadedPolicy, fail_on: float | None = None) -> list[int]:
    """Wrap the module's act: record each call's rows; raise when a row's state[0] == fail_on."""
    calls: list[int] = []
    act = lp.module.act

    def counted(feats: torch.Tensor, state: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append(int(state.shape[0]))
        if fail_on is not None and bool((state[:, 0] == fail_on).any()):
            raise ValueError("poisoned row")
        return act(feats, state, **kw)

    lp.module.act = counted  # type: ignore[method-assign]
    return calls


def test_each_policy_decodes_once_and_each_request_gets_its_own_rows(backbone: Backbone) -> None:
    a, b = policy("a", "oft_mlp", 1), policy("b", "flow_matching", 2)
    # interleaved tenants, different row counts; b's requests bring their own noise
    items = [pending(a, 0, 2), pending(b, 1, 1, noise=True), pending(a, 2, 1),
             pending(b, 3, 3, noise=True), pending(a, 4, 1)]
    calls_a, calls_b = count_calls(a), count_calls(b)
    shared = concat_batches([p.batch for p in items])
    with torch.inference_mode():
        feats = backbone.encode_tokens(shared, tokens=False)
        parts = feats.split(shared.slices)
        got = decode_grouped(items, parts)
        assert calls_a == [4] and calls_b == [4]  # one call per policy, all its rows
        alone = [decode_one(p, f) for p, f in zip(items, parts, strict=True)]
    for p, g, ref in zip(items, got, alone, strict=True):
        assert g.error is None and g.actions is not None and ref.actions is not None
        assert g.actions.shape == (p.batch.batch_size, 8, 7)
        torch.testing.assert_close(g.actions, ref.actions, rtol=1e-5, atol=1e-5)


def test_noise_given_and_not_given_do_not_share_a_call(backbone: Backbone) -> None:
    b = policy("b", "flow_matching", 2)
    items = [pending(b, 0, 1, noise=True), pending(b, 1, 2), pending(b, 2, 1, noise=True)]
    calls = count_calls(b)
    with torch.inference_mode():
        outs, _ = forward_grouped(backbone, items)
    assert sorted(calls) == [2, 2]
    assert [tuple(o.actions.shape) for o in outs if o.actions is not None] == [(1, 8, 7), (2, 8, 7), (1, 8, 7)]


def test_a_failing_grouped_call_fails_only_the_request_that_caused_it(backbone: Backbone) -> None:
    a, c = policy("a", "oft_mlp", 1), policy("c", "oft_mlp", 5)
    items = [pending(a, 0), pending(a, 1), pending(c, 2), pending(a, 3)]
    items[1].batch.state_B_S[0, 0] = 123.0  # this request's head call raises
    calls_a = count_calls(a, fail_on=123.0)
    with torch.inference_mode():
        outs, _ = forward_grouped(backbone, items)
    assert calls_a == [3, 1, 1, 1]  # the grouped call, then each request alone
    assert isinstance(outs[1].error, ValueError) and outs[1].actions is None
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].actions is not None
