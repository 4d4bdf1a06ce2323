"""``joynexus plan --scale``: the paper's layout, then 4-256 tenants on 8-128 accelerators.

The paper's 2-2-4 layout (2 training, 2 inference and 4 environment
accelerators) with its settings: a global actor microbatch of 256 rows, an
inference batch cap of 128 rows, 2 outstanding jobs per RL tenant, 1 active
rollout per tenant and 3 globally, a staleness bound of 128, SFT prefetch 16.
Costs are of the paper's order, not measured here (no accelerator): see
:data:`PAPER_COSTS`. The sweep keeps the 2-2-4 proportions and a 3:1 mix of
RL and SFT tenants; the scheduler's service time is its measured
decisions/s (``joynexus bench scheduler``). Each point runs ``SIM_S``
simulated seconds.

See docs/ARCHITECTURE.md, "The capacity planner".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from joynexus.agents.fairshare import jain as fair_jain
from joynexus.ops.plan.sim import Result, isolated, simulate
from joynexus.ops.plan.world import Costs, DeploymentPlan, TenantSpec

#: Seconds per operation, of the order the paper's setting implies (assumed).
PAPER_COSTS = Costs(
    train_step_s=0.45,  # one 256-row microbatch through the backbone and the heads
    train_per_job_s=0.02,
    actor_overhead_s=0.08,  # load a job's rows, save and publish its module
    infer_batch_s=0.04,
    infer_per_row_s=0.0006,  # 128 rows: 0.12 s
    infer_rpc_s=0.004,
    batcher_s=0.0002,  # request preparation in the inference service's batcher
    sim_per_call_s=0.5,  # 8 simulator steps of 32 envs between two action chunks
    rollout_overhead_s=0.1,
    advantages_s=0.05,
    sft_produce_s=0.2,
    sched_decisions_per_s=2000.0,
)
SIM_S = 240.0
TENANTS = (4, 16, 64, 256)
ACCELERATORS = (8, 32, 128)


def tenants(
    n: int, *, staleness: int = 128, updates: int = 10**6, classes: bool = False
) -> list[TenantSpec]:
    """A 3:1 mix of RL and SFT tenants (at least one SFT tenant from 4 on); with
    ``classes``, every other RL tenant has share weight 2 (the others 1)."""
    n_sft = max(1, n // 4) if n >= 4 else 0
    out = []
    for i in range(n):
        sft = i >= n - n_sft
        out.append(TenantSpec(
            name=f"t{i:03d}", task="sft" if sft else "rl", updates=updates,
            max_in_flight=16 if sft else 2, max_active_rollouts=1,
            max_policy_staleness=None if sft else staleness,
            num_envs=32, horizon=64, action_horizon=8, sft_batch=256,
            weight=2 if classes and not sft and i % 2 else 1,
        ))
    return out


def layout(accelerators: int, n_tenants: int, **kw: Any) -> DeploymentPlan:
    """The 2-2-4 proportions at ``accelerators`` for ``n_tenants`` (``tenants(**kw)``)."""
    q = max(1, accelerators // 4)
    env = max(1, accelerators // 2)
    return DeploymentPlan(
        tenants=tenants(n_tenants, **kw), trainers=q, engines=q, max_batch=128,
        max_wait_s=0.01, microbatch=256, max_group=4,
        global_max_active_rollouts=max(1, round(3 * env / 4)), poll_s=0.0, horizon_s=SIM_S,
    )


def jain(xs: list[float]) -> float | None:
    j = fair_jain(xs)
    return None if j is None else round(j, 4)


def class_shares(dep: DeploymentPlan, rates: dict[str, float]) -> dict[str, Any]:
    """Among RL tenants: Jain's index within each weight class, and each class's
    share of the updates over its share of the weight (1.0: exactly its weight)."""
    rl = [t for t in dep.tenants if t.task == "rl"]
    weights = sorted({t.weight for t in rl})
    total = sum(rates[t.name] for t in rl)
    wsum = sum(t.weight for t in rl)
    by_class: dict[str, Any] = {}
    vs_weight: dict[str, float | None] = {}
    for w in weights:
        members = [t for t in rl if t.weight == w]
        by_class[str(w)] = jain([rates[t.name] for t in members])
        share = sum(rates[t.name] for t in members) / total if total else 0.0
        vs_weight[str(w)] = round(share / (w * len(members) / wsum), 4) if total else None
    return {"fairness_jain_rl_by_weight": by_class, "class_share_vs_weight": vs_weight}


def point(dep: DeploymentPlan, costs: Costs, r: Result) -> dict[str, Any]:
    wall = r.done_s or 1.0
    rl = [t.name for t in dep.tenants if t.task == "rl"]
    sft = [t.name for t in dep.tenants if t.task == "sft"]
    rates = {t: r.updates[t] / wall for t in r.updates}
    waits = sorted(r.waits)
    pct = lambda q: round(waits[min(len(waits) - 1, int(q * (len(waits) - 1)))], 4) if waits else None  # noqa: E731
    env_slots = dep.global_max_active_rollouts
    requests = sum(n for _, n in r.batches)
    jobs = sum(r.updates.values()) + sum(r.drops.values())
    return {
        "tenants": len(dep.tenants),
        "accelerators": {"train": dep.trainers, "infer": dep.engines,
                         "env_slots": env_slots},
        "utilization": {
            "train": round(r.busy["train"] / (wall * dep.trainers), 4),
            "infer": round(r.busy["infer"] / (wall * dep.engines), 4),
            "env": round(r.busy["env"] / (wall * env_slots), 4),
        },
        "updates_per_s": round(sum(rates.values()), 3),
        "rl_update_rate_mean": round(statistics.fmean([rates[t] for t in rl]), 5) if rl else None,
        "sft_update_rate_mean": round(statistics.fmean([rates[t] for t in sft]), 5) if sft else None,
        # Weight-normalized: among equal weights, Jain's index of their update rates.
        "fairness_jain_rl": jain([rates[t.name] / t.weight for t in dep.tenants if t.task == "rl"]),
        **class_shares(dep, rates),
        "job_wait_p50_s": pct(0.5),
        "job_wait_p99_s": pct(0.99),
        "stale_drops": sum(r.drops.values()),
        "scheduler_utilization": round(r.sched_busy_s / wall, 4),
        "scheduler_decisions_per_s": round(r.decisions / wall, 1),
        "decisions_per_job": round(r.decisions / jobs, 2) if jobs else None,
        "batcher_utilization": round(r.batcher_busy_s / wall, 4),
        "inference_requests_per_s": round(requests / wall, 1),
        "tenants_per_batch": round(statistics.fmean([t for t, _ in r.batches]), 3)
        if r.batches else None,
    }


def scale_study(out: Path, *, sched_dps: float | None = None) -> dict[str, Any]:
    costs = replace(PAPER_COSTS, sched_decisions_per_s=sched_dps or PAPER_COSTS.sched_decisions_per_s)
    out.mkdir(parents=True, exist_ok=True)
    # The paper's layout: 3 RL + 1 SFT tenant on 2-2-4, shared vs one at a time,
    # for the same updates per tenant.
    paper = layout(8, 4)
    paper = replace(paper, horizon_s=0.0, poll_s=0.0,
                    tenants=[replace(t, updates=40 if t.task == "rl" else 120) for t in paper.tenants])
    sh = simulate(paper, costs)
    iso = isolated(paper, costs)
    iso_wall = sum(r.done_s for r in iso)
    paper_out = {
        "layout": "2 training, 2 inference, 4 environment accelerators",
        "shared": point(paper, costs, sh),
        "shared_wall_s": round(sh.done_s, 2),
        "isolated_wall_s": round(iso_wall, 2),
        "device_time_ratio": round(iso_wall / sh.done_s, 3) if sh.done_s else None,
    }
    tight = replace(paper, tenants=[replace(t, max_policy_staleness=0) if t.task == "rl" else t
                                    for t in paper.tenants])
    paper_out["stale_drops_at_bound_0"] = sum(simulate(tight, costs).drops.values())
    sweep: list[dict[str, Any]] = []
    for acc in ACCELERATORS:
        for n in TENANTS:
            dep = layout(acc, n, classes=True)
            p = point(dep, costs, simulate(dep, costs))
            p["accelerators_total"] = acc
            sweep.append(p)
    bottleneck = _bottleneck(sweep, costs)
    # Check the extrapolation where it can be simulated: the point it starts from,
    # with the scheduler slowed by tenants / saturating tenants (the same load per
    # unit of decision capacity as at the extrapolated point).
    n_sat = bottleneck["scheduler_saturates_at_tenants"]
    if n_sat:
        fp = bottleneck["from_point"]
        big = layout(fp["accelerators"], fp["tenants"])
        slow = replace(costs, sched_decisions_per_s=costs.sched_decisions_per_s * fp["tenants"] / n_sat)
        at_sat = point(big, slow, simulate(big, slow))
        base = next(p for p in sweep if p["tenants"] == fp["tenants"]
                    and p["accelerators_total"] == fp["accelerators"])
        bottleneck["check_at_saturation"] = {
            "scheduler_decisions_per_s": round(slow.sched_decisions_per_s, 1),
            "scheduler_utilization": at_sat["scheduler_utilization"],
            "updates_per_s": at_sat["updates_per_s"],
            "updates_per_s_unsaturated": base["updates_per_s"],
            "job_wait_p99_s": at_sat["job_wait_p99_s"],
        }
    plots = _plot(out / "plan_scale.png", sweep)
    return {
        "fairness": fairness_study(costs),
        "costs": asdict(costs),
        "costs_note": "of the paper's order (assumed, not measured here); sched_decisions_per_s "
                      "from joynexus bench scheduler when given",
        "paper_layout": paper_out,
        "sweep": sweep,
        "bottleneck": bottleneck,
        "plots": plots,
        "simulated_s_per_point": SIM_S,
    }


#: Where the fairness targets are checked: (accelerators, tenants), the trainer scarce.
FAIRNESS_POINTS = ((8, 64), (8, 256))
#: Simulated seconds of a fairness point per 64 tenants: long enough for each RL
#: tenant's ~10 updates (at 240 s an RL tenant of 64 is served ~2 times, of 256
#: less than once, and the first round, served before any share is known, decides).
FAIRNESS_S = 1200.0
#: The fraction of a fairness point's window left out as warm-up.
WARMUP = 0.5


def fairness_study(
    costs: Costs, points: tuple[tuple[int, int], ...] = FAIRNESS_POINTS
) -> list[dict[str, Any]]:
    """Each point with two weight classes among the RL tenants (1 and 2), simulated
    long enough for every RL tenant to be served about ten times (``FAIRNESS_S`` per
    64 tenants): with the admission queue (the service), and with producers polling
    with backoff instead (before it; the lease order is the fair one in both)."""
    out = []
    for acc, n in points:
        sim_s = FAIRNESS_S * max(1.0, n / 64)
        row: dict[str, Any] = {"accelerators_total": acc, "tenants": n, "simulated_s": sim_s}
        row["measured_from_s"] = sim_s * WARMUP
        for name, queued in (("queued", True), ("polling", False)):
            dep = replace(layout(acc, n, classes=True), horizon_s=sim_s, queued_admission=queued)
            r = simulate(dep, costs)
            p = point(dep, costs, r)
            # Steady state: the updates after the warm-up (the first rounds are
            # served in ready order, before any share is known).
            t0 = sim_s * WARMUP
            rates = {t.name: sum(1 for x in r.completed_at.get(t.name, []) if x >= t0)
                     / (sim_s - t0) for t in dep.tenants}
            rl = [t for t in dep.tenants if t.task == "rl"]
            row[name] = {
                "fairness_jain_rl": jain([rates[t.name] / t.weight for t in rl]),
                **class_shares(dep, rates),
                "whole_window": {k: p[k] for k in (
                    "fairness_jain_rl", "class_share_vs_weight", "updates_per_s", "utilization")},
                "rl_update_rate_mean": round(statistics.fmean(rates[t.name] for t in rl), 5),
                "updates_per_s": round(sum(rates.values()), 3),
                "job_wait_p99_s": p["job_wait_p99_s"],
            }
        out.append(row)
    return out


def _bottleneck(sweep: list[dict[str, Any]], costs: Costs) -> dict[str, Any]:
    """Where the single scheduler or the inference batcher saturates, extrapolated
    from the largest points (demand grows with tenants when accelerators grow with
    them: 2 accelerators per tenant, the 8-for-4 ratio)."""
    ratio_pts = [p for p in sweep if p["accelerators_total"] == 2 * p["tenants"]] or sweep
    best = max(ratio_pts, key=lambda p: p["tenants"])
    per_tenant_sched = best["scheduler_utilization"] / best["tenants"]
    per_tenant_batch = best["batcher_utilization"] / best["tenants"]
    n_sched = math.floor(1.0 / per_tenant_sched) if per_tenant_sched else None
    n_batch = math.floor(1.0 / per_tenant_batch) if per_tenant_batch else None
    first = "scheduler" if (n_sched or math.inf) <= (n_batch or math.inf) else "inference batcher"
    return {
        "from_point": {"tenants": best["tenants"], "accelerators": best["accelerators_total"]},
        "scheduler_decisions_per_s_capacity": costs.sched_decisions_per_s,
        "scheduler_saturates_at_tenants": n_sched,
        "scheduler_saturates_at_accelerators": 2 * n_sched if n_sched else None,
        "batcher_saturates_at_tenants": n_batch,
        "first_bottleneck": first,
        "within_sweep": [
            {"tenants": p["tenants"], "accelerators": p["accelerators_total"],
             "scheduler_utilization": p["scheduler_utilization"],
             "batcher_utilization": p["batcher_utilization"]}
            for p in sweep if p["scheduler_utilization"] > 0.8 or p["batcher_utilization"] > 0.8
        ],
    }


def _plot(path: Path, sweep: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        ("training utilization", lambda p: p["utilization"]["train"]),
        ("inference utilization", lambda p: p["utilization"]["infer"]),
        ("environment slot utilization", lambda p: p["utilization"]["env"]),
        ("job wait p50 / p99 (s, ready to leased)", None),
        ("fairness (Jain, RL update rates)", lambda p: p["fairness_jain_rl"]),
        ("scheduler / batcher utilization", None),
    ]
    for ax, (title, fn) in zip(axes.flat, panels, strict=True):
        for acc in ACCELERATORS:
            pts = sorted((p for p in sweep if p["accelerators_total"] == acc),
                         key=lambda p: p["tenants"])
            xs = [p["tenants"] for p in pts]
            if title.startswith("job wait"):
                ax.plot(xs, [p["job_wait_p50_s"] or 0 for p in pts], "o-", label=f"{acc} acc p50")
                ax.plot(xs, [p["job_wait_p99_s"] or 0 for p in pts], "x--", label=f"{acc} acc p99")
                ax.set_yscale("symlog", linthresh=0.1)
            elif title.startswith("scheduler"):
                ax.plot(xs, [p["scheduler_utilization"] for p in pts], "o-", label=f"{acc} acc scheduler")
                ax.plot(xs, [p["batcher_utilization"] for p in pts], "x--", label=f"{acc} acc batcher")
            else:
                assert fn is not None
                ax.plot(xs, [fn(p) or 0 for p in pts], "o-", label=f"{acc} accelerators")
        ax.set_xscale("log", base=4)
        ax.set_xticks(list(TENANTS), [str(t) for t in TENANTS])
        ax.set_xlabel("tenants")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("joynexus plan --scale: 2-2-4 proportions, paper settings, costs of the paper's order")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
