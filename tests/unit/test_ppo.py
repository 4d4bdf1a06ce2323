"""PPO math (pure) and the Gaussian policy head: ratio clipping, the value loss,
log-probabilities, and a real PPO training step that moves the policy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from joynexus.agents.models.heads.base import HeadConfig, build_head
from joynexus.agents.models.heads.gaussian import OFTMLPHead
from joynexus.agents.models.heads.ppo import PPOBatch, ppo_objective
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch


def _t(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def test_ratio_is_clipped_on_the_side_the_advantage_pushes() -> None:
    zeros = torch.zeros(4)
    # ratios 2.0, 0.5, 2.0, 0.5 (logp - old_logp = +-log 2); advantages +1, +1, -1, -1
    lr = math.log(2.0)
    loss, stats = ppo_objective(
        _t(lr, -lr, lr, -lr), zeros, _t(1, 1, -1, -1), zeros, zeros, clip=0.2, vf_coef=0.0
    )
    # per sample min(r A, clip(r) A): 1.2, 0.5, -2.0, -0.8 -> policy loss = -mean
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 2.0 - 0.8) / 4, abs=1e-6)
    assert stats["clip_frac"] == 1.0
    # the clipped samples carry no gradient; the unclipped ones d/dlogp (r A) = r A
    logp = _t(lr, -lr, lr, -lr).requires_grad_()
    ppo_objective(logp, zeros, _t(1, 1, -1, -1), zeros, zeros, clip=0.2, vf_coef=0.0)[0].backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 2.0 / 4, 0.0], abs=1e-6)


def test_ratio_one_is_the_plain_policy_gradient() -> None:
    adv = _t(0.5, -1.0, 2.0)
    loss, stats = ppo_objective(torch.zeros(3), torch.zeros(3), adv, torch.zeros(3), torch.zeros(3))
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == pytest.approx(0.0)


def test_value_loss_and_its_clipped_form() -> None:
    z = torch.zeros(2)
    values, returns = _t(1.0, -2.0), _t(0.0, 0.0)
    loss, stats = ppo_objective(z, z, z, values, returns, vf_coef=1.0)
    assert stats["value_loss"] == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert loss.item() == pytest.approx(stats["value_loss"])
    # Clipped: old values 0, clip 0.2 -> the clipped prediction is 0.2 / -0.2; the max
    # of the two errors is kept (1.0 vs 0.04; 4.0 vs 0.04): unchanged here ...
    _, s2 = ppo_objective(z, z, z, values, returns, vf_coef=1.0, old_values_B=z)
    assert s2["value_loss"] == pytest.approx(stats["value_loss"])
    # ... but moving away from a return past the clip range is not rewarded: old 0,
    # new 1.0, return 1.0 -> the clipped prediction 0.2 has error 0.64 and wins.
    _, s3 = ppo_objective(_t(0.0), _t(0.0), _t(0.0), _t(1.0), _t(1.0), vf_coef=1.0,
                          old_values_B=_t(0.0))
    assert s3["value_loss"] == pytest.approx(0.5 * 0.64)


def test_bad_inputs_are_refused() -> None:
    z = torch.zeros(3)
    with pytest.raises(ShapeMismatch):
        ppo_objective(z, torch.zeros(2), z, z, z)
    with pytest.raises(InvalidSpec):
        ppo_objective(z, z, z, z, z, clip=1.5)


CFG = HeadConfig(feature_dim=16, state_dim=5, action_dim=3, action_horizon=2, hidden=32, init_std=0.5)


def test_gaussian_log_prob_is_the_normal_density() -> None:
    head = build_head("oft_mlp", CFG)
    assert isinstance(head, OFTMLPHead)
    feats, state = torch.randn(4, 16), torch.randn(4, 5)
    mean = head.act(feats, state)
    std = head.action_std_A()
    assert torch.allclose(std, torch.full((3,), 0.5))
    actions = mean + 0.3 * torch.randn_like(mean)
    expect = torch.distributions.Normal(mean, std).log_prob(actions).flatten(1).sum(1)
    assert torch.allclose(head.log_prob(feats, state, actions), expect, atol=1e-5)
    # A floor (env units) raises the std where it is higher than the learned one.
    assert torch.allclose(head.action_std_A(std_floor=0.8), torch.full((3,), 0.8))
    # Samples come from that distribution.
    draws = torch.stack([head.sample(feats, state) for _ in range(400)])
    assert (draws.std(0) - 0.5).abs().mean() < 0.05
    assert head.value(feats, state).shape == (4,)


def test_a_ppo_step_raises_the_likelihood_of_good_chunks_and_fits_the_critic() -> None:
    torch.manual_seed(0)
    m = TenantModule("acme", "oft_mlp", CFG, lr=1e-2)
    head = m.head
    assert isinstance(head, OFTMLPHead)
    feats, state = torch.randn(64, 16), torch.randn(64, 5)
    with torch.no_grad():
        mean = head.act(feats, state)
        taken = mean + 0.5 * torch.randn_like(mean)
        old_logp = head.log_prob(feats, state, taken)
    # Chunks whose first action dimension went up were good.
    adv = (taken - mean)[:, :, 0].mean(1)
    returns = torch.full((64,), 3.0)
    with torch.no_grad():
        v0 = float(head.value(feats, state).mean())
    for _ in range(10):
        m.stage_ppo(PPOBatch(old_logp_B=old_logp, adv_B=adv, returns_B=returns))
        m.train_step(feats, state, taken)
    assert m.version == 10
    assert set(m.last_stats) >= {"policy_loss", "value_loss", "clip_frac", "approx_kl"}
    new_mean = m.act(feats, state)
    assert float((new_mean - mean)[:, :, 0].mean()) > 0.05  # the mean moved towards the good side
    with torch.no_grad():
        v1 = float(head.value(feats, state).mean())
    assert abs(v1 - 3.0) < abs(v0 - 3.0)
    # The staged batch is consumed: the next plain step is the SFT loss again.
    m.train_step(feats, state, taken)
    assert m.last_stats == {}


def test_ppo_is_refused_for_a_head_without_a_likelihood() -> None:
    m = TenantModule("acme", "flow_matching", CFG)
    z = torch.zeros(4)
    with pytest.raises(InvalidSpec, match="no tractable likelihood"):
        m.stage_ppo(PPOBatch(old_logp_B=z, adv_B=z, returns_B=z))


def test_a_non_finite_ppo_batch_takes_no_step() -> None:
    m = TenantModule("acme", "oft_mlp", CFG)
    feats, state = torch.randn(8, 16), torch.randn(8, 5)
    taken = m.act(feats, state)
    before = {k: v.clone() for k, v in m.head.state_dict().items()}
    bad = torch.zeros(8)
    bad[3] = float("nan")
    m.stage_ppo(PPOBatch(old_logp_B=bad, adv_B=torch.ones(8), returns_B=torch.zeros(8)))
    with pytest.raises(InvalidSpec):
        m.train_step(feats, state, taken)
    assert m.version == 0
    assert all(torch.equal(before[k], v) for k, v in m.head.state_dict().items())


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf")])
def test_exploration_std_is_validated(bad: float) -> None:
    from joynexus.schemas.workloads import WorkloadSpec

    assert WorkloadSpec(name="r", task_type="rl", env="PickCube-v1", exploration_std=0.2).exploration_std == 0.2
    with pytest.raises(InvalidSpec, match="exploration_std"):
        WorkloadSpec(name="r", task_type="rl", env="PickCube-v1", exploration_std=bad)


def test_a_sampled_evaluation_needs_a_gaussian_head() -> None:
    """``eval_policy="sampled"`` samples the head's own std: a flow head has none."""
    from joynexus.schemas.workloads import WorkloadSpec

    ev = {"name": "e", "task_type": "eval", "env": "PickCube-v1", "init_from_workload": "p"}
    assert WorkloadSpec(**ev, eval_policy="sampled").eval_policy == "sampled"
    with pytest.raises(InvalidSpec, match="eval_policy 'sampled' needs a Gaussian head"):
        WorkloadSpec(**ev, eval_policy="sampled", action_module="flow_matching")


