"""``joynexus plan``: a capacity planner on the real scheduler core (``ops.plan.sim``).

``--from-run DIR`` replays a main job's ``events/*.jsonl`` (costs fitted per
phase from its own log, :func:`fit_costs`) and prints the prediction beside
the measurement; ``--config FILE`` simulates a described deployment (JSON or
TOML: ``[deployment]`` with tenants and service sizes, ``[costs]`` seconds per
operation); ``--scale`` the paper's layout and the tenant sweep. It prints
what the demo reports: wall and device time, utilization per service, the
sharing ratio, per-tenant update rates, job waits p50/p99, stale drops.

See docs/ARCHITECTURE.md, "The capacity planner".
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import tomllib
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import orjson

from joynexus.ops.measure.stats import percentile
from joynexus.ops.plan.sim import Result, isolated, simulate
from joynexus.ops.plan.world import Costs, DeploymentPlan, TenantSpec
from joynexus.schemas.errors import InvalidSpec

#: Seconds of a poll of the demo's progress loop (its windows end at one).
POLL_S = 0.5


# ---------------------------------------------------------------- reading a run


def load_phase(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if not path.is_file():
        raise InvalidSpec(
            f"{path}: no event log; run `joynexus demo --out DIR` (it writes DIR/events/)")
    lines = path.read_bytes().splitlines()
    if not lines:
        raise InvalidSpec(f"{path} is empty")
    header = orjson.loads(lines[0])
    if "windows" not in header:
        raise InvalidSpec(f"{path}: the first line is not a phase header")
    return header, [orjson.loads(x) for x in lines[1:] if x.strip()]


def _med(xs: list[float], default: float = 0.0) -> float:
    return float(statistics.median(xs)) if xs else default


def _mean(xs: list[float], default: float = 0.0) -> float:
    return float(statistics.fmean(xs)) if xs else default


def _jobs(events: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    jobs: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for e in events:
        if "state" in e and "job" in e:
            jobs[(e["tenant"], e["job"])].setdefault(e["state"], float(e["at"]))
    return jobs


def fit_costs(header: dict[str, Any], events: list[dict[str, Any]]) -> tuple[Costs, dict[str, float]]:
    """Costs from one phase's event log (its windows only), and each tenant's
    start-up (window start to its first reservation).

    * inference batch: the mean busy interval (plus a per-row slope when batch
      rows vary); training step: the mean of one-job steps, plus the mean extra
      per job of grouped steps; actor overhead per job: median(leased ->
      completed) - mean step;
    * simulator time per inference call: (mean rollout - calls x mean batch) /
      calls; rollout overhead: median interval between a worker's reservations
      - median rollout; advantages: median(needs_advantages -> ready); SFT
      batch preparation: median(reserved -> ready) of SFT jobs.
    """
    windows = header["windows"][0]
    spans = [(w["start"], w["end"]) for w in windows]

    def inside(t: float) -> bool:
        return any(a <= t < b for a, b in spans)

    busy = [e for e in events if "busy_start" in e and inside(float(e["busy_start"]))]
    infer = [e for e in busy if e.get("service") == "infer"]
    train = [e for e in busy if e.get("service") == "train"]
    env = [e for e in busy if e.get("service") == "env"]
    dur = lambda e: float(e["busy_end"]) - float(e["busy_start"])  # noqa: E731
    c = Costs()
    c.infer_batch_s = _mean([dur(e) for e in infer], c.infer_batch_s)
    rows = [float(e.get("rows", 0)) for e in infer]
    if len(set(rows)) > 2 and len(infer) > 10:
        mr, md = _mean(rows), c.infer_batch_s
        var = sum((r - mr) ** 2 for r in rows)
        slope = sum((r - mr) * (dur(e) - md) for r, e in zip(rows, infer, strict=True)) / var
        if slope > 0:
            c.infer_per_row_s = slope
            c.infer_batch_s = max(0.0, md - slope * mr)
    one = [dur(e) for e in train if int(e.get("jobs", 1)) <= 1]
    c.train_step_s = _mean(one, _mean([dur(e) for e in train], c.train_step_s))
    more = [(dur(e) - c.train_step_s) / (int(e["jobs"]) - 1) for e in train if int(e.get("jobs", 1)) > 1]
    c.train_per_job_s = max(0.0, _mean(more, 0.0))
    jobs = _jobs([e for e in events if "state" in e and inside(float(e["at"]))])
    lc = [v["completed"] - v["leased"] for v in jobs.values() if "completed" in v and "leased" in v]
    c.actor_overhead_s = max(0.0, _med(lc) - c.train_step_s)
    specs = {t["tenant"]: t["spec"] for w in windows for t in w["tenants"]}
    calls = [math.ceil(s.get("horizon", 8) / max(1, s.get("action_horizon", 1)))
             for s in specs.values() if s.get("task_type") == "rl"]
    n_calls = max(1, round(_mean([float(x) for x in calls], 1.0)))
    rollout = _mean([dur(e) for e in env], 0.0)
    if env:
        c.sim_per_call_s = max(0.0, (rollout - n_calls * c.infer_batch_s) / n_calls)
        c.sim_per_call_s, c.sim_contention_s = _fit_contention(env, n_calls, c)
    gaps = []
    by_tenant: dict[str, list[float]] = defaultdict(list)
    for (t, _), v in jobs.items():
        if "reserved" in v and specs.get(t, {}).get("task_type") == "rl":
            by_tenant[t].append(v["reserved"])
    for ts in by_tenant.values():
        ts.sort()
        gaps += [b - a for a, b in itertools.pairwise(ts)]
    c.rollout_overhead_s = max(0.0, _med(gaps, rollout) - _med([dur(e) for e in env], rollout))
    c.advantages_s = _med([v["ready"] - v["needs_advantages"] for v in jobs.values()
                           if "ready" in v and "needs_advantages" in v], c.advantages_s)
    c.sft_produce_s = _med([v["ready"] - v["reserved"] for (t, _), v in jobs.items()
                            if specs.get(t, {}).get("task_type") == "sft"
                            and "ready" in v and "reserved" in v], c.sft_produce_s)
    startup: dict[str, float] = {}
    for w in windows:
        for t in w["tenants"]:
            first = [v["reserved"] for (tt, _), v in jobs.items() if tt == t["tenant"] and "reserved" in v]
            startup[t["tenant"]] = max(0.0, min(first) - w["start"]) if first else 0.0
    return c, startup


def _fit_contention(env: list[dict[str, Any]], calls: int, c: Costs) -> tuple[float, float]:
    """Simulator seconds per call as ``a + b * (others running)``: each rollout's
    per-call time against the mean number of other rollouts overlapping it
    (least squares, b >= 0; b = 0 when the overlap does not vary)."""
    iv = [(float(e["busy_start"]), float(e["busy_end"])) for e in env]
    xs, ys = [], []
    for i, (s0, e0) in enumerate(iv):
        d = e0 - s0
        if d <= 0:
            continue
        others = sum(max(0.0, min(e0, e1) - max(s0, s1)) for j, (s1, e1) in enumerate(iv) if j != i)
        xs.append(others / d)
        ys.append(max(0.0, (d - calls * c.infer_batch_s) / calls))
    if len(xs) < 4:
        return c.sim_per_call_s, 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var < 1e-6:
        return c.sim_per_call_s, 0.0
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var)
    a = max(0.0, my - b * mx)
    return a, b


def tenants_of(header: dict[str, Any], startup: dict[str, float]) -> list[TenantSpec]:
    out = []
    for w in header["windows"][0]:
        for t in w["tenants"]:
            s, sch = t["spec"], t["spec"].get("scheduling", {})
            task = s.get("task_type", "rl")
            out.append(TenantSpec(
                name=t["tenant"], task=task, updates=int(t["updates"]),
                workers=int(sch.get("max_active_rollouts", 1)) if task == "rl" else 1,
                max_in_flight=int(sch.get("max_in_flight", 2)),
                max_active_rollouts=int(sch.get("max_active_rollouts", 1)),
                max_policy_staleness=sch.get("max_policy_staleness"),
                num_envs=int(s.get("num_envs", 1)), horizon=int(s.get("horizon", 8)),
                action_horizon=int(s.get("action_horizon", 1)),
                sft_batch=int(s.get("batch_size", 16)), startup_s=startup.get(t["tenant"], 0.0),
            ))
    return out


def measured_phase(header: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    windows = header["windows"][0]
    wall = sum(w["end"] - w["start"] for w in windows)
    spans = [(w["start"], w["end"]) for w in windows]
    busy = {"train": 0.0, "infer": 0.0, "env": 0.0}
    for e in events:
        if "busy_start" in e and e.get("service") in busy:
            for a, b in spans:
                lo, hi = max(float(e["busy_start"]), a), min(float(e["busy_end"]), b)
                if hi > lo:
                    busy[e["service"]] += hi - lo
    jobs = _jobs(events)
    waits = [v["leased"] - v["ready"] for v in jobs.values() if "leased" in v and "ready" in v]
    updates: dict[str, int] = defaultdict(int)
    drops: dict[str, int] = defaultdict(int)
    per_window: dict[str, float] = {}
    for w in windows:
        for t in w["tenants"]:
            per_window[t["tenant"]] = w["end"] - w["start"]
    for (t, _), v in jobs.items():
        if "completed" in v:
            updates[t] += 1
        if "dropped" in v and "stale" in str(v):
            drops[t] += 1
    for e in events:
        if e.get("state") == "dropped" and "stale" in str(e.get("reason", "")):
            drops[e["tenant"]] += 1
    return _figures(wall, busy, waits, dict(updates), dict(drops), per_window)


def _figures(wall: float, busy: dict[str, float], waits: list[float], updates: dict[str, int],
             drops: dict[str, int], windows: dict[str, float],
             devices: dict[str, int] | None = None) -> dict[str, Any]:
    """The demo's figures; utilization is per device (busy / (wall x devices))."""
    n = devices or {}
    return {
        "wall_s": round(wall, 3),
        "device_time_s": round(2 * wall, 3),
        "busy_s": {k: round(v, 3) for k, v in busy.items()},
        "utilization": {k: round(v / (wall * n.get(k, 1)), 4) if wall else 0.0
                        for k, v in busy.items() if k != "env"},
        "update_rates_per_s": {t: round(n / windows.get(t, wall), 4) if wall else 0.0
                               for t, n in sorted(updates.items())},
        "job_wait_p50_s": percentile(waits, 50, digits=4),
        "job_wait_p99_s": percentile(waits, 99, digits=4),
        "stale_drops": dict(sorted(drops.items())),
    }


