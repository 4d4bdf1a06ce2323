"""``pi05_expert`` with ``expert_state="token"``: the robot state as one continuous suffix token
before the actions (LeRobot π0's ``embed_suffix`` layout), next to today's prompt-only head.
Grouped == serial for forwards and train steps with both settings in one group; the token
reads what the prompt's 256 bins cannot; the refusals at the door (spec, head config, copies,
LeRobot names)."""

from __future__ import annotations

import pytest
import torch
from grouped_checks import assert_same_steps

from joynexus.agents.models.features import FeatureBatch, FeatureSchema, canonicalize_request
from joynexus.agents.models.grouped import (
    ActRequest,
    TrainItem,
    grouped_forward,
    grouped_train_step,
    serial_forward,
    serial_train_step,
)
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.pi05 import Pi05ExpertHead, pi05_lerobot_keys
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.pi05_base import Pi05Base
from joynexus.agents.models.pi05_config import Pi05BaseConfig
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadSpec

pytestmark = pytest.mark.timeout(120)

H, A = 4, 3  # the tenants' action horizon and dims
STATES = ("prompt", "token")


@pytest.fixture(scope="module")
def base() -> Pi05Base:
    torch.set_num_threads(1)
    return Pi05Base.build(Pi05BaseConfig(max_state_dim=8))


def rows(seed: int, b: int, state_dim: int = 5, state: torch.Tensor | None = None) -> FeatureBatch:
    g = torch.Generator().manual_seed(seed)
    schema = FeatureSchema(("front",), (56, 56), state_dim, A, H, base_model="pi05-tiny")
    imgs = {"front": torch.randint(0, 256, (b, 3, 56, 56), generator=g, dtype=torch.uint8)}
    st = torch.randn(b, state_dim, generator=g) if state is None else state
    return canonicalize_request(schema, imgs, "push the cube", st)


def expert(base: Pi05Base, name: str, state_dim: int, seed: int, expert_state: str,
           trained: bool = False) -> TenantModule:
    cfg = HeadConfig(feature_dim=base.feature_dim, state_dim=state_dim, action_dim=A, action_horizon=H,
                     hidden=32, flow_steps=3, seed=seed, kv_layers=base.kv_layout[0],
                     expert_state=expert_state)  # type: ignore[arg-type]
    m = TenantModule(name, "pi05_expert", cfg, lr=1e-3)
    if trained:  # a trained-looking expert: the adaptive norms' zero init keeps its residuals small
        with torch.no_grad():
            for p in m.head.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return m


def test_the_state_token_is_built_last_so_the_other_weights_are_the_same_draws(base: Pi05Base) -> None:
    prompt, token = (expert(base, "a", 5, 7, s).head.state_dict() for s in STATES)
    assert set(token) - set(prompt) == {"state_proj.weight", "state_proj.bias"}
    assert all(torch.equal(prompt[k], token[k]) for k in prompt)
    assert tuple(token["state_proj.weight"].shape) == (32, 5)  # the state to one expert-wide token


def test_grouped_equals_serial_forward_with_both_settings(base: Pi05Base) -> None:
    reqs = []
    for i, (sd, es) in enumerate([(5, "token"), (7, "prompt"), (4, "token"), (5, "prompt")]):
        fb = rows(20 + i, 1 + i % 3, sd)
        noise = torch.randn(fb.batch_size, H, A, generator=torch.Generator().manual_seed(i))
        reqs.append(ActRequest(expert(base, f"t{i}", sd, i, es, trained=True), fb, noise))
    grouped, serial = grouped_forward(base, reqs), serial_forward(base, reqs)
    for g, s, r in zip(grouped, serial, reqs, strict=True):
        assert g.shape == (r.batch.batch_size, H, A)
        torch.testing.assert_close(g, s, atol=1e-5, rtol=1e-5)
    # A row's actions do not depend on who shares its forward.
    alone = serial_forward(base, [reqs[2]])[0]
    torch.testing.assert_close(grouped[2], alone, atol=1e-5, rtol=1e-5)


def test_grouped_train_steps_equal_serial_with_both_settings(base: Pi05Base) -> None:
    def items() -> list[TrainItem]:
        out = []
        for i, (sd, es) in enumerate([(5, "token"), (7, "prompt"), (6, "token")]):
            fb = rows(30 + i, 2 + i % 2, sd)
            target = torch.randn(fb.batch_size, H, A, generator=torch.Generator().manual_seed(60 + i))
            out.append(TrainItem(expert(base, f"t{i}", sd, i, es), fb, target))
        return out

    g_items, s_items = items(), items()
    g_curves = [grouped_train_step(base, g_items) for _ in range(4)]
    s_curves = [serial_train_step(base, s_items) for _ in range(4)]
    assert_same_steps(g_curves, s_curves, g_items, s_items)
    # The state token learns: its projection moved.
    fresh = expert(base, "t0", 5, 0, "token").head.state_dict()["state_proj.weight"]
    assert not torch.equal(fresh, g_items[0].tenant.head.state_dict()["state_proj.weight"])


