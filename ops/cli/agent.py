"""``joynexus agent ROLE``: one agent role as this process (``ops/runtime/roles.py``),
until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from joynexus.ops.cli.common import common
from joynexus.ops.runtime.roles import ROLES, RoleOptions, run_role
from joynexus.schemas.catalog import BASE_FAMILIES, FAMILY_SIZES
from joynexus.schemas.inference import DEFAULT_MAX_ROWS


def register(sub: Any) -> None:
    p = sub.add_parser(
        "agent",
        help="run one agent role against a NATS server",
        description="Run one agent role as this process (roles can be spread over "
        "machines; each resumes from its durable consumer on restart).",
    )
    p.add_argument("role", choices=ROLES, help="the role to run")
    common(p, embedded=False)
    p.add_argument("--instance", default=None, help="instance name (default: <role>-<pid>)")
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=float(os.environ.get("JOYNEXUS_JOB_LEASE_TTL_S", "30")),
        help="scheduler: job lease TTL in seconds (default $JOYNEXUS_JOB_LEASE_TTL_S or 30)",
    )
    p.add_argument("--out", default=".jnx/actor", help="actor: per-tenant checkpoint directory")
    p.add_argument(
        "--data-dir",
        default=".jnx",
        help="local output: traces (traces/traces.jsonl unless OTEL_EXPORTER_OTLP_ENDPOINT "
        "is set), monitor data and ClearML offline sessions (default .jnx)",
    )
    p.add_argument(
        "--base",
        default="qwen2_5_vl",
        choices=BASE_FAMILIES,
        help="actor/actor-forward/inference: the resident base family (default qwen2_5_vl; "
        "pi05: OpenPI's PaliGemma prefix whose per-layer cache pi05_expert heads attend to; "
        "smolvla: LeRobot SmolVLA's SmolVLM prefix for smolvla_expert heads)",
    )
    p.add_argument(
        "--backbone",
        default="tiny",
        choices=sorted({s for sizes in FAMILY_SIZES.values() for s in sizes}),
        help="actor/inference: base size built from its config (default tiny; qwen2_5_vl: tiny, "
        "bench; pi05: tiny, gemma_300m, gemma_2b; smolvla: tiny, smolvlm2_500m)",
    )
    p.add_argument(
        "--backbone-path",
        default=None,
        help="actor/inference: load the backbone from this local directory instead (a LeRobot policy "
        "directory, config.json + model.safetensors: pi05's PI05Policy or smolvla's SmolVLAPolicy; "
        "its size is read from the weights)",
    )
    p.add_argument("--max-batch", type=int, default=16, help="inference: max batch size B")
    p.add_argument(
        "--max-rows", type=int, default=DEFAULT_MAX_ROWS,
        help="inference: rows (observations) a batch holds at most; a larger request runs "
        f"in parts of this many, in turn with other tenants' (default {DEFAULT_MAX_ROWS})",
    )
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="inference: batching timeout T")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="inference: torch intra-op threads (default $JOYNEXUS_INFER_THREADS, else the CPU "
        "cores less one, at least 1: the engine's event loop keeps a core)",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=None,
        help="seconds between heartbeats (default $JOYNEXUS_HEARTBEAT_S or 1)",
    )
    p.add_argument(
        "--ack-wait",
        type=float,
        default=None,
        help="stage workers: JetStream ack_wait in seconds (default $JOYNEXUS_ACK_WAIT_S or 30)",
    )
    p.add_argument(
        "--datasets",
        metavar="DIR",
        default=None,
        help="control: root of the tenants' dataset spaces, DIR/<tenant>/<dataset> "
        "(default $JOYNEXUS_DATASETS or .jnx/datasets)",
    )
    p.add_argument("--port", type=int, default=None,
                   help="gateway: websocket port (default $JOYNEXUS_GATEWAY_PORT or 8000, openpi's)")
    p.add_argument("--host", default=None,
                   help="gateway: address to listen on (default $JOYNEXUS_GATEWAY_HOST or 0.0.0.0)")
    p.add_argument("--tls-cert", default=None, help="gateway: serve wss:// with this certificate")
    p.add_argument("--tls-key", default=None, help="gateway: the certificate's private key")
    p.set_defaults(run=run)


#: After SIGTERM or SIGINT a role stops gracefully within this long, or exits hard:
#: a role whose server went away (its deployment killed) hung in its shutdown and
#: outlived the deployment (an actor and a producer-rl seen orphaned).
STOP_GRACE_S = 30.0


def _stop_soon(stop: asyncio.Event) -> None:
    """The first signal stops the role gracefully, with a hard exit ``STOP_GRACE_S``
    later if that hangs; a second signal exits at once."""
    if stop.is_set():
        os._exit(130)
    stop.set()
    timer = threading.Timer(STOP_GRACE_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


async def _until_signal(main: Callable[[asyncio.Event], Awaitable[Any]]) -> Any:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, _stop_soon, stop)
    return await main(stop)


async def run_agent(
    role: str, url: str, namespace: str, opts: RoleOptions, stop: asyncio.Event
) -> None:
    from joynexus.broker.connection import Broker
    from joynexus.ops.runtime.heap import freeze_heap
    from joynexus.ops.runtime.telemetry import setup_tracing

    setup_tracing(f"joynexus-{role}", out_dir=opts.data_dir / "traces")

    opts.nats_url = opts.nats_url or url
    opts.ready = freeze_heap  # this process runs this one role: its start-up heap is done
    b = await Broker.connect(url, name=opts.instance, namespace=namespace)
    try:
        await run_role(role, b, stop, opts)
    finally:
        await b.close()



def run(args: argparse.Namespace) -> int:
    if args.backbone not in FAMILY_SIZES[args.base]:
        print(f"joynexus agent: --backbone {args.backbone} is not a {args.base} size; choose one of "
              f"{list(FAMILY_SIZES[args.base])}", file=sys.stderr)
        return 2
    if args.backbone_path and args.role in ("inference", "actor", "actor-forward"):
        from joynexus.agents.models.families import check_base
        from joynexus.schemas.errors import InvalidSpec

        try:  # a π0.5 checkpoint's config and tensor shapes, before the role starts
            check_base(args.base, args.backbone, args.backbone_path)
        except InvalidSpec as e:
            print(f"joynexus agent: --backbone-path: {e}", file=sys.stderr)
            return 2
    opts = RoleOptions(
        instance=args.instance or f"{args.role}-{os.getpid()}",
        lease_ttl_s=args.lease_ttl,
        out_dir=Path(args.out),
        backbone_size=args.backbone,
        backbone_path=args.backbone_path,
        base_family=args.base,
        max_batch=args.max_batch,
        max_rows=args.max_rows,
        max_wait_ms=args.max_wait_ms,
        torch_threads=args.torch_threads,
        data_dir=Path(args.data_dir),
    )
    if args.heartbeat is not None:
        opts.heartbeat_s = args.heartbeat
    if args.ack_wait is not None:
        opts.ack_wait_s = args.ack_wait
    if args.datasets is not None:
        opts.datasets_root = Path(args.datasets)
    # The gateway reads its knobs from the environment (so a restart keeps them).
    for flag, var in (("port", "PORT"), ("host", "HOST"), ("tls_cert", "TLS_CERT"),
                      ("tls_key", "TLS_KEY")):
        if getattr(args, flag) is not None:
            os.environ[f"JOYNEXUS_GATEWAY_{var}"] = str(getattr(args, flag))
    asyncio.run(
        _until_signal(lambda stop: run_agent(args.role, args.nats, args.namespace, opts, stop))
    )
    return 0
