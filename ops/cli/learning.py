"""``joynexus dataset generate``, ``joynexus evals`` and ``joynexus bench learning``
(added to bench's subcommands by :mod:`.bench`). See README.md and
docs/ARCHITECTURE.md, "Policies that learn"."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from joynexus.ops.admin.progress import Progress


def register(sub: Any) -> None:
    """Add ``dataset generate`` and ``evals`` to the top-level subcommands."""
    from joynexus.agents.envs.maniskill import STATE_PRESETS, TASKS

    p = sub.add_parser(
        "dataset",
        help="expert demonstration datasets (LeRobot format) for SFT",
        description="Make LeRobot datasets of scripted expert demonstrations.",
    )
    dsub = p.add_subparsers(dest="dataset", required=True, metavar="ACTION")
    g = dsub.add_parser(
        "generate",
        help="run a task's scripted expert and write its solved episodes as a LeRobot dataset",
        description=(
            "Run TASK's scripted expert (privileged simulator state) and write N solved "
            "episodes as a LeRobot dataset at DIR (images as PNG, meta/stats.json with the "
            "normalisation statistics, meta/joynexus_observation.json with the observation "
            "choice). Put DIR in a tenant's dataset space (<datasets root>/<tenant>/<name>) "
            "and name it in an SFT workload."
        ),
    )
    g.add_argument("task", choices=sorted(TASKS), metavar="TASK", help=f"one of {sorted(TASKS)}")
    g.add_argument("--episodes", type=int, required=True, metavar="N", help="solved episodes to keep")
    g.add_argument("--out", required=True, metavar="DIR", help="the dataset folder (must not exist)")
    g.add_argument(
        "--state",
        default="proprio",
        metavar="KEYS",
        help=f"comma-separated state keys or presets {sorted(STATE_PRESETS)} (default proprio: "
        "joint positions, plus PickCube's goal); e.g. privileged, or agent/qpos,extra/tcp_to_obj_pos",
    )
    g.add_argument("--cameras", default="", metavar="NAMES",
                   help="comma-separated camera slots (default: the task's base_camera)")
    g.add_argument("--image-size", type=int, default=64, help="camera image side in pixels (default 64)")
    g.add_argument("--seed", type=int, default=0, help="reset seeds derive from it (default 0)")
    g.add_argument("--json", action="store_true", help="print only a JSON summary")
    g.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    g.set_defaults(run=_generate)

    e = sub.add_parser(
        "evals",
        help="tenant: a workload's periodic evaluations (eval_every): success and return "
        "per version, a plot, the videos",
        description=(
            "A tenant's view of a workload's periodic evaluations (its spec's eval_every): "
            "success rate and mean return per version, optionally a PNG plot of success "
            "against version and the evaluation videos, fetched through the control plane "
            "with the tenant's own credentials."
        ),
    )
    e.add_argument("workload", help="the training workload (sft or rl) whose evaluations to show")
    e.add_argument("--credentials", default=None, metavar="FILE",
                   help="the tenant's credentials file (default: $JOYNEXUS_CREDS)")
    e.add_argument("--url", default=None, help="the server (default: the credentials')")
    e.add_argument("--tenant", default=None, help="the tenant (default: the credentials')")
    e.add_argument("--namespace", default=None, help="the deployment's namespace (default: the "
                   "credentials', else jnx)")
    e.add_argument("--plot", default=None, metavar="PNG", help="write success against version here")
    e.add_argument("--videos", default=None, metavar="DIR",
                   help="fetch every evaluation's videos into DIR/<evaluation>/")
    e.add_argument("--json", action="store_true", help="print the history as JSON")
    e.set_defaults(run=_run_evals)


def register_bench(bsub: Any) -> None:
    """Add ``learning`` to bench's subcommands."""
    text = (
        "SFT through the SDK on a fresh deployment, per task: demonstrations, updates, "
        "train seconds, success over 50 evaluation episodes with its Wilson 95%% interval"
    )
    bp = bsub.add_parser("learning", help=text, description=text)
    bp.add_argument("--json", action="store_true", help="print only the JSON object")
    bp.add_argument("--quick", action="store_true",
                    help="a small version for CI (PushCube, 20 demos, 150 updates, 10 episodes)")
    bp.add_argument("--tasks", default="", metavar="TASKS",
                    help="comma-separated subset of the tasks (default: all of the plan)")
    bp.add_argument("--data-dir", default=None, metavar="DIR",
                    help="keep the deployment's files here (default: a temporary directory)")
    bp.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    bp.set_defaults(run=_bench_learning)