def test_a_state_change_below_the_prompts_bins_moves_only_a_token_heads_actions(base: Pi05Base) -> None:
    """The prompt's 256 bins span +-3 standard deviations (0.023 a bin at unit spread): a change of
    0.001 inside a bin leaves the prompt, hence a prompt head's actions, exactly as they were."""
    s0 = torch.full((2, 5), 0.0117)  # the middle of bin 128 (bins of 6 / 256 = 0.0234)
    s1 = s0 + 1e-3
    ids0, ids1 = (base.tokenize(["push the cube"] * 2, (s / 3).numpy())[0] for s in (s0, s1))
    assert torch.equal(ids0, ids1)
    noise = torch.randn(2, H, A, generator=torch.Generator().manual_seed(3))
    moved = {}
    for es in STATES:
        m = expert(base, es, 5, 1, es, trained=True)
        a0, a1 = (serial_forward(base, [ActRequest(m, rows(40, 2, state=s), noise)])[0] for s in (s0, s1))
        moved[es] = float((a0 - a1).abs().max())
    assert moved["prompt"] == 0.0
    assert moved["token"] > 1e-5, moved


def test_only_pi05_expert_takes_a_state_token() -> None:
    from joynexus.agents.models.policyio import fresh_module

    spec = WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="pi05-tiny",
                        action_module="pi05_expert", head_hidden=32, action_horizon=H, expert_state="token")
    schema = FeatureSchema(("front",), (56, 56), 5, A, H, base_model="pi05-tiny")
    m = fresh_module("acme", spec, schema, {})
    assert isinstance(m.head, Pi05ExpertHead) and m.cfg.expert_state == "token" and m.head.state_proj is not None
    assert WorkloadSpec(name="w", task_type="sft", dataset="d").expert_state == "prompt"
    for module, model in (("oft_mlp", "qwen2.5-vl-tiny"), ("gr00t_flow", "pi05-tiny"), ("flow_matching", "pi05-tiny")):
        with pytest.raises(InvalidSpec, match=r"expert_state='token'.*pi05_expert only"):
            WorkloadSpec(name="w", task_type="sft", dataset="d", base_model=model, action_module=module,
                         expert_state="token")
    with pytest.raises(InvalidSpec, match="'prompt' or 'token'"):
        WorkloadSpec(name="w", task_type="sft", dataset="d", base_model="pi05-tiny", action_module="pi05_expert",
                     expert_state="digits")  # type: ignore[arg-type]
    # The torch side refuses the same, whoever builds the config (a record, an export's manifest).
    with pytest.raises(InvalidSpec, match="'prompt' or 'token'"):
        HeadConfig(feature_dim=8, state_dim=5, expert_state=["token"])  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec, match="pi05_expert only"):
        TenantModule("a", "flow_matching", HeadConfig(feature_dim=8, state_dim=5, expert_state="token"))


def test_a_copied_head_keeps_its_expert_state() -> None:
    """``init_from_workload`` and ``init_from_export`` copy a head's weights: a token head's
    ``state_proj`` has no place in a prompt head, nor the reverse."""
    from joynexus.agents.producers.init import copied_head_config

    schema = FeatureSchema(("front",), (56, 56), 5, A, H, base_model="pi05-tiny")

    def spec(es: str) -> WorkloadSpec:
        return WorkloadSpec(name="w2", task_type="sft", dataset="d", base_model="pi05-tiny",
                            action_module="pi05_expert", head_hidden=32, expert_state=es)  # type: ignore[arg-type]

    src = {"feature_dim": 32, "state_dim": 5, "hidden": 32, "kv_layers": 2}
    for have, want in (("token", "prompt"), ("prompt", "token")):
        with pytest.raises(InvalidSpec, match="reads the state as"):
            copied_head_config("v1", "pi05_expert", {**src, "expert_state": have}, schema.signature(), spec(want), schema)
    with pytest.raises(InvalidSpec, match="reads the state as 'prompt'"):  # an older record: no field, a prompt head
        copied_head_config("v1", "pi05_expert", src, schema.signature(), spec("token"), schema)
    cfg = copied_head_config("v1", "pi05_expert", {**src, "expert_state": "token"}, schema.signature(),
                             spec("token"), schema)
    assert HeadConfig(**cfg).expert_state == "token"


def test_a_token_head_has_no_lerobot_pi05_names(base: Pi05Base) -> None:
    """LeRobot's PI05Policy has no continuous state input: its names (the export a LeRobot
    checkpoint is, the reference model) are refused for a token head, kept for a prompt head."""
    from joynexus.agents.models.pi05_lerobot import lerobot_model, openpi_transformers

    token = expert(base, "a", 5, 0, "token")
    with pytest.raises(InvalidSpec, match="PI05Policy has no such input"):
        pi05_lerobot_keys(token.head.state_dict())
    with openpi_transformers(), pytest.raises(InvalidSpec, match="suffix token"):
        lerobot_model(base, token.head, steps=2)  # type: ignore[arg-type]
    prompt = pi05_lerobot_keys(expert(base, "b", 5, 0, "prompt").head.state_dict())
    assert "model.action_in_proj.weight" in prompt and not any("state_proj" in k for k in prompt)
