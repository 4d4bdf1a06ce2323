"""The main job's summary: what the capacity planner predicts for the run, what
limits its ratio (a sentence), and the table printed at the end.

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def planner_prediction(out: Path) -> dict[str, Any]:
    """What the capacity planner (``joynexus plan --from-run``) predicts for this run's
    windows from its own event log: the ratio, and the shared window with the
    isolated run's costs (no contention for the cores: what overlapping alone gives)."""
    try:
        from joynexus.ops.plan.planner import plan_from_run

        p = plan_from_run(out)
    except Exception as e:  # the report goes on without it
        return {"error": f"{type(e).__name__}: {e}"}
    iso = p["predicted"]["isolated_wall_s"]
    free = p.get("shared_wall_s_with_isolated_costs")
    return {
        "device_time_ratio": p["predicted"]["device_time_ratio"],
        "error": p["error"],
        "uncontended_device_time_ratio": round(iso / free, 3) if iso and free else None,
    }


def limits_sentence(results: dict[str, Any]) -> str:
    """What limits the ratio here, in a sentence a reader understands."""
    b = results.get("cores_bound") or {}
    pl = results.get("planner") or {}
    bits = [f"Measured {results.get('device_time_ratio')}x"]
    if pl.get("device_time_ratio") is not None:
        bits.append(f"the planner predicts {pl['device_time_ratio']}x for this run from its "
                    "own event log")
    if pl.get("uncontended_device_time_ratio") is not None:
        bits.append(f"{pl['uncontended_device_time_ratio']}x if the shared run's steps cost "
                    "what they cost alone (overlap without contention for the cores)")
    text = "; ".join(bits) + "."
    if b.get("max_device_time_ratio") is not None:
        text += (
            f" The {b['cores']} cores bound it: the shared run spent {b['shared_cpu_s']} CPU s "
            f"(the isolated run {b['isolated_cpu_s']}), which {b['cores']} cores cannot run in "
            f"less than {b['shared_floor_wall_s']} s, so with that much CPU sharing saves at "
            f"most {b['max_device_time_ratio']}x; the shared run kept the cores "
            f"{_as_percent(b.get('shared_core_utilization'))} busy (isolated "
            f"{_as_percent(b.get('isolated_core_utilization'))}), so past that the same work "
            "must cost fewer CPU seconds: its simulators ran slower side by side than alone "
            "(they, inference and training took the same cores from each other)."
        )
    return text


def _as_percent(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def print_summary(results: dict[str, Any], out: Path) -> None:
    sh, iso = results["shared"], results["isolated"]
    print(f"\nJoyNexus main job: the paper's mixed workload (report: {out / 'report.md'})\n")
    rows = [
        ("wall time (s)", sh["wall_s"], iso["wall_s"], ""),
        (
            "device time (s, 2 services)",
            sh["device_time_s"],
            iso["device_time_s"],
            f"{results['device_time_ratio']}x less (paper 1.39x)",
        ),
        ("training busy (s)", sh["busy_s"]["train"], iso["busy_s"]["train"], ""),
        ("inference busy (s)", sh["busy_s"]["infer"], iso["busy_s"]["infer"], ""),
        (
            "training utilization",
            sh["utilization"]["train"],
            iso["utilization"]["train"],
            f"{results['train_util_ratio']}x (paper 1.99x)",
        ),
        (
            "inference utilization",
            sh["utilization"]["infer"],
            iso["utilization"]["infer"],
            f"{results['infer_util_ratio']}x (paper 1.33x)",
        ),
        (
            "training compute (CPU s)",
            sh["compute_s"]["train"],
            iso["compute_s"]["train"],
            f"utilization {results['train_compute_util_ratio']}x",
        ),
        (
            "inference compute (CPU s)",
            sh["compute_s"]["infer"],
            iso["compute_s"]["infer"],
            f"utilization {results['infer_compute_util_ratio']}x",
        ),
        ("training peak RSS (MB)", sh["peak_rss_mb"]["train"], iso["peak_rss_mb"]["train"], ""),
        ("inference peak RSS (MB)", sh["peak_rss_mb"]["infer"], iso["peak_rss_mb"]["infer"], ""),
    ]
    rows += [
        ("env steps/s (all workers)", sh.get("env_steps_per_s"), iso.get("env_steps_per_s"), ""),
        *(
            (f"  {kind} steps/s in rollouts", v, iso.get("env_steps_per_s_by_kind", {}).get(kind), "")
            for kind, v in sh.get("env_steps_per_s_by_kind", {}).items()
        ),
        (
            "tenants per inference batch",
            sh.get("mean_tenants_per_batch"),
            iso.get("mean_tenants_per_batch"),
            "",
        ),
    ]
    print(f"  {'':30} {'shared':>10} {'isolated':>10}  ratio")
    for name, a, b, r in rows:
        print(f"  {name:30} {a!s:>10} {b!s:>10}  {r}")
    if results.get("limits"):
        print(f"\n  What limits the ratio here: {results['limits']}")
    if len(results.get("device_time_ratios", [])) > 1:
        print(
            f"\n  device_time_ratio per repeat: {results['device_time_ratios']} "
            f"(median {results['device_time_ratio']})"
        )
    print(
        f"\n  {'tenant':8} {'task':5} {'env or dataset':17} {'updates':>7} {'version':>7} "
        f"{'stale':>5} {'failed':>6} {'eval':>5} {'rollout s':>9}"
    )
    rolls = sh.get("rollouts_by_tenant", {})
    for t, v in results["tenants"].items():
        ev = "-" if v["eval_success"] is None else f"{v['eval_success']:.2f}"
        roll = rolls.get(t, {}).get("mean_rollout_s", "-")
        print(
            f"  {t:8} {v['task_type']:5} {v.get('env_or_dataset', ''):17} {v['updates']:>7} "
            f"{v['final_version']:>7} {v['dropped_stale']:>5} {v['failed']:>6} {ev:>5} {roll!s:>9}"
        )
    curves = {t: v["eval_history"] for t, v in results["tenants"].items() if v.get("eval_history")}
    if curves:
        print("\n  learning curves (pinned versions, after the windows; success [95% interval], return)")
        for t, history in curves.items():
            start = results["tenants"][t].get("starts_from", "")
            points = "  ".join(
                f"v{h['version']} {h['success_rate']:.2f} [{h['success_ci95'][0]:.2f}, "
                f"{h['success_ci95'][1]:.2f}] {h.get('mean_return') or 0:.1f}"
                for h in history
            )
            print(f"  {t:8} ({start}) {points}")
    evals = results.get("evaluations") or {}
    if evals:
        print(f"  evaluations took {evals.get('wall_s')} s; peak RSS of all processes meanwhile "
              f"{evals.get('peak_rss_mb_total')} MB (evaluator {evals.get('peak_rss_mb_evaluator')} MB)")
