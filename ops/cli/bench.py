"""``joynexus bench NAME``: benchmarks that print figures (JSON), each against an
embedded nats-server unless ``--nats`` (``ops/bench/``; ``bench learning`` is
registered by :mod:`.learning`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from joynexus.ops.bench.engines import add_arguments
from joynexus.ops.bench.rr import DEFAULT_ARMS, ENGINE_ARMS
from joynexus.ops.cli import learning
from joynexus.ops.cli.common import common, embedded_opts
from joynexus.ops.runtime.deploy import nats_url
from joynexus.schemas.catalog import BASE_FAMILIES, FAMILY_SIZES
from joynexus.schemas.inference import DEFAULT_MAX_ROWS


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks that print figures (JSON)",
        description="Run a benchmark against an embedded nats-server (or --nats).",
    )
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, text in (
        ("scheduler", "full job lifecycles/s and transition latency p50/p99"),
        (
            "fairness",
            "12 RL tenants (rates 1x/3x/10x, share weights 1 and 2) on one scarce actor: "
            "jain_equal_weight, class_share_ratio, updates_per_tenant",
        ),
        ("tq", "Training Queue put/get MB/s for 1-8 MB partitions"),
        ("inference", "group-batching speedup grid, request-reply latency/throughput, RSS"),
        (
            "rr",
            "where a request/reply round trip goes: nats-py vs the fast path (echo, bare TCP), "
            "and real engines differing in torch threads, OMP_WAIT_POLICY or the fast path",
        ),
        (
            "engines",
            "two builds of the inference engine served at once, clients alternating between "
            "them round by round: throughput (and c1 p50) of each and their ratio's interval",
        ),
        (
            "faults",
            "kill/stop roles and the server (also under a training client): detect_s, restart_s, "
            "jobs lost/doubled, partitions leaked",
        ),
        (
            "fencing",
            "tenant fencing's cost on its own secured server: tenant add, connect, data relayed "
            "through the control plane vs direct, event latency",
        ),
        (
            "rollouts",
            "aggregate environment steps/s with 1, 2 and 3 RL tenants at once, each with its "
            "own environment worker process (steps_per_s, ratio_3_vs_1)",
        ),
        (
            "races",
            "how often two nats-py races strike, with and without the guard: a KV watch's "
            "early end-of-values marker (kvwatch) and a service asked before its SUBs land "
            "(sync_server)",
        ),
        (
            "gateway",
            "a round trip through the policy gateway (openpi's protocol) vs a direct SDK act, "
            "interleaved: p50/p99 of each and the overhead's paired interval",
        ),
        (
            "primitives",
            "a training client's forward_backward + optim_step round trip vs the built-in sft "
            "step at the same batch size, interleaved: fwdbwd_p50_ms, optim_step_p50_ms, "
            "sft_step_p50_ms, ratio (target <= 2)",
        ),
        (
            "isolation",
            "the attack catalogue (the adversarial suite's) against a fresh secured deployment: "
            "per attack held or not and the victim tenant's p50/p99 ratio to its baseline",
        ),
    ):
        bp = bsub.add_parser(name, help=text, description=text)
        common(bp, embedded=True)
        secs = 30.0 if name == "fairness" else 10.0
        bp.add_argument("--seconds", type=float, default=secs,
                        help=f"measuring time (default {secs:.0f})")
        bp.add_argument("--json", action="store_true", help="print only the JSON object")
        if name == "inference":
            bp.add_argument(
                "--quick", action="store_true", help="small grid, tiny backbone (~1 min)"
            )
        if name == "races":
            bp.add_argument(
                "--rounds", type=int, default=500,
                help="rounds per part, each arm once a round (default 500, ~10 s)",
            )
        if name == "rr":
            bp.add_argument("--part", choices=("echo", "engine", "all"), default="all",
                            help="echo (~10 s), engine (~40 s) or both (default)")
            bp.add_argument("--repeats", type=int, default=200, help="counted rounds (default 200)")
            bp.add_argument("--gap-ms", type=float, default=20.0,
                            help="idle pause after every request (default 20)")
            bp.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                            help="engine arms, comma-separated, the first the base, of "
                            f"{', '.join(ENGINE_ARMS)} (default {','.join(DEFAULT_ARMS)})")
        if name == "engines":
            add_arguments(bp)
        if name == "gateway":
            bp.add_argument("--repeats", type=int, default=200, help="counted rounds (default 200)")
            bp.add_argument(
                "--success", action="store_true",
                help="instead: compare the evaluator's episodes with openpi's own client's on "
                "the same seeds: ManiSkill (an SFT policy trained through the SDK; success, "
                "~4 min) or LIBERO (an RL workload's initial version; the episodes' videos "
                "frame for frame, ~1-2 min)")
            bp.add_argument("--task", default="PushCube-v1",
                            help="with --success: a ManiSkill task or LIBERO-<suite>-<i> "
                            "(default PushCube-v1)")
            bp.add_argument("--episodes", type=int, default=30, help="with --success (default 30)")
            bp.add_argument("--seed", type=int, default=2027, help="with --success (default 2027)")
            bp.add_argument("--max-steps", type=int, default=20,
                            help="with a LIBERO --task: steps per episode (default 20)")
        if name == "primitives":
            bp.add_argument("--repeats", type=int, default=20, help="counted rounds (default 20)")
            bp.add_argument("--rows", type=int, default=8, help="rows per step (default 8)")
        if name == "isolation":
            bp.add_argument(
                "--datasets-root", metavar="DIR", default=None,
                help="with --nats: the service's datasets root on this machine (the tenants' "
                "dataset spaces are written under it)",
            )
            bp.add_argument(
                "--service-creds", metavar="FILE", default=None,
                help="with --nats: the service identity's file (for the attack that tries it)",
            )
            bp.add_argument(
                "--only", metavar="NAMES", default="", help="comma-separated attack names"
            )
            bp.add_argument(
                "--agents", choices=("processes", "in-process"), default="processes",
                help="the fresh deployment's agents: one process per role, as `joynexus up` "
                "runs them (default), or all in the bench's process (quicker to start; the "
                "victim's probe then shares their event loop)",
            )
            bp.add_argument(
                "--gateway-url", default="", metavar="URL",
                help="with --nats: the deployment's policy gateway (ws://HOST:PORT) for the "
                "gateway attacks (a fresh deployment starts its own)")
            bp.add_argument(
                "--max-rows", type=int, default=DEFAULT_MAX_ROWS, metavar="N",
                help="a fresh deployment's inference engine: rows per batch, larger requests "
                f"in parts of N/2 (default {DEFAULT_MAX_ROWS}, as `joynexus agent inference`)")
        bp.set_defaults(run=RUNNERS[name])
    learning.register_bench(bsub)  # `bench learning`
    fp = bsub.add_parser(
        "families",
        help="a base family's shared forward, grouped vs serial at 8x1 and 8x4, base RSS",
        description="One forward of the resident base over T tenants' rows vs one per tenant "
        "(pi05, smolvla: the per-layer prefix cache), interleaved: medians, the speedup's 95%% interval, "
        "the base's RSS and the load. Random weights from the family's config.",
    )
    fp.add_argument("--base", default="pi05", choices=BASE_FAMILIES, help="base family (default pi05)")
    fp.add_argument("--size", default="tiny", help="its size (pi05: tiny, gemma_300m, gemma_2b; smolvla: tiny, smolvlm2_500m)")
    fp.add_argument("--tenants", type=int, default=8, help="tenants T (default 8)")
    fp.add_argument("--rows", default="1,4", help="rows per tenant B, comma-separated (default 1,4)")
    fp.add_argument("--repeats", type=int, default=10, help="counted rounds (default 10)")
    fp.add_argument("--json", action="store_true", help="print only the JSON object")
    fp.set_defaults(run=_families)


def _on_url(args: argparse.Namespace, bench: Callable[[str], dict[str, Any] | int]) -> int:
    """``bench(url)`` with ``--nats`` or a fresh embedded server's URL, its result
    printed as JSON (an int: the exit status, nothing printed)."""
    with nats_url(args.nats, quiet=True, **embedded_opts(args)) as url:
        result = bench(url)
    if isinstance(result, int):
        return result
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _primitives(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.primitives import bench_primitives

    # Its tenants connect in this process without issued credentials: an embedded
    # server of its own runs without authorization (with --nats: one that allows it).
    args.no_auth = True
    return _on_url(args, lambda url: asyncio.run(
        bench_primitives(url, repeats=args.repeats, rows=args.rows, progress=not args.json)))


def _fairness(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.fairness import bench_fairness

    return _on_url(args, lambda url: asyncio.run(
        bench_fairness(url, args.seconds, progress=not args.json)))


def _scheduler(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.scheduler import bench_scheduler

    return _on_url(args, lambda url: asyncio.run(
        bench_scheduler(url, args.seconds, progress=not args.json)))


def _faults(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.faults import bench_faults

    return _on_url(args, lambda url: asyncio.run(bench_faults(args.nats)))


def _fencing(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.fencing import bench_fencing

    return _on_url(args, lambda url: asyncio.run(bench_fencing()))


def _rollouts(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.rollouts import bench_rollouts

    return _on_url(args, lambda url: asyncio.run(
        bench_rollouts(url, seconds=max(args.seconds, 20.0), progress=not args.json)))


def _inference(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.inference import bench_inference

    return _on_url(args, lambda url: asyncio.run(bench_inference(url, quick=args.quick)))


def _engines(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.engines import bench_engines, check_build, parse_levels

    def bench(url: str) -> dict[str, Any] | int:
        try:
            levels = parse_levels(args.concurrency)
            check_build(args.a)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return asyncio.run(
            bench_engines(url, args.a, args.b, concurrency=levels, rounds=args.rounds,
                          threads=args.threads)
        )

    return _on_url(args, bench)


def _races(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.races import bench_races

    return _on_url(args, lambda url: asyncio.run(bench_races(url, rounds=args.rounds)))


def _rr(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.rr import bench_rr, parse_arms

    return _on_url(args, lambda url: asyncio.run(
        bench_rr(url, part=args.part, repeats=args.repeats, gap_ms=args.gap_ms,
                 arms=parse_arms(args.arms))))


def _tq(args: argparse.Namespace) -> int:
    from joynexus.ops.bench.tq import bench_tq

    return _on_url(args, lambda url: asyncio.run(bench_tq(url, args.seconds)))


def _isolation(args: argparse.Namespace) -> int:
    """Its own fresh secured deployment (or ``--nats``): no embedded server here."""
    from joynexus.broker.credentials import CREDS_ENV
    from joynexus.ops.bench.isolation import bench_isolation

    result = asyncio.run(bench_isolation(
        args.nats, creds=os.environ.get(CREDS_ENV) if args.nats else None,
        service_creds=args.service_creds, datasets_root=args.datasets_root,
        namespace=args.namespace, progress=not args.json,
        only=[n for n in args.only.split(",") if n] or None,
        processes=args.agents == "processes", gateway_url=args.gateway_url,
        max_rows=args.max_rows,
    ))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _gateway(args: argparse.Namespace) -> int:
    """Its own fresh secured deployment: no embedded server here."""
    from joynexus.ops.bench.gateway import bench_gateway

    if args.success:
        from joynexus.ops.bench.gatewaysuccess import bench_success

        out = asyncio.run(bench_success(
            task=args.task, episodes=args.episodes, seed=args.seed, max_steps=args.max_steps,
            log=None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))))
        print(json.dumps(out, indent=None if args.json else 2))
        return 0 if out["agree"] and out.get("same_episodes", True) else 1
    print(json.dumps(asyncio.run(bench_gateway(repeats=args.repeats)),
                     indent=None if args.json else 2))
    return 0


def _families(args: argparse.Namespace) -> int:
    """No server: the base alone, in this process."""
    from joynexus.ops.bench.families import bench_families

    if args.size not in FAMILY_SIZES[args.base] or args.tenants < 1 or args.repeats < 1:
        print(f"joynexus bench families: sizes of {args.base} are {list(FAMILY_SIZES[args.base])}; "
              "--tenants and --repeats must be >= 1", file=sys.stderr)
        return 2
    rows = tuple(int(r) for r in args.rows.split(",") if r.strip())
    result = bench_families(args.base, args.size, tenants=args.tenants, rows=rows, repeats=args.repeats)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


#: Each benchmark's runner, by name.
RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "scheduler": _scheduler,
    "fairness": _fairness,
    "primitives": _primitives,
    "tq": _tq,
    "inference": _inference,
    "rr": _rr,
    "engines": _engines,
    "faults": _faults,
    "fencing": _fencing,
    "rollouts": _rollouts,
    "races": _races,
    "isolation": _isolation,
    "gateway": _gateway,
}