def predicted_phase(results: list[Result], dep: DeploymentPlan | None = None) -> dict[str, Any]:
    wall = sum(r.wall_s for r in results)
    busy = {k: sum(r.busy[k] for r in results) for k in ("train", "infer", "env")}
    waits = [w for r in results for w in r.waits]
    updates: dict[str, int] = {}
    drops: dict[str, int] = {}
    windows: dict[str, float] = {}
    for r in results:
        updates.update(r.updates)
        drops.update(r.drops)
        for t in r.updates:
            windows[t] = r.wall_s
    devices = {"train": dep.trainers, "infer": dep.engines} if dep else None
    out = _figures(wall, busy, waits, updates, drops, windows, devices)
    out["scheduler_decisions"] = sum(r.decisions for r in results)
    return out


def _rel(p: float, m: float) -> float | None:
    return round((p - m) / m, 4) if m else None


def comparison(pred_sh: dict[str, Any], pred_iso: dict[str, Any], meas_sh: dict[str, Any],
               meas_iso: dict[str, Any]) -> dict[str, Any]:
    def head(sh: dict[str, Any], iso: dict[str, Any]) -> dict[str, Any]:
        return {
            "shared_wall_s": sh["wall_s"],
            "isolated_wall_s": iso["wall_s"],
            "device_time_ratio": round(iso["wall_s"] / sh["wall_s"], 4) if sh["wall_s"] else None,
            "shared": sh,
            "isolated": iso,
        }

    pred, meas = head(pred_sh, pred_iso), head(meas_sh, meas_iso)
    error = {k: _rel(pred[k], meas[k]) for k in ("shared_wall_s", "isolated_wall_s",
                                                  "device_time_ratio")}
    pred["error"] = error
    meas["error"] = error
    return {"predicted": pred, "measured": meas, "error": error,
            "within_15pct": all(e is not None and abs(e) <= 0.15 for e in error.values())}


