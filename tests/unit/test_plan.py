"""The capacity planner (ops.plan.sim / ops.plan.planner): the real scheduler core on a
simulated clock, on tiny deployments."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from joynexus.ops.cli import main
from joynexus.ops.plan.sim import isolated, simulate
from joynexus.ops.plan.world import Costs, DeploymentPlan, TenantSpec

COSTS = Costs(train_step_s=0.2, actor_overhead_s=0.05, infer_batch_s=0.01,
              sim_per_call_s=0.05, advantages_s=0.01, sft_produce_s=0.02)


def tiny(**kw: object) -> DeploymentPlan:
    tenants = [
        TenantSpec(name="acme", task="rl", updates=12, max_in_flight=3, max_active_rollouts=2,
                   workers=2, max_policy_staleness=128),
        TenantSpec(name="bolt", task="rl", updates=12, max_in_flight=3, max_active_rollouts=2,
                   workers=2, max_policy_staleness=128),
        TenantSpec(name="dana", task="sft", updates=20, max_in_flight=16),
    ]
    return replace(DeploymentPlan(tenants=tenants, global_max_active_rollouts=4, poll_s=0.0), **kw)


def test_deterministic_and_complete() -> None:
    a, b = simulate(tiny(), COSTS), simulate(tiny(), COSTS)
    assert a.finished and a.updates == {"acme": 12, "bolt": 12, "dana": 20}
    assert (a.wall_s, a.decisions, a.waits) == (b.wall_s, b.decisions, b.waits)
    # The busy time is what the modelled operations cost.
    assert a.busy["train"] == pytest.approx(a.train_steps * COSTS.train_step_s)
    # Sharing beats one tenant at a time on this deployment.
    assert sum(r.wall_s for r in isolated(tiny(), COSTS)) > a.wall_s


def test_more_trainers_never_increase_wall_time() -> None:
    walls = [simulate(tiny(trainers=n), COSTS).wall_s for n in (1, 2, 3, 4)]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(walls)), walls
    assert walls[-1] < walls[0]


def test_staleness_drops_appear_when_the_bound_is_tightened() -> None:
    loose = simulate(tiny(), COSTS)
    tight_dep = tiny()
    tight_dep = replace(tight_dep, tenants=[
        replace(t, max_policy_staleness=0) if t.task == "rl" else t for t in tight_dep.tenants])
    tight = simulate(tight_dep, COSTS)
    assert sum(loose.drops.values()) == 0
    assert sum(tight.drops.values()) > 0
    assert tight.finished  # dropped jobs are replaced until each tenant has its updates
    assert tight.updates == loose.updates


def test_global_rollout_limit_binds() -> None:
    # One active rollout globally: the two RL tenants' rollouts never overlap.
    r = simulate(tiny(global_max_active_rollouts=1), COSTS)
    spans = sorted(iv for k, ivs in r.intervals.items() if k.startswith("env") for iv in ivs)
    assert all(b[0] >= a[1] - 1e-9 for a, b in itertools.pairwise(spans))


def test_cli_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"deployment": {"trainers": 1, "engines": 1, "max_batch": 16,
                          "global_max_active_rollouts": 3, "tenants": [
                              {"name": "acme", "task": "rl", "updates": 4},
                              {"name": "dana", "task": "sft", "updates": 6}]},
           "costs": {"train_step_s": 0.05, "sim_per_call_s": 0.02}}
    path = tmp_path / "dep.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = out["predicted"]
    for k in ("shared_wall_s", "isolated_wall_s", "device_time_ratio"):
        assert p[k] > 0
    assert set(out["update_rates_per_s"]) == {"acme", "dana"}
    assert out["job_wait_p50_s"] is not None and out["finished"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"deployment": {"tenants": [{"name": "x", "task": "eval"}]}}))
    assert main(["plan", "--config", str(bad), "--json"]) == 2