def _quiet_datasets() -> None:
    """lerobot saves each episode through `datasets`, which draws a bar of its own per episode."""
    try:
        import datasets

        datasets.disable_progress_bars()
    except Exception:  # an older datasets: its bars stay
        pass


def _run_evals(args: argparse.Namespace) -> int:
    return asyncio.run(evals(args))


async def evals(args: argparse.Namespace) -> int:
    from joynexus.sdk import Client

    async with await Client.connect(
        args.url, tenant=args.tenant, credentials=args.credentials, namespace=args.namespace
    ) as c:
        history = await c.eval_history(args.workload)
        fetched: dict[str, list[str]] = {}
        if args.videos:
            for row in history:
                for i, name in enumerate(row["videos"]):
                    path = Path(args.videos) / row["evaluation"] / name
                    path.parent.mkdir(parents=True, exist_ok=True)
                    await c.fetch_video(row["evaluation"], i, path)
                    fetched.setdefault(row["evaluation"], []).append(str(path))
    if args.plot:
        from joynexus.ops.measure.plots import plot_eval_curves

        plot_eval_curves({args.workload: history}, Path(args.plot))
    if args.json:
        print(json.dumps({"workload": args.workload, "history": history, "videos": fetched,
                          "plot": args.plot}))
        return 0
    if not history:
        print(f"{args.workload}: no periodic evaluations (set eval_every in its spec)")
    for row in history:
        figs = (f"success {row['success_rate']:.2f}, mean return {row['mean_return']:.2f} "
                f"over {int(row['episodes'])} episodes" if "success_rate" in row else row["state"])
        print(f"v{row['version']:<6} {row['evaluation']:<32} {figs}"
              + (f"  videos: {', '.join(fetched.get(row['evaluation'], row['videos']))}"
                 if row["videos"] else ""))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from joynexus.agents.envs.lerobot_data import generate_dataset

    _quiet_datasets()
    state = [s.strip() for s in args.state.split(",") if s.strip()]
    cameras = [c.strip() for c in args.cameras.split(",") if c.strip()] or None
    bar = Progress(args.episodes, args.task)
    t0 = time.perf_counter()
    if not args.json:
        bar(0, 0)
    try:
        info = generate_dataset(
            args.task, Path(args.out), episodes=args.episodes, obs="rgb",
            image_size=args.image_size, seed=args.seed, state_keys=state or None,
            cameras=cameras, progress=None if args.json else bar,
        )
    finally:
        if not args.json:
            bar.done()
    summary = {
        "task": info.task,
        "out": str(info.root),
        "episodes": info.episodes,
        "frames": info.frames,
        "attempts": info.attempts,
        "expert_success_rate": round(info.expert_success_rate, 4),
        "state": list(info.spec.state_keys),
        "state_dim": info.spec.state_dim,
        "cameras": list(info.spec.cameras),
        "image_size": info.spec.image_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {info.episodes} episodes ({info.frames} frames, expert solved "
              f"{info.episodes}/{info.attempts}) to {info.root}; state {summary['state']} "
              f"({info.spec.state_dim} values), cameras {summary['cameras']}")
    return 0


def _bench_learning(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.learning import plans_for, run_learning

    _quiet_datasets()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] or None
    plans = plans_for(args.quick, tasks)

    def log(msg: str) -> None:  # progress on stderr, also with --json (the JSON is on stdout)
        print(msg, file=sys.stderr, flush=True)

    result = asyncio.run(run_learning(plans, data_dir=args.data_dir, log=log))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


__all__ = ["evals", "register", "register_bench"]
