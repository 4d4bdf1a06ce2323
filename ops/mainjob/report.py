"""The benchmark report: tables and the figures of :mod:`.plots` from plain,
JSON-ready results.

Pure functions (no broker, no clock) from what a benchmark writes as JSON to
``report.md`` / ``report.json``, with the paper's figures (:mod:`.plots`). The
results dict :func:`write_report` reads (every key optional)::

    {"title": str,
     "runs": {"shared" | "isolated" | <name>: {
         "tenants": {tenant: {"updates", "final_version", "dropped_stale", "failed", "eval_success"}},
         "device_time_s": float, "wall_s": float, "train_util": float (0-1), "infer_util": float (0-1),
         "peak_memory_mb": {"training": float, "inference": float}}},
     "ratios": {"device_time_ratio", "train_util_ratio", "infer_util_ratio"},  # else computed
     "group_speedup": {"TxB": float}, "notes": [str],
     "eval_curves": {tenant: [{"version", "success_rate", "mean_return"}]}}  # eval_every

Missing ratios are computed from the ``shared`` and ``isolated`` runs:
device time isolated / shared, utilization shared / isolated.
See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from joynexus.ops.measure.plots import (
    eval_points,
    parse_grid,
    plot_eval_curves,
    plot_loss_curves,
    plot_speedup_grid,
    plot_utilization_timeline,
)

#: The paper's measurements (3 RL + 1 SFT tenants on one node).
PAPER_RATIOS = {"device_time_ratio": 1.39, "train_util_ratio": 1.99, "infer_util_ratio": 1.33}
PAPER_UTIL = {"train_util": (0.208, 0.413), "infer_util": (0.281, 0.375)}  # (isolated, shared)
PAPER_GROUP_SPEEDUP_8x4 = {"QwenGR00T": 2.21, "QwenOFT": 3.24, "pi0.5": 1.71}
RATIO_LABELS = {
    "device_time_ratio": "accelerator time, isolated / shared",
    "train_util_ratio": "training-service utilization, shared / isolated",
    "infer_util_ratio": "inference-service utilization, shared / isolated",
}


# --------------------------------------------------------------------------- report.md


def _fmt(v: Any, kind: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "ratio":
        return f"{float(v):.2f}x"
    if kind == "pct":
        return f"{float(v):.1%}"
    if kind == "mb":
        return f"{float(v):.0f}"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def normalize_results(results: Mapping[str, Any]) -> dict[str, Any]:
    """The results of ``ops/mainjob/run.py`` (top-level ``shared``/``isolated`` phases,
    ``utilization``/``peak_rss_mb`` keyed ``train``/``infer``, ``tenants`` of the
    shared run with an ``isolated`` entry each) in this module's shape; results
    already in this shape pass through."""
    out = dict(results)
    if "runs" not in out and isinstance(out.get("shared"), Mapping):
        runs: dict[str, Any] = {}
        tenants = out.get("tenants") or {}
        for name in ("shared", "isolated"):
            phase = out.get(name)
            if not isinstance(phase, Mapping):
                continue
            util = phase.get("utilization") or {}
            rss = phase.get("peak_rss_mb") or {}
            if name == "shared":
                rows = {
                    t: {k: v for k, v in r.items() if k != "isolated"} for t, r in tenants.items()
                }
            else:
                rows = {t: r["isolated"] for t, r in tenants.items() if r.get("isolated")}
            runs[name] = {
                "device_time_s": phase.get("device_time_s"),
                "wall_s": phase.get("wall_s"),
                "train_util": util.get("train"),
                "infer_util": util.get("infer"),
                "peak_memory_mb": {"training": rss.get("train"), "inference": rss.get("infer")},
                "tenants": rows,
            }
        out["runs"] = runs
    ratios = dict(out.get("ratios") or {})
    for k in (*PAPER_RATIOS, "device_busy_ratio"):
        if k not in ratios and out.get(k) is not None:
            ratios[k] = out[k]
    out["ratios"] = ratios
    return out


def compute_ratios(results: Mapping[str, Any]) -> dict[str, float | None]:
    """The three headline ratios: given in ``results["ratios"]``, else from the runs."""
    given = dict(results.get("ratios") or {})
    runs = results.get("runs") or {}
    shared, isolated = runs.get("shared") or {}, runs.get("isolated") or {}

    def ratio(num: Any, den: Any) -> float | None:
        try:
            return float(num) / float(den) if num is not None and den else None
        except (TypeError, ValueError):
            return None

    computed = {
        "device_time_ratio": ratio(isolated.get("device_time_s"), shared.get("device_time_s")),
        "train_util_ratio": ratio(shared.get("train_util"), isolated.get("train_util")),
        "infer_util_ratio": ratio(shared.get("infer_util"), isolated.get("infer_util")),
    }
    return {k: given.get(k, computed[k]) for k in PAPER_RATIOS}


def write_report(out_dir: Path, results: Mapping[str, Any], plots: Mapping[str, Path]) -> Path:
    """Write ``report.md`` (tables, embedded plots) and ``report.json`` (``results``
    as given) into ``out_dir``; returns the path of report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    given, results = results, normalize_results(results)
    runs: Mapping[str, Any] = results.get("runs") or {}
    parts = [f"# {results.get('title') or 'JoyNexus benchmark report'}"]

    ratios = compute_ratios(results)
    rows = [
        [k, RATIO_LABELS[k], _fmt(ratios[k], "ratio"), _fmt(PAPER_RATIOS[k], "ratio")]
        for k in PAPER_RATIOS
    ]
    if results["ratios"].get("device_busy_ratio") is not None:
        rows.append(
            [
                "device_busy_ratio",
                "busy accelerator time, isolated / shared",
                _fmt(results["ratios"]["device_busy_ratio"], "ratio"),
                "-",
            ]
        )
    parts.append("## Headline ratios vs the paper\n")
    parts.append(_table(["ratio", "what", "measured", "paper"], rows))
    sharing = []
    if results.get("device_time_ratios"):
        sharing.append(
            ["device_time_ratio per repeat",
             ", ".join(_fmt(r, "ratio") for r in results["device_time_ratios"])
             + f" (median {_fmt(results.get('device_time_ratio'), 'ratio')})"]
        )
    if results.get("mean_tenants_per_batch") is not None:
        sharing.append(
            ["mean tenants per inference batch (shared run)",
             _fmt(results["mean_tenants_per_batch"])]
        )
    for name in ("shared", "isolated"):
        phase = results.get(name)
        if isinstance(phase, Mapping) and phase.get("env_steps_per_s") is not None:
            sharing.append([f"environment steps/s, {name} run", _fmt(phase["env_steps_per_s"])])
    if sharing:
        parts.append("## Sharing\n")
        parts.append(_table(["what", "measured"], sharing))
    if results.get("limits"):
        parts.append("## What limits the ratio here\n")
        parts.append(str(results["limits"]) + "\n")
    roles = results.get("roles")
    if isinstance(roles, Mapping) and roles:
        parts.append("## Processes (shared run)\n")
        shared = results.get("shared") if isinstance(results.get("shared"), Mapping) else {}
        cpu = dict((shared or {}).get("cpu_s_by_role") or {})
        role_rows = [[r, _fmt(v.get("rss_mb"), "mb"), _fmt(v.get("ready_s")), _fmt(cpu.get(r))]
                     for r, v in roles.items()]
        role_rows.append(["all processes together",
                          _fmt(results.get("peak_rss_mb_total"), "mb"), "",
                          _fmt((shared or {}).get("cpu_s"))])
        parts.append(_table(["role", "peak RSS (MB)", "start to first heartbeat (s)",
                             "CPU s in the shared window"], role_rows))

    if runs:
        parts.append("## Runs\n")
        rows = []
        for name, run in runs.items():
            mem = run.get("peak_memory_mb") or {}
            rows.append(
                [
                    name,
                    _fmt(run.get("device_time_s")),
                    _fmt(run.get("wall_s")),
                    _fmt(run.get("train_util"), "pct"),
                    _fmt(run.get("infer_util"), "pct"),
                    _fmt(mem.get("training"), "mb"),
                    _fmt(mem.get("inference"), "mb"),
                ]
            )
        parts.append(
            _table(
                [
                    "run",
                    "device time (s)",
                    "wall (s)",
                    "training util",
                    "inference util",
                    "peak mem training (MiB)",
                    "peak mem inference (MiB)",
                ],
                rows,
            )
        )
        parts.append(
            f"\nPaper: training utilization {PAPER_UTIL['train_util'][0]:.1%} -> "
            f"{PAPER_UTIL['train_util'][1]:.1%}, inference {PAPER_UTIL['infer_util'][0]:.1%} -> "
            f"{PAPER_UTIL['infer_util'][1]:.1%} (isolated -> shared)."
        )
        cols = ["updates", "final_version", "dropped_stale", "failed", "eval_success"]
        for name, run in runs.items():
            tenants = run.get("tenants") or {}
            if not tenants:
                continue
            parts.append(f"## Tenants, {name} run\n")
            parts.append(
                _table(
                    ["tenant", *cols],
                    [[t, *(_fmt(row.get(c)) for c in cols)] for t, row in tenants.items()],
                )
            )

    curves = eval_curves_of(results)
    if curves:
        parts.append("## Evaluation by version\n")
        heads = results.get("starting_heads") or {}
        if heads:
            parts.append(
                "The ManiSkill RL tenants start from an SFT head trained on scripted "
                "demonstrations before either window ("
                + "; ".join(f"{task}: {h['demos']} demos, {h['updates']} updates"
                            f"{', cached' if h.get('cached') else ', made in this run'}"
                            for task, h in heads.items())
                + "). Each version below was evaluated after the windows, pinned, on the "
                "same seeds.\n"
            )
        ci = {name: {int(r["version"]): r for r in history
                     if isinstance(r, Mapping) and r.get("version") is not None}
              for name, history in curves.items()}

        def interval(name: str, v: int) -> str:
            row = ci.get(name, {}).get(v) or {}
            lo_hi = row.get("success_ci95")
            return f"[{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]" if lo_hi else "-"

        parts.append(_table(
            ["tenant", "version", "episodes", "success rate", "95% interval", "mean return"],
            [[name, str(v), _fmt((ci.get(name, {}).get(v) or {}).get("episodes")), _fmt(succ),
              interval(name, v), _fmt(ret)]
             for name, history in curves.items() for v, succ, ret in eval_points(history)],
        ))
        ev = results.get("evaluations") or {}
        if ev.get("wall_s"):
            parts.append(
                f"\nThe evaluations took {ev['wall_s']:.0f} s after the windows; every "
                f"process together peaked at {ev.get('peak_rss_mb_total', 0):.0f} MB meanwhile "
                f"(the evaluator {ev.get('peak_rss_mb_evaluator', 0):.0f} MB).\n"
            )

    speedup = results.get("group_speedup") or {}
    if speedup:
        ts, bs, grid = parse_grid(speedup)
        parts.append("## Grouped shared-forward speedup (tenants x batch)\n")
        parts.append(
            _table(
                ["T \\ B", *(str(b) for b in bs)],
                [
                    [str(t), *(_fmt(v, "ratio") for v in row)]
                    for t, row in zip(ts, grid, strict=True)
                ],
            )
        )
        paper = ", ".join(f"{k} {v:.2f}x" for k, v in PAPER_GROUP_SPEEDUP_8x4.items())
        parts.append(f"\nPaper at 8 tenants x batch 4: {paper}.")

    if plots:
        parts.append("## Plots\n")
        for name, p in plots.items():
            p = Path(p)
            rel = p.relative_to(out_dir) if p.is_relative_to(out_dir) else p
            parts.append(f"![{name}]({rel.as_posix()})\n")

    notes = results.get("notes") or []
    if notes:
        parts.append("## Notes\n")
        parts.append("\n".join(f"- {n}" for n in notes))

    md = out_dir / "report.md"
    md.write_text("\n\n".join(parts).rstrip() + "\n", encoding="utf-8")
    (out_dir / "report.json").write_text(json.dumps(given, indent=2, default=str) + "\n")
    return md