def test_sample_around_is_the_policys_gaussian_clipped() -> None:
    from joynexus.agents.actions import sample_around

    mean = np.zeros((4000, 1, 2), dtype=np.float32)
    x = sample_around(mean, np.array([0.1, 0.5], dtype=np.float32), np.random.default_rng(0))
    assert x.shape == mean.shape and x.dtype == np.float32
    assert abs(x[..., 0].std() - 0.1) < 0.01 and x.min() >= -1.0 and x.max() <= 1.0
    again = sample_around(mean, np.array([0.1, 0.5], dtype=np.float32), np.random.default_rng(0))
    assert np.array_equal(x, again)


def test_a_huge_log_ratio_keeps_the_loss_finite() -> None:
    z = torch.zeros(2)
    logp = _t(500.0, -500.0).requires_grad_()
    loss, stats = ppo_objective(logp, z, _t(-1.0, 1.0), z, z)
    assert torch.isfinite(loss) and stats["clip_frac"] == 1.0
    loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_dual_clip_bounds_a_runaway_ratio_on_a_negative_advantage() -> None:
    z = torch.zeros(1)
    lr = torch.tensor([math.log(10.0)])  # ratio 10, advantage -1
    plain, _ = ppo_objective(lr, z, _t(-1.0), z, z, vf_coef=0.0, dual_clip=None)
    dual, _ = ppo_objective(lr, z, _t(-1.0), z, z, vf_coef=0.0, dual_clip=3.0)
    assert plain.item() == pytest.approx(10.0)
    assert dual.item() == pytest.approx(3.0)


