"""Heads that read token features (issue 12, item 2): ``oft_attn`` and ``gr00t_flow``.

On the real tiny backbone (random weights, built from config): one backbone
forward serves a group that mixes pooled and token heads, grouped equals serial
even where padding differs, pads never change a token head's output, each head
learns, PPO runs on ``oft_attn``, and an ``oft_attn`` workload trains through the
service (SFT via the SDK) and answers through the Inference Queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.features import (
    FeatureBatch,
    FeatureSchema,
    TokenFeatures,
    canonicalize_request,
    concat_batches,
    pack_tokens,
    unpack_tokens,
)
from joynexus.agents.models.grouped import (
    ActRequest,
    TrainItem,
    encode_for,
    features_for,
    grouped_forward,
    grouped_train_step,
    isolated_train_step,
    serial_forward,
    serial_train_step,
)
from joynexus.agents.models.heads.base import HEADS, HeadConfig, build_head
from joynexus.agents.models.heads.ppo import PPOBatch
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.heads.token import GR00TFlowHead, OFTAttnHead
from joynexus.schemas.catalog import ACTION_MODULES, BASE_FAMILY_HEADS
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch
from joynexus.schemas.workloads import WorkloadSpec

pytestmark = pytest.mark.timeout(120)

CAMS = ("front",)
HW = (56, 56)
ATOL = 1e-5  # batched matmuls reorder float sums: grouped and serial agree to ~1e-7 here
D = 64  # the tiny backbone's hidden size


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.build(BackboneConfig(size="tiny"))


def make_batch(seed: int, b: int, instr: str, state_dim: int = 8, action_dim: int = 7,
               horizon: int = 8) -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    schema = FeatureSchema(CAMS, HW, state_dim, action_dim, horizon)
    images = {s: torch.randint(0, 256, (b, 3, *HW), dtype=torch.uint8, generator=g) for s in CAMS}
    # Rows of different lengths within a batch too (a few extra words per row).
    instructions = [instr + " and then" * i for i in range(b)]
    return canonicalize_request(schema, images, instructions, torch.randn(b, state_dim, generator=g))


def mixed_group() -> list[tuple[str, FeatureBatch, int]]:
    """oft_mlp, oft_attn and gr00t_flow tenants whose instructions differ in length."""
    return [("oft_mlp", make_batch(10, 2, "go", state_dim=8), 0),
            ("oft_attn", make_batch(11, 3, "push the red cube all the way to the goal", state_dim=5), 1),
            ("gr00t_flow", make_batch(12, 2, "pick it up", state_dim=4), 2)]


def test_registry_is_the_list_of_action_modules() -> None:
    assert set(ACTION_MODULES) == set(HEADS) - {"value"} and set(BASE_FAMILY_HEADS) <= set(ACTION_MODULES)
    assert HEADS["oft_attn"] is OFTAttnHead and HEADS["gr00t_flow"] is GR00TFlowHead
    assert {n: HEADS[n].reads for n in HEADS} == {
        "oft_mlp": "pooled", "flow_matching": "pooled", "value": "pooled",
        "oft_attn": "tokens", "gr00t_flow": "tokens", "pi05_expert": "tokens",
        "smolvla_expert": "tokens"}
    for name in ("oft_attn", "gr00t_flow"):
        assert WorkloadSpec(name="w", task_type="rl", env="PushCube-v1", action_module=name).action_module == name
    with pytest.raises(InvalidSpec, match="action_module 'qwen_fast'"):
        WorkloadSpec(name="w", task_type="rl", env="PushCube-v1", action_module="qwen_fast")


def test_token_features_pool_like_encode_and_split_like_alone(backbone: Backbone) -> None:
    batches = [b for _, b, _ in mixed_group()]
    shared = concat_batches(batches)
    feats = backbone.encode_tokens(shared)
    # A pooled head reads exactly what encode gives (same forward, pooled once).
    assert torch.equal(feats.pooled(), backbone.encode(shared))
    assert not backbone.encode_tokens(shared, tokens=False).has_tokens
    parts = feats.split(shared.slices)
    longest = int(feats.real_B_L.sum(1).max())  # type: ignore[union-attr]
    for part, batch in zip(parts, batches, strict=True):
        alone = backbone.encode_tokens(batch)
        # Cut to the part's own longest row: the layout of a forward of its own.
        assert part.h_B_L_D is not None and alone.h_B_L_D is not None
        assert part.h_B_L_D.shape == alone.h_B_L_D.shape
        assert torch.equal(part.real_B_L, alone.real_B_L)
        x, x_alone = part.tokens(), alone.tokens()
        assert x.shape == (batch.batch_size, alone.h_B_L_D.shape[1], D + 1) and not x.is_inference()
        torch.testing.assert_close(x, x_alone, atol=ATOL, rtol=1e-5)
    assert max(p.h_B_L_D.shape[1] for p in parts if p.h_B_L_D is not None) == longest
    assert min(p.h_B_L_D.shape[1] for p in parts if p.h_B_L_D is not None) < longest  # padding differs
    with pytest.raises(InvalidSpec, match="tokens=True"):
        TokenFeatures(feats.pooled()).tokens()
    with pytest.raises(ShapeMismatch, match="token features must be"):
        unpack_tokens(torch.zeros(2, 3, D), D)
    with pytest.raises(ShapeMismatch, match="mask channel"):
        unpack_tokens(torch.zeros(2, 3, D + 1), D)  # no real token in a row


def _requests() -> list[ActRequest]:
    reqs = []
    for head_type, batch, seed in mixed_group():
        cfg = HeadConfig(D, batch.schema.state_dim, seed=seed)
        noise = torch.randn(batch.batch_size, 8, 7) if head_type == "gr00t_flow" else None
        reqs.append(ActRequest(TenantModule(f"t{seed}", head_type, cfg), batch, noise))
    return reqs


def test_grouped_vs_serial_forward_mixed_pooled_and_token_heads(backbone: Backbone) -> None:
    reqs = _requests()
    grouped = grouped_forward(backbone, reqs)
    serial = serial_forward(backbone, reqs)
    assert [tuple(g.shape) for g in grouped] == [(2, 8, 7), (3, 8, 7), (2, 8, 7)]
    for g, s in zip(grouped, serial, strict=True):
        torch.testing.assert_close(g, s, atol=ATOL, rtol=1e-5)
    # The pooled tenant's output is bit for bit today's (features from encode).
    mlp = reqs[0]
    shared = concat_batches([r.batch for r in reqs])
    today = mlp.tenant.act(backbone.encode(shared)[:2], mlp.batch.state_B_S)
    assert torch.equal(grouped[0], today)


def test_grouped_vs_serial_train_step_mixed(backbone: Backbone) -> None:
    def items() -> list[TrainItem]:
        out = []
        for head_type, batch, seed in mixed_group():
            g = torch.Generator().manual_seed(100 + seed)
            target = torch.randn(batch.batch_size, 8, 7, generator=g)
            tm = TenantModule(f"t{seed}", head_type, HeadConfig(D, batch.schema.state_dim, seed=seed))
            out.append(TrainItem(tm, batch, target))
        return out

    g_items, s_items, i_items = items(), items(), items()
    g_curves = [grouped_train_step(backbone, g_items) for _ in range(4)]
    s_curves = [serial_train_step(backbone, s_items) for _ in range(4)]
    i_curves = [isolated_train_step(backbone, i_items) for _ in range(4)]
    for step_g, step_s, step_i in zip(g_curves, s_curves, i_curves, strict=True):
        for lg, ls, li in zip(step_g, step_s, step_i, strict=True):
            assert isinstance(li, float)
            assert abs(lg - ls) <= 1e-4 * max(1.0, abs(ls)), (g_curves, s_curves)
            assert abs(li - ls) <= 1e-4 * max(1.0, abs(ls)), (i_curves, s_curves)
    assert [it.tenant.version for it in g_items] == [4, 4, 4]
    for a, b in zip(g_items, s_items, strict=True):  # the weights too, not only the losses
        for k, v in a.tenant.head.state_dict().items():
            torch.testing.assert_close(v, b.tenant.head.state_dict()[k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_type", ["oft_attn", "gr00t_flow"])
def test_pad_tokens_do_not_change_a_token_head(backbone: Backbone, head_type: str) -> None:
    batch = make_batch(3, 3, "push the cube", state_dim=6)
    head = build_head(head_type, HeadConfig(D, 6, seed=4))
    x = encode_for(backbone, batch, head)
    h, real = unpack_tokens(x, D)
    # Six more pad positions holding garbage (a head must mask them, not rely on zeros).
    junk = torch.randn(3, 6, D) * 50.0
    padded = torch.cat([torch.cat([h, junk], 1), torch.cat([real, torch.zeros(3, 6, dtype=torch.bool)], 1)[..., None].float()], -1)
    noise = torch.randn(3, 8, 7)
    kw: dict[str, Any] = {"noise": noise} if head_type == "gr00t_flow" else {}
    with torch.no_grad():
        torch.testing.assert_close(head.act(padded, batch.state_B_S, **kw), head.act(x, batch.state_B_S, **kw),
                                   atol=1e-6, rtol=1e-6)
        if isinstance(head, OFTAttnHead):
            torch.testing.assert_close(head.value(padded, batch.state_B_S), head.value(x, batch.state_B_S),
                                       atol=1e-6, rtol=1e-6)
        # A real token does change it (the tokens reach the output).
        moved = x.clone()
        moved[:, 1, :D] += torch.randn(D)  # (a shift of all channels alone would vanish in LayerNorm)
        assert (head.act(moved, batch.state_B_S, **kw) - head.act(x, batch.state_B_S, **kw)).abs().max() > 1e-4
    # Zeros at pads after packing, whatever the forward left there.
    assert torch.equal(pack_tokens(torch.cat([h, junk], 1), torch.cat([real, torch.zeros(3, 6, dtype=torch.bool)], 1))[:, -6:],
                       torch.zeros(3, 6, D + 1))


@pytest.mark.parametrize("head_type", ["oft_attn", "gr00t_flow"])
def test_each_token_head_learns_a_task_that_needs_the_image(backbone: Backbone, head_type: str) -> None:
    """Targets that depend on where the image is bright: the tokens must carry it."""
    g = torch.Generator().manual_seed(0)
    b = 32
    schema = FeatureSchema(CAMS, HW, 6, 3, 4)
    images = torch.randint(0, 256, (b, 3, *HW), dtype=torch.uint8, generator=g)
    batch = canonicalize_request(schema, {"front": images}, "push the cube", torch.randn(b, 6, generator=g))
    q = images.float().mean(1).view(b, 2, 28, 2, 28).mean((2, 4)).reshape(b, 4) / 128.0 - 1.0
    s = batch.state_B_S
    target = torch.tanh(torch.stack([q[:, 0] + s[:, 0], q[:, 1] - q[:, 2], 4 * q[:, 3]], -1))
    target = (target[:, None, :] * torch.linspace(0.5, 1.0, 4)[None, :, None]).contiguous()
    tm = TenantModule("t", head_type, HeadConfig(D, 6, 3, 4, hidden=64, seed=1), lr=3e-3)
    x = encode_for(backbone, batch, tm)
    rng0 = tm.head.generator.get_state()

    def fixed_loss() -> float:  # the same noise/t draws each time: a deterministic yardstick
        keep = tm.head.generator.get_state()
        tm.head.generator.set_state(rng0)
        with torch.no_grad():
            out = float(tm.head.loss(x, s, target))
        tm.head.generator.set_state(keep)
        return out

    first = fixed_loss()
    for _ in range(120):
        tm.train_step(x, s, target)
    assert fixed_loss() < (0.35 if head_type == "gr00t_flow" else 0.2) * first, (first, fixed_loss())
    assert tm.version == 120
    if head_type == "gr00t_flow":  # sampling: deterministic given the noise, near the targets
        noise = torch.randn(b, 4, 3, generator=g)
        a1, a2 = tm.act(x, s, noise=noise), tm.act(x, s, noise=noise.clone())
        assert torch.equal(a1, a2)
        assert float((a1 - target).abs().mean()) < 0.5 * float(target.abs().mean())


def test_ppo_on_oft_attn_and_advantage_weights_on_gr00t_flow(backbone: Backbone) -> None:
    batch = make_batch(5, 6, "push the cube", state_dim=5, action_dim=3, horizon=4)
    tm = TenantModule("t", "oft_attn", HeadConfig(D, 5, 3, 4, seed=2), lr=1e-3)
    assert tm.gaussian
    head = tm.head
    assert isinstance(head, OFTAttnHead)
    x = encode_for(backbone, batch, tm)
    s = batch.state_B_S
    with torch.no_grad():
        actions = head.sample(x, s)
        old_logp = head.log_prob(x, s, actions)
        values = head.value(x, s)
    assert old_logp.shape == (6,) and values.shape == (6,) and torch.isfinite(old_logp).all()
    # The critic reads tokens through its own attention; its weights are the critic group.
    critic = {id(p) for p in head.critic_parameters()}
    assert {id(p) for p in head.critic_attn.parameters()} <= critic
    assert not {id(p) for p in head.reader.parameters()} & critic
    reader_before = [p.detach().clone() for p in head.reader.parameters()]
    ppo = PPOBatch(old_logp_B=old_logp, adv_B=torch.linspace(-1, 1, 6), returns_B=torch.linspace(0, 1, 6),
                   policy_coef=0.0)  # a critic-only step must not move the actor's token reader
    tm.stage_ppo(ppo)
    loss = tm.train_step(x, s, actions)
    assert np.isfinite(loss) and tm.version == 1 and np.isfinite(tm.last_stats["value_loss"])
    assert all(torch.equal(a, b) for a, b in zip(reader_before, head.reader.parameters(), strict=True))
    tm.stage_ppo(PPOBatch(old_logp_B=old_logp, adv_B=torch.linspace(-1, 1, 6), returns_B=torch.zeros(6)))
    assert np.isfinite(tm.train_step(x, s, actions))
    assert any(not torch.equal(a, b) for a, b in zip(reader_before, head.reader.parameters(), strict=True))

    flow = TenantModule("f", "gr00t_flow", HeadConfig(D, 5, 3, 4, seed=2))
    assert not flow.gaussian
    with pytest.raises(InvalidSpec, match="advantage weights"):
        flow.stage_ppo(ppo)
    xf = encode_for(backbone, batch, flow)

    def weighted(w: torch.Tensor | None) -> float:
        h = build_head("gr00t_flow", HeadConfig(D, 5, 3, 4, seed=2))  # same init, same draws
        return float(h.loss(xf, s, actions, w))

    assert weighted(torch.full((6,), 3.0)) == pytest.approx(weighted(None), rel=1e-6)
    assert weighted(torch.tensor([1.0, 0, 0, 0, 0, 0])) != pytest.approx(weighted(None), rel=1e-3)


def test_token_heads_round_trip_export(tmp_path: Path, backbone: Backbone) -> None:
    """Weights and normalisation travel in the export (their size next to the bench
    backbone: test_models' test_head_is_tiny_next_to_bench_backbone covers every head)."""
    batch = make_batch(6, 2, "go", state_dim=5)
    for name in ("oft_attn", "gr00t_flow"):
        small = TenantModule("acme", name, HeadConfig(D, 5, seed=3))
        small.set_normalization({"action": {"mean": [1.0] * 7, "std": [2.0] * 7}})
        x = encode_for(backbone, batch, small)
        back = TenantModule.import_safetensors(small.export_safetensors(tmp_path / name))
        noise = torch.randn(2, 8, 7)
        kw: dict[str, Any] = {"noise": noise} if name == "gr00t_flow" else {}
        assert torch.equal(back.act(x, batch.state_B_S, **kw), small.act(x, batch.state_B_S, **kw))
        with pytest.raises(ShapeMismatch, match="token features must be"):
            small.act(features_for(TenantModule("p", "oft_mlp", HeadConfig(D, 5)), backbone.encode_tokens(batch)),
                      batch.state_B_S, **kw)


# -- through the service --------------------------------------------------------------


@pytest.fixture(scope="module")
def datasets_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from joynexus.agents.envs.lerobot_data import generate_dataset

    root = tmp_path_factory.mktemp("datasets")
    generate_dataset("PushCube-v1", root / "acme" / "push", episodes=1, obs="rgb", image_size=64, seed=0)
    import shutil

    shutil.copytree(root / "acme" / "push", root / "bolt" / "push")
    return root


@pytest.fixture
async def deployment(broker: Any, backbone: Backbone, tmp_path: Path, datasets_root: Path) -> AsyncIterator[Any]:
    from joynexus.agents.actor.agent import Actor
    from joynexus.agents.control import ControlPlane
    from joynexus.agents.inference import EnginePool
    from joynexus.agents.producers import PolicyInitializer, ProducerAgent
    from joynexus.agents.scheduler import SchedulerAgent

    stop = asyncio.Event()
    sched = SchedulerAgent(broker, instance="sched", lease_ttl_s=5.0, expire_every_s=0.2)
    await sched.start()
    control = ControlPlane(broker, init_policy=PolicyInitializer(broker), instance="control",
                           datasets_root=datasets_root)
    await control.start()
    # A wide batching window: requests that arrive while a batch runs wait for company.
    pool = EnginePool(broker, backbone, max_batch=16, max_wait_ms=300)
    await pool.scale_to(1)
    tasks = [
        asyncio.create_task(Actor(broker, backbone, instance="actor", out_dir=tmp_path / "actor",
                                  lease_wait_s=0.5).run(stop)),
        asyncio.create_task(ProducerAgent(broker, "sft", instance="prod-sft").run(stop)),
    ]
    yield sched
    stop.set()
    await asyncio.wait(tasks, timeout=30)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()
    await control.stop()
    await sched.stop()


@pytest.mark.e2e
async def test_oft_attn_workload_trains_through_the_service_and_acts_grouped(
    deployment: Any, nats_server: Any, broker: Any, backbone: Backbone
) -> None:
    """SFT via the SDK for an oft_attn and an oft_mlp tenant (their jobs may share the
    actor's forward), then both act through the Inference Queue in one batch; the
    answers are what the published heads give on features computed here."""
    from joynexus.agents.models.policyio import PolicyStore, feature_schema_of, module_from_weights
    from joynexus.broker.inference_client import InferenceClient
    from joynexus.schemas.jobs import JobState
    from joynexus.schemas.workloads import Scheduling
    from joynexus.sdk import Client

    sched = deployment
    target = 2
    clients = {t: await Client.connect(nats_server.url, tenant=t, namespace=broker.names.namespace)
               for t in ("acme", "bolt")}
    heads = {"acme": "oft_attn", "bolt": "oft_mlp"}
    try:
        for tenant, c in clients.items():
            await c.create_workload(WorkloadSpec(
                name="push", task_type="sft", dataset="push", batch_size=8, action_horizon=2,
                head_hidden=32, action_module=heads[tenant],
                scheduling=Scheduling(max_in_flight=4, completion_target=target)))

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while not all(sched.core.by_tenant_state.get(t, {}).get("completed", 0) >= target for t in clients):
            failed = [j.reason for j in sched.core.jobs.values() if j.state is JobState.FAILED]
            assert not failed, failed
            assert loop.time() < deadline, dict(sched.core.by_tenant_state)
            await asyncio.sleep(0.25)

        store = PolicyStore(broker)
        recs = {t: await store.latest(t, "push") for t in clients}
        assert {t: r.version for t, r in recs.items()} == {"acme": 1 + target, "bolt": 1 + target}
        assert recs["acme"].head_type == "oft_attn"
        schema = feature_schema_of(recs["acme"])
        rng = np.random.default_rng(0)
        obs = {t: ({c: rng.integers(0, 255, (2, 3, *schema.image_hw), dtype=np.uint8) for c in schema.camera_slots},
                   rng.standard_normal((2, schema.state_dim)).astype(np.float32)) for t in clients}
        # The Inference Queue's client (the SDK's own), for the reply's batch info: a few
        # rounds of both tenants at once; the engine batches what arrives together.
        infer = InferenceClient(broker)

        async def ask(t: str) -> Any:
            return await infer.request(t, schema=recs[t].schema_signature, workload="push",
                                       policy_version=recs[t].version, images=obs[t][0],
                                       instruction="push the cube", state=obs[t][1])

        shared = 0
        for _ in range(4):
            replies = await asyncio.gather(ask("acme"), ask("acme"), ask("bolt"))
            shared += replies[2].batch.batch_id in {r.batch.batch_id for r in replies[:2]}
            for t, reply in (("acme", replies[0]), ("bolt", replies[2])):
                module = module_from_weights(recs[t], await store.load_weights(recs[t]))
                batch = canonicalize_request(feature_schema_of(recs[t]), obs[t][0], "push the cube", obs[t][1])
                want = module.act(encode_for(backbone, batch, module), batch.state_B_S)
                got = reply.actions.to_array("actions")
                assert got.shape == (2, 2, schema.action_dim) and reply.policy_version == 1 + target
                np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=1e-4)
        assert shared >= 1, shared  # an oft_attn and an oft_mlp tenant served by one backbone forward
        # And the tenant's own SDK call answers the same.
        via_sdk = await clients["acme"].act("push", images=obs["acme"][0], state=obs["acme"][1],
                                            instruction="push the cube", version=recs["acme"].version)
        np.testing.assert_allclose(via_sdk, replies[0].actions.to_array("actions"), atol=1e-5, rtol=1e-5)
    finally:
        for c in clients.values():
            await c.close()