def write_paper_report(out_dir: Path, results: Mapping[str, Any]) -> Path:
    """Plots for whatever ``results`` holds (``timelines``, ``loss_curves``,
    ``group_speedup``) under ``<out_dir>/plots/``, then :func:`write_report`."""
    out_dir = Path(out_dir)
    plots: dict[str, Path] = {}
    if results.get("timelines"):
        plots["utilization"] = plot_utilization_timeline(
            results["timelines"], out_dir / "plots" / "utilization.png"
        )
    if results.get("loss_curves"):
        plots["loss_curves"] = plot_loss_curves(
            results["loss_curves"], out_dir / "plots" / "loss_curves.png"
        )
    if results.get("group_speedup"):
        plots["group_speedup"] = plot_speedup_grid(
            results["group_speedup"], out_dir / "plots" / "group_speedup.png"
        )
    curves = eval_curves_of(results)
    if curves:
        plots["eval_curves"] = plot_eval_curves(curves, out_dir / "plots" / "eval_curves.png")
    return write_report(out_dir, results, plots)


def eval_curves_of(results: Mapping[str, Any]) -> dict[str, list[Any]]:
    """``results["eval_curves"]``, else per tenant of the shared run (or the first run
    that has any): its ``eval_history`` (periodic evaluations), else the one point
    (``final_version``, ``eval_success``) of its final evaluation."""
    if results.get("eval_curves"):
        return dict(results["eval_curves"])
    runs: Mapping[str, Any] = normalize_results(results).get("runs") or {}
    for name in sorted(runs, key=lambda n: n != "shared"):
        curves: dict[str, list[Any]] = {}
        for tenant, row in (runs[name].get("tenants") or {}).items():
            if row.get("eval_history"):
                curves[tenant] = list(row["eval_history"])
            elif row.get("eval_success") is not None and row.get("final_version") is not None:
                curves[tenant] = [(row["final_version"], row["eval_success"])]
        if curves:
            return curves
    return {}
