"""The client-side maths of examples/grpo_pushcube.py on small tensors: group
baselines and advantages, the behaviour log-probability, and the clipped
surrogate's gradient (zero where the ratio has left the trust region in the
advantage's direction, the likelihood-ratio gradient inside it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # the examples import pushcube_rl from their folder
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gp = _example("grpo_pushcube")
pc = sys.modules["pushcube_rl"]


def test_group_baseline_compares_only_envs_that_started_alike() -> None:
    x = np.array([[1.0, 3.0, 10.0, 10.0], [0.0, 2.0, 5.0, 7.0]], dtype=np.float32)  # [T=2, N=4], groups of 2
    c = pc.group_centred(x, 2)
    np.testing.assert_allclose(c, [[-1.0, 1.0, 0.0, 0.0], [-1.0, 1.0, -1.0, 1.0]])
    assert pc.group_seeds(7, 1, 4, 2) == [11, 11, 12, 12]


def test_step_advantages_are_group_centred_returns_to_go_on_one_scale() -> None:
    r = np.array([[0.0, 1.0, 0.5, 0.5], [1.0, 1.0, 0.5, 0.5]], dtype=np.float32)
    g = pc.returns_to_go(r, 0.5)
    np.testing.assert_allclose(g, [[0.5, 1.5, 0.75, 0.75], [1.0, 1.0, 0.5, 0.5]])
    adv = pc.step_advantages(r, 2, 0.5)
    centred = np.array([[-0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(adv, centred / centred.std(), rtol=1e-5)
    # the second group did alike: no advantage, however small its spread (no per-group std)
    assert np.all(adv[:, 2:] == 0)


def test_outcome_advantages_are_one_per_episode() -> None:
    r = np.array([[0.0, 1.0, 0.2, 0.0], [0.0, 1.0, 0.2, 0.6]], dtype=np.float32)
    ro = pc.Rollout({}, np.zeros(8, np.float32), r, np.array([False, True, True, True]), np.ones(1),
                    np.ones((2, 4), bool))
    adv = gp.advantages("return", ro, 2, 0.9)
    assert adv.shape == (2, 4) and np.all(adv[0] == adv[1])
    assert adv[0, 1] > 0 > adv[0, 0] and adv[0, 3] > 0 > adv[0, 2]
    assert adv[0, 0] == pytest.approx(-adv[0, 1]) and abs(float(adv.std()) - 1.0) < 1e-4
    won = gp.advantages("success", ro, 2, 0.9)  # the second group both succeeded: nothing to learn there
    assert won[0, 1] > 0 > won[0, 0] and np.all(won[:, 2:] == 0)
    same = pc.Rollout({}, np.zeros(8, np.float32), r, np.ones(4, bool), np.ones(1), np.ones((2, 4), bool))
    assert np.all(gp.advantages("success", same, 2, 0.9) == 0)  # no group differs: no signal, no NaN
    with pytest.raises(ValueError):
        gp.advantages("value", ro, 2, 0.9)


def test_behaviour_logp_is_the_losss_logp_at_the_same_policy() -> None:
    rng = np.random.default_rng(0)
    mean = rng.normal(size=(5, 1, 3)).astype(np.float32)
    std = np.array([0.3, 0.5, 0.2], dtype=np.float32)
    a = (mean + std * rng.standard_normal(mean.shape)).astype(np.float32)
    ours = pc.gaussian_logp(mean, std, a)
    ref = torch.distributions.Normal(torch.tensor(mean), torch.tensor(std)).log_prob(torch.tensor(a)).sum((1, 2))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-5, atol=1e-5)


def _rows(delta: float, adv: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One row, one action dim: behaviour mean 0 and std 1, taken action 1, the
    current mean ``delta`` (ratio exp(delta - delta^2 / 2))."""
    outs = {"mean": torch.tensor([[[delta]]], requires_grad=True),
            "log_std": torch.zeros(1, 1, requires_grad=True)}
    old = float(torch.distributions.Normal(0.0, 1.0).log_prob(torch.tensor(1.0)))
    batch = {gp.ACTIONS_FIELD: torch.tensor([[[1.0]]]), gp.OLD_LOGP: torch.tensor([old]), gp.ADV: torch.tensor([adv])}
    return outs, batch


def test_clipped_loss_gradient_inside_the_trust_region_is_the_ratio_weighted_one() -> None:
    loss = gp.ClippedLoss(clip=0.2)
    outs, batch = _rows(0.1, 2.0)  # ratio exp(0.095) = 1.0997: inside [0.8, 1.2]
    loss(outs, batch).backward()
    r = float(np.exp(0.1 - 0.005))
    # d/dmu of -A r = -A r dlogp/dmu, dlogp/dmu = (a - mu) / std^2 = 0.9
    assert float(outs["mean"].grad) == pytest.approx(-2.0 * r * 0.9, rel=1e-5)
    assert loss.stats[-1]["clip_frac"] == 0.0 and loss.stats[-1]["approx_kl"] > 0


def test_clipped_loss_stops_pushing_past_the_clip_but_not_back() -> None:
    loss = gp.ClippedLoss(clip=0.2)
    outs, batch = _rows(0.5, 2.0)  # ratio exp(0.375) = 1.45 > 1.2 with A > 0: clipped, no gradient
    loss(outs, batch).backward()
    assert float(outs["mean"].grad) == 0.0 and float(outs["log_std"].grad) == 0.0
    assert loss.stats[-1]["clip_frac"] == 1.0
    outs, batch = _rows(0.5, -2.0)  # the same ratio with A < 0: min picks r A, the pull back stays
    loss(outs, batch).backward()
    assert float(outs["mean"].grad) == pytest.approx(2.0 * float(np.exp(0.375)) * 0.5, rel=1e-5)


def test_a_negative_entropy_coefficient_pulls_the_std_down() -> None:
    outs, batch = _rows(0.0, 0.0)  # no advantage: only the entropy term
    gp.ClippedLoss(entropy_coef=-0.01)(outs, batch).backward()
    assert float(outs["log_std"].grad) == pytest.approx(0.01)  # descent lowers log_std


def test_rollouts_pool_the_first_and_last_quarter() -> None:
    rates = [{"iteration": i, "success": s, "episodes": 8} for i, s in enumerate([0.25, 0.5, 0.5, 1.0, 0.75, 0.875,
                                                                                 1.0, 1.0])]
    out = pc.pooled_rollouts(rates)
    assert out["first"]["iterations"] == [0, 1] and out["first"]["success"] == 0.375
    assert out["last"]["iterations"] == [6, 7] and out["last"]["episodes"] == 16 and out["last"]["success"] == 1.0
    lo, hi = out["first"]["ci95"]
    assert 0.0 < lo < 0.375 < hi < 1.0