def plan_from_run(run: Path, *, plots: Path | None = None,
                  costs_from: Path | None = None) -> dict[str, Any]:
    """Predict ``run``'s windows; with ``costs_from`` (another run's directory) the
    costs and start-ups are fitted from that run only (an out-of-sample test: the
    work, admission and tenants are ``run``'s)."""
    sh_h, sh_e = load_phase(run / "events" / "shared.jsonl")
    iso_h, iso_e = load_phase(run / "events" / "isolated.jsonl")
    src = costs_from or run
    c_sh, st_sh = fit_costs(*load_phase(src / "events" / "shared.jsonl"))
    c_iso, st_iso = fit_costs(*load_phase(src / "events" / "isolated.jsonl"))
    n_rl = sum(1 for t in tenants_of(sh_h, st_sh) if t.task == "rl")
    dep_sh = DeploymentPlan(tenants=tenants_of(sh_h, st_sh), max_batch=16, max_wait_s=0.005,
                        global_max_active_rollouts=max(3, n_rl), poll_s=POLL_S)
    dep_iso = replace(dep_sh, tenants=tenants_of(iso_h, st_iso))
    shared_r = simulate(dep_sh, c_sh)
    iso_r = isolated(dep_iso, c_iso)
    out = comparison(predicted_phase([shared_r]), predicted_phase(iso_r),
                     measured_phase(sh_h, sh_e), measured_phase(iso_h, iso_e))
    # How much the shared run's costs differ from the isolated run's (on a CPU machine
    # the services and the simulators contend for the same cores): the shared window
    # predicted with the isolated run's (uncontended) costs.
    out["shared_wall_s_with_isolated_costs"] = simulate(dep_sh, c_iso).wall_s
    out["costs"] = {"shared": asdict(c_sh), "isolated": asdict(c_iso)}
    out["startup_s"] = {"shared": st_sh, "isolated": st_iso}
    out["deployment"] = dep_sh.to_dict()
    out["run"] = str(run)
    out["costs_from"] = str(src)
    if plots is not None:
        out["plots"] = _plot_timelines(plots / "plan_utilization.png", shared_r, iso_r)
    return out


