"""``joynexus plan``: the capacity planner (``ops/plan/``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from joynexus.ops.plan.planner import load_config, plan_config, plan_from_run, render


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity planner: the real scheduler core on a simulated clock",
        description="Simulate a deployment (discrete events; the real SchedulerCore's "
        "admission, lease order and staleness drops) against models of the training "
        "service (grouped steps), the inference service (batching with cap and wait) and "
        "environment pools. --from-run DIR fits the costs from a main job's event log "
        "(joynexus demo --out DIR) and prints the prediction beside the measurement; "
        "--config FILE runs a described deployment (JSON or TOML); --scale runs the "
        "paper's layout and the 4-256 tenant sweep (PNG curves).",
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--from-run", metavar="DIR", help="a main job's output directory")
    g.add_argument("--config", metavar="FILE", help="a deployment (JSON or .toml)")
    g.add_argument("--scale", action="store_true", help="the paper's layout and the sweep")
    p.add_argument("--costs-from", default=None, metavar="DIR",
                   help="--from-run: fit the costs from this other run instead "
                   "(an out-of-sample prediction of DIR's windows)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where plots go (default: DIR of --from-run/plots, or runs/plan)")
    p.add_argument("--sched-decisions-per-s", type=float, default=None,
                   help="--scale: the scheduler's measured decisions/s "
                   "(joynexus bench scheduler: transitions_per_s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.from_run:
        run = Path(args.from_run)
        out = Path(args.out) if args.out else run / "plots"
        r = plan_from_run(run, plots=out,
                          costs_from=Path(args.costs_from) if args.costs_from else None)
    elif args.config:
        dep, costs = load_config(Path(args.config))
        r = plan_config(dep, costs)
    else:
        from joynexus.ops.plan.scale import scale_study

        r = scale_study(Path(args.out or "runs/plan"), sched_dps=args.sched_decisions_per_s)
        print(json.dumps(r, indent=None if args.json else 2))
        return 0
    print(json.dumps(r, indent=2) if args.json else render(r), file=sys.stdout)
    return 0
