"""The engine's compute without a server: each policy's head runs once per batch over
all its requests' rows, the heads of one architecture of several policies in one
stacked call (agents/inference/compute.py, agents/models/stacked.py), and the replies
are what each request would have got alone; a failing stacked or grouped call falls
back to one call per policy, then per request, so the error stays with the request
that caused it. Real tiny backbone and real heads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from joynexus.agents.inference import compute
from joynexus.agents.inference.batcher import Pending
from joynexus.agents.inference.compute import decode_grouped, decode_one, forward_grouped
from joynexus.agents.inference.policies import LoadedPolicy
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.features import FeatureSchema, canonicalize_request, concat_batches
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
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


def assert_each_as_alone(items: list[Any], got: list[Any], alone: list[Any]) -> None:
    """Every request answered, its rows' actions as its head gave them decoded alone."""
    for p, g, ref in zip(items, got, alone, strict=True):
        assert g.error is None and g.actions is not None and ref.actions is not None
        assert g.actions.shape == (p.batch.batch_size, 8, 7)
        torch.testing.assert_close(g.actions, ref.actions, rtol=1e-5, atol=1e-5)


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
    assert_each_as_alone(items, got, alone)


def test_heads_of_one_architecture_decode_in_one_stacked_call(backbone: Backbone) -> None:
    """Three OFT policies and two flow policies (their own noise): one stacked call per
    architecture, no head's own act called, each request's actions as alone."""
    oft = [policy(f"o{i}", "oft_mlp", 10 + i) for i in range(3)]
    flow = [policy(f"f{i}", "flow_matching", 20 + i) for i in range(2)]
    # three rows per OFT policy (oft0 in two requests), one per flow policy
    items = [pending(oft[0], 0, 2), pending(flow[0], 1, 1, noise=True), pending(oft[1], 2, 3),
             pending(oft[2], 3, 3), pending(flow[1], 4, 1, noise=True), pending(oft[0], 5, 1)]
    calls = [count_calls(lp) for lp in oft + flow]
    shared = concat_batches([p.batch for p in items])
    with torch.inference_mode():
        parts = backbone.encode_tokens(shared, tokens=False).split(shared.slices)
        got = decode_grouped(items, parts)
        assert calls == [[]] * 5  # the stacked path, not one act per policy
        alone = [decode_one(p, f) for p, f in zip(items, parts, strict=True)]
    assert_each_as_alone(items, got, alone)


def test_a_tenant_with_many_rows_does_not_pad_anothers_head_call(backbone: Backbone) -> None:
    """The stacked call pads to its largest unit: a tenant sending its quota's worth of
    rows must not make one-row tenants' heads compute as many. Its head decodes alone,
    the others stacked, each with its own actions."""
    big, small, peer = policy("big", "oft_mlp", 1), policy("small", "oft_mlp", 2), policy("peer", "oft_mlp", 3)
    items = [pending(big, 0, compute.STACK_MAX_ROWS + 1), pending(small, 1, 1), pending(peer, 2, 1)]
    calls = [count_calls(lp) for lp in (big, small, peer)]
    shared = concat_batches([p.batch for p in items])
    with torch.inference_mode():
        parts = backbone.encode_tokens(shared, tokens=False).split(shared.slices)
        got = decode_grouped(items, parts)
        # big alone; small and peer stacked, 1 row each
        assert calls[0] == [compute.STACK_MAX_ROWS + 1] and calls[1] == calls[2] == []
        alone = [decode_one(p, f) for p, f in zip(items, parts, strict=True)]
    for g, ref in zip(got, alone, strict=True):
        assert g.actions is not None and ref.actions is not None
        torch.testing.assert_close(g.actions, ref.actions, rtol=1e-5, atol=1e-5)


def test_noise_given_and_not_given_keep_their_own_rows(backbone: Backbone) -> None:
    b = policy("b", "flow_matching", 2)
    items = [pending(b, 0, 1, noise=True), pending(b, 1, 2), pending(b, 2, 1, noise=True)]
    shared = concat_batches([p.batch for p in items])
    with torch.inference_mode():
        parts = backbone.encode_tokens(shared, tokens=False).split(shared.slices)
        outs = decode_grouped(items, parts)
        for i in (0, 2):  # the requests that gave noise get exactly their own draw's actions
            ref = decode_one(items[i], parts[i]).actions
            assert ref is not None and outs[i].actions is not None
            torch.testing.assert_close(outs[i].actions, ref, rtol=1e-5, atol=1e-5)
    assert [tuple(o.actions.shape) for o in outs if o.actions is not None] == [(1, 8, 7), (2, 8, 7), (1, 8, 7)]


def test_a_failing_grouped_call_fails_only_the_request_that_caused_it(
    backbone: Backbone, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, c = policy("a", "oft_mlp", 1), policy("c", "oft_mlp", 5)
    items = [pending(a, 0), pending(a, 1), pending(c, 2, 3), pending(a, 3)]  # 3 rows each
    items[1].batch.state_B_S[0, 0] = 123.0  # this request's head call raises
    calls_a, calls_c = count_calls(a, fail_on=123.0), count_calls(c)
    stacked = compute.stacked_act
    tries: list[int] = []

    def poisoned(heads: Any, feats: Any, states: Any, noises: Any = None) -> Any:
        tries.append(len(heads))
        if any(bool((s[:, 0] == 123.0).any()) for s in states):
            raise ValueError("poisoned row")
        return stacked(heads, feats, states, noises)

    monkeypatch.setattr(compute, "stacked_act", poisoned)
    with torch.inference_mode():
        outs, _ = forward_grouped(backbone, items)
    assert tries == [2]  # a and c stacked, which failed
    assert calls_a == [3, 1, 1, 1] and calls_c == [3]  # then each policy, then a's requests alone
    assert isinstance(outs[1].error, ValueError) and outs[1].actions is None
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].actions is not None
