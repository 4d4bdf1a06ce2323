"""``joynexus demo``: the main job (``ops/mainjob/``), or with ``--synthetic`` the
scheduler-only demo with synthetic workers."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from joynexus.ops.cli.common import common, embedded_opts
from joynexus.ops.runtime.deploy import nats_url


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run the main job: the paper's mixed workload vs its isolated baseline, then a report",
        description="Run 3 RL tenants (ManiSkill PickCube and PushCube, LIBERO-spatial-0) and 1 SFT tenant on one "
        "deployment (one process per role, an embedded JetStream unless --nats), then the same "
        "work one tenant at a time; report device time, utilization, memory, loss curves and "
        "evaluation success (DIR/report.md, DIR/report.json, PNG plots). --synthetic runs a "
        "short scheduler-only demo with synthetic workers instead.",
    )
    common(p, embedded=True)
    p.add_argument(
        "--minutes",
        type=float,
        default=4.0,
        help="about how long the whole run takes here; scales the work (default 4)",
    )
    p.add_argument("--out", default="runs/demo", help="report directory (default runs/demo)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="shared/isolated pairs to measure; report.json has each device_time_ratio "
        "and their median (default 1)",
    )
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="scheduler-only demo with synthetic workers (seconds, no models)",
    )
    p.add_argument("--seconds", type=float, default=20.0, help="--synthetic: how long (default 20)")
    p.add_argument("--data-dir", default=None, help="embedded server's store (default: temporary)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.synthetic:
        from joynexus.ops.mainjob.synthetic import run_demo

        with nats_url(args.nats, args.data_dir, quiet=args.json, **embedded_opts(args)) as url:
            return asyncio.run(
                run_demo(url, args.namespace, seconds=args.seconds, as_json=args.json)
            )
    from joynexus.ops.mainjob.config import use_demo_stream_caps
    from joynexus.ops.mainjob.run import main_job

    if not args.nats:  # an operator's server keeps the caps its deployment uses
        use_demo_stream_caps()
    with nats_url(args.nats, args.data_dir, quiet=args.json, **embedded_opts(args)) as url:
        return asyncio.run(
            main_job(
                url, Path(args.out), minutes=args.minutes, as_json=args.json,
                repeat=args.repeat,
            )
        )