def _plot_timelines(path: Path, shared_r: Result, iso_r: list[Result]) -> list[str]:
    from joynexus.ops.measure.plots import plot_utilization_timeline

    iso_iv: dict[str, list[tuple[float, float]]] = defaultdict(list)
    offset = 0.0
    for r in iso_r:
        for k, iv in r.intervals.items():
            iso_iv[k] += [(s + offset, e + offset) for s, e in iv]
        offset += r.wall_s
    plot_utilization_timeline({"shared (predicted)": shared_r.intervals,
                               "isolated (predicted)": dict(iso_iv)}, path)
    return [str(path)]


# ---------------------------------------------------------------- a described deployment


def load_config(path: Path) -> tuple[DeploymentPlan, Costs]:
    if not path.is_file():
        raise InvalidSpec(f"--config {path}: no such file")
    text = path.read_text()
    try:
        d = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise InvalidSpec(f"--config {path}: {e}") from e
    dep_d, costs_d = d.get("deployment", d), d.get("costs", {})
    try:
        dep = DeploymentPlan.from_dict(dep_d)
        costs = Costs.from_dict(costs_d)
    except (TypeError, ValueError) as e:
        raise InvalidSpec(f"--config {path}: {e}") from e
    check_deployment(dep)
    return dep, costs


def check_deployment(dep: DeploymentPlan) -> None:
    if not dep.tenants or len(dep.tenants) > 4096:
        raise InvalidSpec("a deployment needs 1-4096 tenants")
    names = [t.name for t in dep.tenants]
    if len(set(names)) != len(names):
        raise InvalidSpec("tenant names must be distinct")
    for t in dep.tenants:
        if t.task not in ("rl", "sft") or not 1 <= t.updates <= 100_000:
            raise InvalidSpec(f"tenant {t.name}: task rl|sft and 1-100000 updates")
    if not (1 <= dep.trainers <= 4096 and 1 <= dep.engines <= 4096 and dep.max_batch >= 1):
        raise InvalidSpec("trainers and engines must be 1-4096, max_batch >= 1")


def plan_config(dep: DeploymentPlan, costs: Costs) -> dict[str, Any]:
    sh = simulate(dep, costs)
    iso = isolated(dep, costs)
    p_sh, p_iso = predicted_phase([sh], dep), predicted_phase(iso, dep)
    return {
        "predicted": {
            "shared_wall_s": p_sh["wall_s"],
            "isolated_wall_s": p_iso["wall_s"],
            "device_time_ratio": round(p_iso["wall_s"] / p_sh["wall_s"], 4) if p_sh["wall_s"] else None,
            "shared": p_sh,
            "isolated": p_iso,
            "error": None,
        },
        "measured": None,
        "update_rates_per_s": p_sh["update_rates_per_s"],
        "job_wait_p50_s": p_sh["job_wait_p50_s"],
        "job_wait_p99_s": p_sh["job_wait_p99_s"],
        "stale_drops": p_sh["stale_drops"],
        "finished": sh.finished,
    }


# ---------------------------------------------------------------- printing


def render(r: dict[str, Any]) -> str:
    p, m = r["predicted"], r.get("measured")
    lines = [f"  {'':28} {'predicted':>10} {'measured':>10} {'error':>8}"]
    for k in ("shared_wall_s", "isolated_wall_s", "device_time_ratio"):
        mv = m[k] if m else None
        e = (r.get("error") or {}).get(k)
        lines.append(f"  {k:28} {p[k]!s:>10} {mv!s:>10} {'' if e is None else f'{e:+.1%}':>8}")
    for phase in ("shared", "isolated"):
        for s in ("train", "infer"):
            mv = m[phase]["utilization"][s] if m else None
            lines.append(f"  {phase + ' ' + s + ' util':28} {p[phase]['utilization'][s]!s:>10} {mv!s:>10}")
        for k in ("job_wait_p50_s", "job_wait_p99_s"):
            mv = m[phase][k] if m else None
            lines.append(f"  {phase + ' ' + k:28} {p[phase][k]!s:>10} {mv!s:>10}")
        mv = sum(m[phase]["stale_drops"].values()) if m else None
        lines.append(f"  {phase + ' stale drops':28} {sum(p[phase]['stale_drops'].values())!s:>10} {mv!s:>10}")
    lines.append("  update rates (shared, /s): " + ", ".join(
        f"{t} {v}" for t, v in p["shared"]["update_rates_per_s"].items()))
    return "\n".join(lines)
