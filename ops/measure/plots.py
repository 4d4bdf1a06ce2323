"""The main job's figures, after the paper's: the utilization timeline (Figure
9), loss curves grouped vs serial (Figure 12), the speedup grid (Figure 10), and
success against version from the periodic evaluations. Pure functions (no broker,
no clock) from JSON-ready results to PNGs (matplotlib, Agg); :mod:`.report`
writes them into ``report.md``.

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

DPI = 100
#: Figure sizes in inches; a PNG is these times DPI pixels.
SIZES: dict[str, tuple[float, float]] = {
    "utilization": (12.0, 6.0),
    "loss_curves": (12.0, 7.0),
    "group_speedup": (8.0, 5.5),
    "eval_curves": (9.0, 5.0),
}
SERVICE_COLORS = {"training": "tab:blue", "inference": "tab:orange"}
#: Short service names (``broker.metrics.busy``) as the plots spell them.
SERVICE_NAMES = {"train": "training", "infer": "inference"}


def figure_pixels(name: str) -> tuple[int, int]:
    """(width, height) in pixels of the PNG a plot function writes."""
    w, h = SIZES[name]
    return round(w * DPI), round(h * DPI)


def _save(fig: Figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")  # no bbox "tight": the size stays what SIZES says
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- utilization


def merge_intervals(intervals: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """Overlapping or touching (start, end) intervals merged, in order."""
    out: list[tuple[float, float]] = []
    for s, e in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def busy_fraction(intervals: Sequence[Sequence[float]], t0: float, t1: float) -> float:
    """Share of [t0, t1] covered by the intervals (overlaps counted once)."""
    if t1 <= t0:
        return 0.0
    busy = sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in merge_intervals(intervals))
    return busy / (t1 - t0)


def _run_span(services: Mapping[str, Sequence[Sequence[float]]]) -> tuple[float, float]:
    starts = [float(s) for iv in services.values() for s, _ in iv]
    ends = [float(e) for iv in services.values() for _, e in iv]
    return (min(starts), max(ends)) if starts else (0.0, 1.0)


def plot_utilization_timeline(
    timelines: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], path: Path
) -> Path:
    """Figure 9: one panel per run, one row of busy bars per service.

    ``timelines[run][service]`` is a list of (t_start, t_end) in seconds (any
    origin: each run is shifted to start at 0). The row label gives the busy
    fraction over the run's span; panels share the time axis, so a shorter
    shared run shows as a shorter bar row.
    """
    runs = list(timelines)
    fig, axes = plt.subplots(
        max(1, len(runs)), 1, figsize=SIZES["utilization"], sharex=True, squeeze=False
    )
    palette = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"][2:])
    colors = dict(SERVICE_COLORS)
    for ax, run in zip(axes[:, 0], runs, strict=False):
        services = timelines[run]
        t0, t1 = _run_span(services)
        labels = []
        for row, (key, intervals) in enumerate(services.items()):
            service = SERVICE_NAMES.get(key, key)
            # Environment lanes ("env <tenant> <worker>"): one color per tenant.
            family = " ".join(service.split()[:2]) if service.startswith("env ") else service
            color = colors.setdefault(family, next(palette, "tab:gray"))
            merged = merge_intervals(intervals)
            ax.broken_barh(
                [(s - t0, e - s) for s, e in merged], (row - 0.35, 0.7), facecolors=color
            )
            labels.append(f"{service}\n{busy_fraction(merged, t0, t1):.1%} busy")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_ylim(-0.6, len(labels) - 0.4)
        ax.invert_yaxis()
        ax.set_title(f"{run}: {t1 - t0:.1f} s", loc="left", fontsize=11)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time since run start (s)")
    axes[-1, 0].set_xlim(left=0)
    fig.suptitle("Service utilization over time (busy intervals), shared vs isolated", fontsize=13)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- loss curves


def plot_loss_curves(
    curves: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], path: Path
) -> Path:
    """Figure 12: one panel per tenant, one line per mode (e.g. grouped vs serial).

    ``curves[tenant][mode]`` is a list of (step, loss).
    """
    tenants = list(curves)
    n = max(1, len(tenants))
    cols = min(n, 2 if n <= 4 else 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=SIZES["loss_curves"], squeeze=False)
    styles = {"grouped": ("tab:blue", "-"), "serial": ("tab:red", "--")}  # by mode prefix
    for i, ax in enumerate(axes.flat):
        if i >= len(tenants):
            ax.axis("off")
            continue
        tenant = tenants[i]
        for mode, pts in curves[tenant].items():
            if not pts:
                continue
            color, ls = next((v for k, v in styles.items() if mode.startswith(k)), (None, ":"))
            xs, ys = zip(*((float(s), float(v)) for s, v in pts), strict=True)
            ax.plot(
                xs,
                ys,
                ls,
                color=color,
                label=mode,
                linewidth=1.6,
                marker="." if len(xs) < 40 else None,
            )
        ax.set_title(f"tenant {tenant}", fontsize=11)
        ax.set_xlabel("optimizer step (policy version)")
        ax.set_ylabel("training loss")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle("Per-tenant loss: grouped shared forward vs serial", fontsize=13)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- evaluation


def eval_points(history: Sequence[Any]) -> list[tuple[int, float, float | None]]:
    """(version, success_rate, mean_return) of an evaluation history, by version:
    rows as ``Client.eval_history`` returns them (dicts; rows without figures are
    skipped) or (version, success[, return]) tuples."""
    out = []
    for row in history:
        if isinstance(row, Mapping):
            if row.get("success_rate") is None or row.get("version") is None:
                continue
            ret = row.get("mean_return")
            out.append((int(row["version"]), float(row["success_rate"]),
                        None if ret is None else float(ret)))
        else:
            out.append((int(row[0]), float(row[1]), float(row[2]) if len(row) > 2 else None))
    return sorted(out)


def plot_eval_curves(curves: Mapping[str, Sequence[Any]], path: Path) -> Path:
    """Success rate against policy version, one line per tenant (or workload), from
    the periodic evaluations (``eval_every``); ``curves[name]`` as ``eval_points`` reads."""
    fig, ax = plt.subplots(figsize=SIZES["eval_curves"])
    for name, history in curves.items():
        pts = eval_points(history)
        if pts:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            line = ax.plot(xs, ys, "-", marker="o", linewidth=1.6, label=name)[0]
            bounds = {int(r["version"]): r["success_ci95"] for r in history
                      if isinstance(r, Mapping) and r.get("success_ci95")}
            if bounds:  # the 95% interval of each point's success
                lo = [y - bounds[x][0] if x in bounds else 0.0 for x, y in zip(xs, ys, strict=True)]
                hi = [bounds[x][1] - y if x in bounds else 0.0 for x, y in zip(xs, ys, strict=True)]
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor=line.get_color(),
                            alpha=0.5, capsize=3)
    ax.set_xlabel("policy version")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.03, 1.03)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=9)
    ax.set_title("Evaluation success against version (pinned, 95% intervals)", fontsize=12)
    fig.tight_layout()
    return _save(fig, path)


# --------------------------------------------------------------------------- speedup grid

_TXB = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


def parse_grid(
    group_speedup: Mapping[str, float],
) -> tuple[list[int], list[int], list[list[float]]]:
    """``{"TxB": speedup}`` -> (tenant counts, batch sizes, speedup[t][b], NaN where absent)."""
    cells: dict[tuple[int, int], float] = {}
    for key, v in group_speedup.items():
        m = _TXB.match(key)
        if not m:
            raise ValueError(f"group_speedup key {key!r} is not 'TxB' (e.g. '8x4')")
        cells[int(m[1]), int(m[2])] = float(v)
    ts = sorted({t for t, _ in cells})
    bs = sorted({b for _, b in cells})
    return ts, bs, [[cells.get((t, b), math.nan) for b in bs] for t in ts]


def plot_speedup_grid(group_speedup: Mapping[str, float], path: Path) -> Path:
    """Figure 10: heatmap of grouped speedup, tenants (rows) x batch size (columns),
    with the number in every cell."""
    ts, bs, grid = parse_grid(group_speedup)
    fig, ax = plt.subplots(figsize=SIZES["group_speedup"])
    finite = [v for row in grid for v in row if not math.isnan(v)]
    vmax = max([*finite, 1.0])
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgray")
    im = ax.imshow(
        grid, cmap=cmap, vmin=min([*finite, 1.0]), vmax=vmax, origin="lower", aspect="auto"
    )
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            text = "n/a" if math.isnan(v) else f"{v:.2f}x"
            light = not math.isnan(v) and v < 0.6 * vmax + 0.4 * min([*finite, 1.0])
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize=12,
                color="white" if light else "black",
            )
    ax.set_xticks(range(len(bs)), [str(b) for b in bs])
    ax.set_yticks(range(len(ts)), [str(t) for t in ts])
    ax.set_xlabel("batch size per tenant (B, observations)")
    ax.set_ylabel("tenants in the group (T)")
    ax.set_title("Grouped shared-forward speedup over per-tenant forwards")
    fig.colorbar(im, ax=ax, label="speedup (x)")
    fig.tight_layout()
    return _save(fig, path)
