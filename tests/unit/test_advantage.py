"""Advantage math, checked against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from joynexus.agents.advantage import awr_weights, gae, group_relative, to_trajectories
from joynexus.schemas.errors import ShapeMismatch


def test_gae_matches_a_hand_computation() -> None:
    r = np.array([[1.0, 0.0, 2.0]], dtype=np.float32)
    v = np.array([[0.5, 0.2, 0.1]], dtype=np.float32)
    g, lam = 0.9, 0.8
    d2 = 2.0 - 0.1
    d1 = 0.0 + g * 0.1 - 0.2
    d0 = 1.0 + g * 0.2 - 0.5
    a2 = d2
    a1 = d1 + g * lam * a2
    a0 = d0 + g * lam * a1
    adv, ret = gae(r, v, gamma=g, lam=lam)
    np.testing.assert_allclose(adv, [[a0, a1, a2]], rtol=1e-6)
    np.testing.assert_allclose(ret, adv + v, rtol=1e-6)


def test_done_stops_bootstrapping_across_episodes() -> None:
    r = np.array([[0.0, 1.0, 5.0]], dtype=np.float32)
    v = np.zeros_like(r)
    dones = np.array([[0, 1, 0]], dtype=np.float32)
    adv, _ = gae(r, v, dones, gamma=1.0, lam=1.0)
    assert adv[0, 1] == pytest.approx(1.0)  # the 5.0 after the done does not leak back
    assert adv[0, 0] == pytest.approx(1.0)
    assert adv[0, 2] == pytest.approx(5.0)


def test_rows_map_to_trajectories_and_back() -> None:
    env = np.array([1, 0, 1, 0], dtype=np.int64)
    step = np.array([0, 0, 1, 1], dtype=np.int64)
    rew = np.array([10.0, 20.0, 11.0, 21.0], dtype=np.float32)
    e_idx, grid = to_trajectories(env, step, rew)
    np.testing.assert_array_equal(grid, [[20.0, 21.0], [10.0, 11.0]])
    np.testing.assert_array_equal(grid[e_idx, step], rew)
    with pytest.raises(ShapeMismatch, match="whole trajectories"):
        to_trajectories(env[:3], step[:3], rew[:3])


def test_weights_grow_with_advantage_and_are_capped() -> None:
    w = awr_weights(np.array([-2.0, 0.0, 1.0, 50.0], dtype=np.float32), beta=0.5, max_weight=5.0)
    assert np.all(np.diff(w) >= 0) and w.max() == pytest.approx(5.0)
    g = group_relative(np.array([1.0, 2.0, 3.0], dtype=np.float32))
    assert g.mean() == pytest.approx(0.0, abs=1e-6) and g[2] > 0 > g[0]


def test_a_cut_rollout_bootstraps_its_tail_from_the_given_value() -> None:
    rewards = np.array([[1.0, 1.0]], dtype=np.float32)
    values = np.array([[0.5, 0.5]], dtype=np.float32)
    adv0, _ = gae(rewards, values, gamma=0.9, lam=1.0)
    adv1, ret1 = gae(rewards, values, gamma=0.9, lam=1.0, bootstrap_B=np.array([2.0], dtype=np.float32))
    # last step: r + gamma * V_next - V = 1 + 0.9 * 2 - 0.5 (vs 1 - 0.5 without it)
    assert adv0[0, 1] == pytest.approx(0.5)
    assert adv1[0, 1] == pytest.approx(2.3)
    assert ret1[0, 0] == pytest.approx(1 + 0.9 * (1 + 0.9 * 2.0))
    # a done at the last step ignores the bootstrap
    adv2, _ = gae(rewards, values, np.array([[False, True]]), gamma=0.9, lam=1.0,
                  bootstrap_B=np.array([2.0], dtype=np.float32))
    assert adv2[0, 1] == pytest.approx(0.5)


def test_a_success_is_an_absorbing_goal_and_a_time_limit_bootstraps() -> None:
    """With a dense reward an episode that ends in success must be worth more than one
    that hovers near the goal collecting reward until the time limit."""
    from joynexus.agents.advantage import done_values

    gamma = 0.9
    # env 0: reaches the goal at step 1 (reward 1, terminated by success);
    # env 1: hovers (0.8 per step) and is cut by the time limit at step 3.
    rewards = np.array([[0.5, 1.0, 0.0, 0.0], [0.5, 0.8, 0.8, 0.8]], dtype=np.float32)
    dones = np.array([[0, 1, 0, 0], [0, 0, 0, 1]], dtype=bool)
    success = np.array([[0, 1, 0, 0], [0, 0, 0, 0]], dtype=bool)
    terminated = success.copy()
    values = np.full((2, 4), 5.0, dtype=np.float32)
    dv = done_values(rewards, values, success, terminated, gamma=gamma)
    assert dv[0, 1] == pytest.approx(1.0 / (1 - gamma)) and dv[1, 3] == 5.0
    # a failure (terminated, no success) is worth 0
    assert done_values(rewards, values, np.zeros_like(success), terminated, gamma=gamma)[0, 1] == 0.0
    zero_v = np.zeros_like(values)
    _, ret = gae(rewards[:, :2], zero_v[:, :2], dones[:, :2], gamma=gamma, lam=1.0,
                 done_value_B_T=done_values(rewards[:, :2], zero_v[:, :2], success[:, :2],
                                            terminated[:, :2], gamma=gamma))
    assert ret[0, 0] > ret[1, 0]  # success beats hovering from the same first step
    # without the absorbing goal the hovering episode's return would be the larger one
    _, plain = gae(rewards, zero_v, dones, gamma=gamma, lam=1.0)
    assert plain[0, 0] < plain[1, 0]
