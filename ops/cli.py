"""The ``joynexus`` command: launcher, agents, demo, status and benchmarks.

Every command that needs NATS takes ``--nats URL``; without it, commands that
run a deployment start an embedded nats-server (JetStream, file store) and
stop it on exit, leaving nothing running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from joynexus.ops.runtime.deploy import nats_url
from joynexus.ops.runtime.roles import DEPLOYMENT_ROLES, ROLES, RoleOptions, run_role


def _common(p: argparse.ArgumentParser, *, embedded: bool) -> None:
    help_nats = "NATS server or cluster URL (comma-separated for several); " + (
        "without it an embedded nats-server is started" if embedded else "required"
    )
    p.add_argument("--nats", metavar="URL", default=None, required=not embedded, help=help_nats)
    p.add_argument(
        "--namespace", default="jnx", help="prefix of every stream/subject (default: jnx)"
    )
    p.add_argument(
        "--creds",
        metavar="FILE",
        default=None,
        help="credentials file to connect with (default: $JOYNEXUS_CREDS, else "
        "<data-dir>/credentials/admin.json (service.json for `agent`, control.json for `agent control`) if it exists)",
    )
    if embedded:
        _server_security(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="NAME", default=None, help="join a cluster of this name")
    p.add_argument("--cluster-port", type=int, default=6222, help="route port (default 6222)")
    p.add_argument(
        "--routes",
        default="",
        help="comma-separated nats-route://host:port of the cluster's nodes (give every node "
        "the same list); routes use TLS when --tls-cert is given. Give every node a copy of "
        "the first node's <data-dir>/credentials/ so that the identities are the same",
    )
    p.add_argument(
        "--config",
        metavar="TOML",
        default=None,
        help="launcher config: a [server] table with any of these options by name "
        "(port, host, tls_cert, tls_key, tls_ca, cluster, cluster_port, routes, no_auth, "
        "namespace, data_dir); flags given on the command line win",
    )


def _server_security(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="embedded server: authorization OFF (anyone who reaches the port is trusted); "
        "by default every connection authenticates and tenants are fenced",
    )
    p.add_argument("--tls-cert", metavar="PEM", default=None, help="embedded server: TLS certificate")
    p.add_argument("--tls-key", metavar="PEM", default=None, help="embedded server: TLS key")
    p.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=None,
        help="CA that signed the certificate (clients and cluster peers verify against it)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="joynexus",
        description="JoyNexus: multi-tenant post-training of VLA policies on NATS JetStream.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launchers: dict[str, argparse.ArgumentParser] = {}
    parser.set_defaults(_launchers=launchers)

    p = sub.add_parser(
        "demo",
        help="run the main job: the paper's mixed workload vs its isolated baseline, then a report",
        description="Run 3 RL tenants (ManiSkill PickCube and PushCube, LIBERO-spatial-0) and 1 SFT tenant on one "
        "deployment (one process per role, an embedded JetStream unless --nats), then the same "
        "work one tenant at a time; report device time, utilization, memory, loss curves and "
        "evaluation success (DIR/report.md, DIR/report.json, PNG plots). --synthetic runs a "
        "short scheduler-only demo with synthetic workers instead.",
    )
    _common(p, embedded=True)
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

    p = sub.add_parser(
        "up",
        help="run a deployment until Ctrl-C (embedded nats-server + agents)",
        description="Start the embedded nats-server (unless --nats) and one process per "
        "agent role, and keep them running until interrupted.",
    )
    _common(p, embedded=True)
    p.add_argument("--data-dir", default=".jnx", help="embedded server's store (default: .jnx)")
    p.add_argument(
        "--port", type=int, default=-1, help="embedded server's client port (default: random)"
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    _cluster_flags(p)
    launchers["up"] = p
    p.add_argument(
        "--roles",
        default=",".join(DEPLOYMENT_ROLES),
        help=f"comma-separated roles, one process each (default: {','.join(DEPLOYMENT_ROLES)}); "
        "with several hosts, each host's list is its placement rule",
    )
    p.add_argument(
        "--host-id",
        default=None,
        help="this host's name when several hosts share one deployment (each runs `up "
        "--nats <cluster> --host-id H --roles ...`): instances become <role>-H; a scheduler "
        "listed on several hosts is held by one lease, the others stand by",
    )

    p = sub.add_parser(
        "server",
        help="run only the embedded nats-server",
        description="Run a nats-server with JetStream and a file store; prints its URL.",
    )
    p.add_argument("--data-dir", default=".jnx", help="store directory (default: .jnx)")
    p.add_argument("--port", type=int, default=4222, help="client port (-1: random; default 4222)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument(
        "--namespace", default="jnx", help="deployment namespace of the bootstrap identities"
    )
    launchers["server"] = p
    _server_security(p)
    _cluster_flags(p)

    p = sub.add_parser(
        "tenant",
        help="operator: issue, revoke and list tenants' credentials",
        description="Tenant slots (admin identity). `add` issues a tenant its NATS user and "
        "writes its credentials file (owner-only) for you to hand over; the server applies it "
        "without a restart. `rm` revokes it (the tenant's connections are closed) and cancels "
        "its active workloads.",
    )
    tsub = p.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    for action, text in (
        ("add", "issue credentials to a new tenant (or new ones with --rotate)"),
        ("set", "change a tenant's quota and priority class (--quota KEY=VALUE ...)"),
        ("rm", "revoke a tenant's credentials and cancel its active workloads"),
        ("ls", "list tenants with their quotas"),
    ):
        tp = tsub.add_parser(action, help=text, description=text)
        _common(tp, embedded=False)
        tp.add_argument(
            "--data-dir",
            default=".jnx",
            help="where the deployment keeps credentials (default .jnx): admin credentials "
            "are read from <data-dir>/credentials/admin.json, tenants' written to "
            "<data-dir>/tenants/<namespace>/<tenant>.json",
        )
        if action != "ls":
            tp.add_argument("tenant", help="tenant name")
        if action == "add":
            tp.add_argument("--rotate", action="store_true", help="issue new credentials")
            tp.add_argument("--out", default=None, help="credentials file to write instead")
        if action in ("add", "set"):
            tp.add_argument(
                "--quota", action="append", default=[], metavar="KEY=VALUE",
                help="a bound on the tenant (repeatable), e.g. --quota tq_bytes=100000000 "
                "--quota priority_class=premium; keys: " + ", ".join(_quota_keys()),
            )
        if action == "rm":
            tp.add_argument(
                "--keep-workloads", action="store_true", help="do not cancel its workloads"
            )
        if action == "ls":
            tp.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser(
        "agent",
        help="run one agent role against a NATS server",
        description="Run one agent role as this process (roles can be spread over "
        "machines; each resumes from its durable consumer on restart).",
    )
    p.add_argument("role", choices=ROLES, help="the role to run")
    _common(p, embedded=False)
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
        "--backbone",
        default="tiny",
        choices=("tiny", "bench"),
        help="actor/inference: backbone size built from its config (default tiny)",
    )
    p.add_argument(
        "--backbone-path",
        default=None,
        help="actor/inference: load the backbone from this local directory instead",
    )
    p.add_argument("--max-batch", type=int, default=16, help="inference: max batch size B")
    p.add_argument(
        "--max-rows", type=int, default=64,
        help="inference: rows (observations) a batch holds at most; a larger request runs "
        "alone (default 64: one tenant's largest request fills a batch of its own)",
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

    p = sub.add_parser(
        "status",
        help="tenants, jobs per state, queues and consumers",
        description="Ask the scheduler for its state and JetStream for queue depths.",
    )
    _common(p, embedded=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--data-dir",
        default=".jnx",
        help="deployment directory whose credentials/admin.json to use (default .jnx)",
    )

    p = sub.add_parser(
        "bench",
        help="benchmarks that print figures (JSON)",
        description="Run a benchmark against an embedded nats-server (or --nats).",
    )
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, text in (
        ("scheduler", "full job lifecycles/s and transition latency p50/p99"),
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
            "kill/stop roles and the server: detect_s, restart_s, jobs lost/doubled, partitions leaked",
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
            "isolation",
            "the attack catalogue (the adversarial suite's) against a fresh secured deployment: "
            "per attack held or not and the victim tenant's p50/p99 ratio to its baseline",
        ),
    ):
        bp = bsub.add_parser(name, help=text, description=text)
        _common(bp, embedded=True)
        bp.add_argument("--seconds", type=float, default=10.0, help="measuring time (default 10)")
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
            from joynexus.ops.bench.rr import DEFAULT_ARMS, ENGINE_ARMS

            bp.add_argument("--part", choices=("echo", "engine", "all"), default="all",
                            help="echo (~10 s), engine (~40 s) or both (default)")
            bp.add_argument("--repeats", type=int, default=200, help="counted rounds (default 200)")
            bp.add_argument("--gap-ms", type=float, default=20.0,
                            help="idle pause after every request (default 20)")
            bp.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                            help="engine arms, comma-separated, the first the base, of "
                            f"{', '.join(ENGINE_ARMS)} (default {','.join(DEFAULT_ARMS)})")
        if name == "engines":
            from joynexus.ops.bench.engines import add_arguments

            add_arguments(bp)
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
    from joynexus.ops.learning_cli import add_parsers

    add_parsers(sub, bsub)  # `dataset generate` and `bench learning`
    from joynexus.ops.admin import usage as usage_cli
    from joynexus.ops.plan import planner as plan_cli

    usage_cli.add_parser(sub, _common)  # `usage`: metered usage per tenant
    plan_cli.add_parser(sub)  # `plan`: the capacity planner
    from joynexus.ops.admin.pretrain_base import add_parser as add_base_parser

    add_base_parser(sub)  # `base pretrain`
    return parser


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


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
    from joynexus.ops.runtime.telemetry import setup_tracing

    setup_tracing(f"joynexus-{role}", out_dir=opts.data_dir / "traces")

    opts.nats_url = opts.nats_url or url
    b = await Broker.connect(url, name=opts.instance, namespace=namespace)
    try:
        await run_role(role, b, stop, opts)
    finally:
        await b.close()


def _apply_config(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``up``/``server --config FILE``: the file's [server] table becomes that
    command's defaults (so flags on the command line still win)."""
    if not argv or argv[0] not in ("up", "server"):
        return
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv[1:])
    if not known.config:
        return
    import tomllib

    from joynexus.schemas.errors import InvalidSpec

    try:
        with open(known.config, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InvalidSpec(f"--config {known.config}: {e}") from e
    table = raw.get("server", raw)
    sub = parser.get_default("_launchers")[argv[0]]
    dests = {a.dest for a in sub._actions} - {"help", "config"}
    cfg = {str(k).replace("-", "_"): v for k, v in table.items()}
    unknown = sorted(set(cfg) - dests)
    if unknown:
        raise InvalidSpec(
            f"--config {known.config}: unknown options {unknown} for `{argv[0]}`; "
            f"known: {sorted(dests)}"
        )
    if isinstance(cfg.get("routes"), list):
        cfg["routes"] = ",".join(cfg["routes"])
    sub.set_defaults(**cfg)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _apply_config(parser, argv)
    except Exception as e:
        print(f"joynexus: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    _setup_logging(getattr(args, "verbose", False))
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from joynexus.schemas.errors import JoyNexusError

        if isinstance(e, JoyNexusError):
            print(f"joynexus: error: {e}", file=sys.stderr)
            return 2
        raise


def _use_credentials(args: argparse.Namespace) -> None:
    """Make ``--creds`` (or the data dir's own identity, when connecting to an
    existing server) this process's identity: every connection without explicit
    credentials uses ``$JOYNEXUS_CREDS``."""
    import os

    from joynexus.broker.credentials import CREDS_ENV

    path = getattr(args, "creds", None)
    if not path and not os.environ.get(CREDS_ENV) and getattr(args, "nats", None):
        kind = "service" if args.command == "agent" else "admin"
        if args.command == "agent" and getattr(args, "role", None) == "control":
            kind = "control"  # only the control plane's identity may write tenant identities
        candidate = Path(getattr(args, "data_dir", None) or ".jnx") / "credentials" / f"{kind}.json"
        if candidate.exists():
            path = str(candidate)
    if path:
        if not Path(path).exists():
            from joynexus.schemas.errors import InvalidSpec

            raise InvalidSpec(f"--creds {path}: no such file")
        os.environ[CREDS_ENV] = str(path)


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM, then return (so context managers clean up:
    the auth sync stops, the server gets its SIGTERM and flushes its store)."""
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def _tls(args: argparse.Namespace) -> Any:
    from joynexus.ops.natsserver import TlsFiles
    from joynexus.schemas.errors import InvalidSpec

    cert = getattr(args, "tls_cert", None)
    if not cert:
        if getattr(args, "tls_key", None) or getattr(args, "tls_ca", None):
            raise InvalidSpec("--tls-key/--tls-ca need --tls-cert")
        return None
    if not args.tls_key:
        raise InvalidSpec("--tls-cert needs --tls-key")
    if args.no_auth:
        raise InvalidSpec(
            "TLS needs authorization on: the agents' credentials files carry the CA to trust"
        )
    return TlsFiles(cert_file=cert, key_file=args.tls_key, ca_file=args.tls_ca)


def _cluster(args: argparse.Namespace, tls: Any) -> Any:
    if not getattr(args, "cluster", None):
        return None
    from joynexus.ops.natsserver import ClusterOptions

    routes = tuple(r.strip() for r in args.routes.split(",") if r.strip())
    return ClusterOptions(
        name=args.cluster, host=args.host, port=args.cluster_port, routes=routes, tls=tls
    )


def _server_name(args: argparse.Namespace) -> str:
    """Unique per node of a cluster (nats-server requires it): host and route port."""
    if not getattr(args, "cluster", None):
        return "jnx"
    import socket

    return f"jnx-{socket.gethostname()}-{args.cluster_port}"


def _embedded_opts(args: argparse.Namespace) -> dict[str, Any]:
    tls = _tls(args)
    opts = {"auth": not args.no_auth, "tls": tls, "namespace": args.namespace}
    if args.command == "up":
        opts.update(
            port=args.port, host=args.host, cluster=_cluster(args, tls), name=_server_name(args)
        )
    return opts


def _quota_keys() -> list[str]:
    from joynexus.schemas.quotas import Quota

    return list(Quota.__struct_fields__)


async def _tenant_command(args: argparse.Namespace) -> int:
    import msgspec

    from joynexus.broker.connection import Broker
    from joynexus.broker.credentials import from_env_or_file
    from joynexus.ops.admin.tenants import (
        add_tenant,
        check_applied,
        get_tenant,
        list_tenants,
        remove_tenant,
        set_tenant,
        tenant_creds_path,
    )
    from joynexus.schemas.errors import InvalidSpec
    from joynexus.schemas.quotas import parse_quota_args

    b = await Broker.connect(args.nats, name="joynexus-tenant", namespace=args.namespace)
    try:
        if args.tenant_command == "add":
            me = from_env_or_file(None)
            quota = parse_quota_args(args.quota) if args.quota else None
            creds, reply = await add_tenant(
                b, args.tenant, url=args.nats, rotate=args.rotate,
                ca_file=me.ca_file if me else None, quota=quota,
            )
            path = creds.save(
                Path(args.out) if args.out
                else tenant_creds_path(args.data_dir, args.namespace, args.tenant)
            )
            print(
                f"tenant {args.tenant}: NATS user {creds.user}; credentials written to {path} "
                "(owner-only). Hand them to the tenant: Client.connect(credentials=<file>)."
            )
            check_applied(reply, f"tenant {args.tenant}'s credentials")
        elif args.tenant_command == "set":
            if not args.quota:
                raise InvalidSpec("tenant set needs at least one --quota KEY=VALUE")
            current = await get_tenant(b, args.tenant)
            reply = await set_tenant(b, args.tenant, parse_quota_args(args.quota, current.quota))
            assert reply.tenant is not None and reply.tenant.quota is not None
            print(f"tenant {args.tenant}: quota now " + ", ".join(
                f"{k}={v}" for k, v in msgspec.structs.asdict(reply.tenant.quota).items()
            ))
        elif args.tenant_command == "rm":
            reply = await remove_tenant(b, args.tenant, cancel_workloads=not args.keep_workloads)
            check_applied(reply, f"revoking tenant {args.tenant}")
            print(
                f"tenant {args.tenant}: credentials revoked; its connections are closed"
                + (f"; cancelled workloads: {', '.join(reply.cancelled)}" if reply.cancelled else "")
            )
        else:
            tenants = await list_tenants(b)
            if args.json:
                import msgspec

                print(json.dumps([msgspec.to_builtins(t) for t in tenants]))
            elif not tenants:
                print("no tenants (add one: joynexus tenant add NAME --nats URL)")
            else:
                import time as _time

                from joynexus.schemas.quotas import DEFAULT_QUOTA

                print(f"{'TENANT':<20} {'USER':<28} {'ACTIVE/ALL':>10} {'CLASS':<9} "
                      f"{'TQ MiB':>7}  CREATED")
                for t in tenants:
                    q = t.quota or DEFAULT_QUOTA
                    created = _time.strftime("%Y-%m-%d %H:%M", _time.localtime(t.created_at))
                    counts = f"{t.active_workloads}/{t.workloads}"
                    print(f"{t.tenant_id:<20} {t.user:<28} {counts:>10} {q.priority_class:<9} "
                          f"{q.tq_bytes / 2**20:>7.0f}  {created}")
            return 0
        if reply.applied == "off":
            print("note: no auth sync answered: the server runs without authorization "
                  "(or is not a joynexus embedded server); anyone can connect", file=sys.stderr)
        return 0
    finally:
        await b.close()


def _dispatch(args: argparse.Namespace) -> int:
    import os

    _use_credentials(args)
    if args.command == "tenant":
        return asyncio.run(_tenant_command(args))
    if args.command == "agent":
        opts = RoleOptions(
            instance=args.instance or f"{args.role}-{os.getpid()}",
            lease_ttl_s=args.lease_ttl,
            out_dir=Path(args.out),
            backbone_size=args.backbone,
            backbone_path=args.backbone_path,
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
        asyncio.run(
            _until_signal(lambda stop: run_agent(args.role, args.nats, args.namespace, opts, stop))
        )
        return 0
    if args.command == "server":
        from joynexus.ops.runtime.deploy import embedded

        tls = _tls(args)
        cluster = _cluster(args, tls)
        with embedded(
            args.data_dir, namespace=args.namespace, auth=not args.no_auth, port=args.port,
            host=args.host, tls=tls, cluster=cluster, name=_server_name(args), act_as_admin=False,
        ) as ep:
            print(f"nats-server ready at {ep.url} (store: {Path(args.data_dir).resolve()})")
            if ep.admin_path:
                print(
                    f"authorization on. agents: --creds {ep.service_path}; operators: --creds "
                    f"{ep.admin_path} (the nats CLI: --user {ep.admin.user if ep.admin else ''} "
                    "--password <password in that file>); tenants: `joynexus tenant add NAME "
                    f"--nats {ep.url}`"
                )
            else:
                print("authorization OFF (--no-auth): anyone who reaches the port is trusted")
            print("Ctrl-C stops it", flush=True)
            _wait_for_signal()
        return 0
    if args.command == "up":
        from joynexus.ops.runtime.launcher import launch

        roles = [r.strip() for r in args.roles.split(",") if r.strip()]
        with nats_url(args.nats, args.data_dir, **_embedded_opts(args)) as url:
            return launch(
                url,
                args.namespace,
                roles,
                out_dir=Path(args.data_dir) / "actor",
                host_id=args.host_id,
            )
    if args.command == "status":
        from joynexus.ops.admin.status import status

        return asyncio.run(status(args.nats, args.namespace, as_json=args.json))
    if args.command == "demo" and args.synthetic:
        from joynexus.ops.mainjob.synthetic import run_demo

        with nats_url(args.nats, args.data_dir, quiet=args.json, **_embedded_opts(args)) as url:
            return asyncio.run(
                run_demo(url, args.namespace, seconds=args.seconds, as_json=args.json)
            )
    if args.command == "demo":
        from joynexus.ops.mainjob.config import use_demo_stream_caps
        from joynexus.ops.mainjob.run import main_job

        if not args.nats:  # an operator's server keeps the caps its deployment uses
            use_demo_stream_caps()
        with nats_url(args.nats, args.data_dir, quiet=args.json, **_embedded_opts(args)) as url:
            return asyncio.run(
                main_job(
                    url, Path(args.out), minutes=args.minutes, as_json=args.json,
                    repeat=args.repeat,
                )
            )
    if args.command == "base":
        from joynexus.ops.admin.pretrain_base import dispatch as base_dispatch

        return base_dispatch(args)
    if args.command == "usage":
        from joynexus.ops.admin.usage import dispatch as usage_dispatch

        return usage_dispatch(args)
    if args.command == "plan":
        from joynexus.ops.plan.planner import dispatch as plan_dispatch

        return plan_dispatch(args)
    if args.command in ("dataset", "evals") or (args.command == "bench" and args.bench == "learning"):
        from joynexus.ops.learning_cli import dispatch

        return dispatch(args)
    if args.command == "bench" and args.bench == "isolation":
        from joynexus.broker.credentials import CREDS_ENV
        from joynexus.ops.bench.isolation import bench_isolation

        result = asyncio.run(bench_isolation(
            args.nats, creds=os.environ.get(CREDS_ENV) if args.nats else None,
            service_creds=args.service_creds, datasets_root=args.datasets_root,
            namespace=args.namespace, progress=not args.json,
            only=[n for n in args.only.split(",") if n] or None,
        ))
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    if args.command == "bench":
        with nats_url(args.nats, quiet=True, **_embedded_opts(args)) as url:
            if args.bench == "scheduler":
                from joynexus.ops.bench.scheduler import bench_scheduler

                result = asyncio.run(bench_scheduler(url, args.seconds, progress=not args.json))
            elif args.bench == "faults":
                from joynexus.ops.bench.faults import bench_faults

                result = asyncio.run(bench_faults(args.nats))
            elif args.bench == "fencing":
                from joynexus.ops.bench.fencing import bench_fencing

                result = asyncio.run(bench_fencing())
            elif args.bench == "rollouts":
                from joynexus.ops.bench.rollouts import bench_rollouts

                result = asyncio.run(
                    bench_rollouts(url, seconds=max(args.seconds, 20.0), progress=not args.json)
                )
            elif args.bench == "inference":
                from joynexus.ops.bench.inference import bench_inference

                result = asyncio.run(bench_inference(url, quick=args.quick))
            elif args.bench == "engines":
                from joynexus.ops.bench.engines import bench_engines, check_build, parse_levels

                try:
                    levels = parse_levels(args.concurrency)
                    check_build(args.a)
                except ValueError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
                result = asyncio.run(
                    bench_engines(url, args.a, args.b, concurrency=levels, rounds=args.rounds,
                                  threads=args.threads)
                )
            elif args.bench == "races":
                from joynexus.ops.bench.races import bench_races

                result = asyncio.run(bench_races(url, rounds=args.rounds))
            elif args.bench == "rr":
                from joynexus.ops.bench.rr import bench_rr, parse_arms

                result = asyncio.run(bench_rr(url, part=args.part, repeats=args.repeats,
                                              gap_ms=args.gap_ms, arms=parse_arms(args.arms)))
            else:
                from joynexus.ops.bench.tq import bench_tq

                result = asyncio.run(bench_tq(url, args.seconds))
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