def test_only_decision_rows_train_the_policy_and_only_executed_steps_count() -> None:
    """Rows executed open loop from an earlier decision leave the policy term alone
    (their advantages may be anything); a decision's log-prob counts its executed steps."""
    torch.manual_seed(0)
    m = TenantModule("acme", "oft_mlp", CFG, lr=1e-2)
    head = m.head
    assert isinstance(head, OFTMLPHead)
    feats, state = torch.randn(8, 16), torch.randn(8, 5)
    with torch.no_grad():
        taken = head.act(feats, state) + 0.3 * torch.randn(8, CFG.action_horizon, CFG.action_dim)
    mask = torch.zeros(8, CFG.action_horizon, dtype=torch.bool)
    mask[:4, :1] = True  # rows 0-3: decisions that executed 1 of 2 steps; rows 4-7: open loop
    with torch.no_grad():
        full = head.log_prob(feats, state, taken)
        part = head.log_prob(feats, state, taken, mask_B_H=mask)
        first_two = head.log_prob(feats[:4], state[:4], taken[:4].clone(), mask_B_H=mask[:4])
    assert torch.all(part[4:] == 0) and not torch.allclose(part[:4], full[:4])
    assert torch.allclose(part[:4], first_two)
    old = part.clone()
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, 1e6, -1e6, 1e6, -1e6])  # huge on non-decisions

    def policy_loss(a: torch.Tensor) -> float:
        _, stats = head.ppo_loss(feats, state, taken, PPOBatch(old_logp_B=old, adv_B=a,
                                 returns_B=torch.zeros(8), mask_B_H=mask, normalize_adv=False))
        return stats["policy_loss"]

    assert policy_loss(adv) == pytest.approx(0.0, abs=1e-6)
    assert policy_loss(torch.tensor([1.0, 1.0, 1.0, 1.0, 0, 0, 0, 0])) == pytest.approx(-1.0, abs=1e-5)
    with pytest.raises(ShapeMismatch):
        head.log_prob(feats, state, taken, mask_B_H=mask[:, :1].clone())


def test_critic_warmup_leaves_the_policy_and_trains_the_critic() -> None:
    torch.manual_seed(0)
    m = TenantModule("acme", "oft_mlp", CFG, lr=1e-2)
    head = m.head
    assert isinstance(head, OFTMLPHead)
    assert [g["name"] for g in m.optimizer.param_groups] == ["policy", "critic"]
    assert m.optimizer.param_groups[1]["lr"] >= 1e-3
    feats, state = torch.randn(32, 16), torch.randn(32, 5)
    with torch.no_grad():
        mean = head.act(feats, state)
        taken = mean + 0.3 * torch.randn_like(mean)
        old_logp = head.log_prob(feats, state, taken)
        v0 = head.value(feats, state)
    for _ in range(5):
        m.stage_ppo(PPOBatch(old_logp_B=old_logp, adv_B=torch.randn(32), returns_B=torch.full((32,), 2.0),
                             policy_coef=0.0))
        m.train_step(feats, state, taken)
    assert torch.equal(m.act(feats, state), mean)  # the policy held still
    with torch.no_grad():
        assert float((head.value(feats, state) - 2.0).abs().mean()) < float((v0 - 2.0).abs().mean())


def test_the_adaptive_step_shrinks_the_learning_rate_past_the_target_kl_and_grows_it_below() -> None:
    torch.manual_seed(0)
    feats, state = torch.randn(32, 16), torch.randn(32, 5)

    def lr_after(target_kl: float, lr: float) -> tuple[float, float]:
        m = TenantModule("acme", "oft_mlp", CFG, lr=lr)
        head = m.head
        assert isinstance(head, OFTMLPHead)
        with torch.no_grad():
            mean = head.act(feats, state)
            taken = mean + 0.3 * torch.randn(mean.shape, generator=torch.Generator().manual_seed(1))
            old = head.log_prob(feats, state, taken)
        adv = (taken - mean)[:, :, 0].mean(1)
        m.stage_ppo(PPOBatch(old_logp_B=old, adv_B=adv, returns_B=torch.zeros(32), target_kl=target_kl))
        m.train_step(feats, state, taken)
        return m.optimizer.param_groups[0]["lr"], m.last_stats["kl_after"]

    lr_big, kl_big = lr_after(1e-6, 1e-2)  # a big step against a tiny target
    assert kl_big > 2e-6 and lr_big == pytest.approx(1e-2 / 1.5)
    lr_small, kl_small = lr_after(10.0, 1e-6)  # a tiny step against a large target
    assert kl_small < 5.0 and lr_small == pytest.approx(1.5e-6)
    # The rate kept in the optimizer travels with the checkpoint.
    m = TenantModule("acme", "oft_mlp", CFG, lr=1e-3)
    m.optimizer.param_groups[0]["lr"] = 4e-4
    assert TenantModule.from_state_dict(m.state_dict()).optimizer.param_groups[0]["lr"] == 4e-4


def test_the_workload_learning_rate_applies_and_warm_up_leaves_it_alone() -> None:
    torch.manual_seed(0)
    m = TenantModule("acme", "oft_mlp", CFG)  # as rebuilt from a published version: lr 1e-3
    m.set_lr(1e-4)
    assert [g["lr"] for g in m.optimizer.param_groups] == [1e-4, 1e-3] and m.lr == 1e-4
    head = m.head
    assert isinstance(head, OFTMLPHead)
    feats, state = torch.randn(16, 16), torch.randn(16, 5)
    with torch.no_grad():
        taken = head.act(feats, state) + 0.3 * torch.randn(16, CFG.action_horizon, CFG.action_dim)
        old = head.log_prob(feats, state, taken)
    for _ in range(3):  # the policy is held: its KL is 0, which must not grow its rate
        m.stage_ppo(PPOBatch(old_logp_B=old, adv_B=torch.randn(16), returns_B=torch.zeros(16),
                             policy_coef=0.0, target_kl=0.01))
        m.train_step(feats, state, taken)
    assert m.optimizer.param_groups[0]["lr"] == 1e-4
    with pytest.raises(InvalidSpec):
        m.set_lr(float("nan"))


@pytest.mark.parametrize(
    ("field", "bad"),
    [("target_kl", -0.01), ("target_kl", float("nan")), ("target_kl", 5.0), ("gamma", 0.0),
     ("gamma", 1.5), ("gae_lambda", float("inf")), ("critic_warmup", -1), ("critic_warmup", 10**9),
     ("critic_warmup", True)],
)
def test_the_ppo_knobs_a_tenant_sets_are_bounded(field: str, bad: object) -> None:
    from joynexus.schemas.workloads import WorkloadSpec

    with pytest.raises(InvalidSpec, match=field):
        WorkloadSpec(name="r", task_type="rl", env="PickCube-v1", **{field: bad})


def test_job_metadata_numbers_out_of_bounds_fall_back_to_defaults() -> None:
    """A tenant-submitted job's metadata may hold anything: the stages never take it raw."""
    from joynexus.agents.actor.forward import extra_number
    from joynexus.schemas.jobs import JobMetadata, TrainingJob

    def job(**extra: str) -> TrainingJob:
        return TrainingJob(job_id="j", tenant_id="acme", task_type="rl", workload="p",
                           metadata=JobMetadata(extra=extra))

    for raw in ("nan", "inf", "-1", "1e9", "x"):
        assert extra_number(job(target_kl=raw), "target_kl", 0.0, 1.0, 0.01) == 0.01
    assert extra_number(job(target_kl="0.02"), "target_kl", 0.0, 1.0, 0.01) == 0.02
