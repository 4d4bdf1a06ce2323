"""``joynexus up`` (a deployment until Ctrl-C: the embedded nats-server and one
process per role) and ``joynexus server`` (only the embedded nats-server), with
the ``--config FILE`` both take."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

from joynexus.ops.cli.common import (
    cluster,
    cluster_flags,
    common,
    embedded_opts,
    server_name,
    server_security,
    tls,
    wait_for_signal,
)
from joynexus.ops.runtime.deploy import nats_url
from joynexus.ops.runtime.roles import DEPLOYMENT_ROLES
from joynexus.schemas.catalog import BASE_FAMILIES

#: The commands whose defaults ``--config FILE`` sets.
LAUNCHERS = ("up", "server")
#: What `joynexus up` starts by default: the deployment's roles and the policy gateway.
UP_ROLES = (*DEPLOYMENT_ROLES, "gateway")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "up",
        help="run a deployment until Ctrl-C (embedded nats-server + agents)",
        description="Start the embedded nats-server (unless --nats) and one process per "
        "agent role, and keep them running until interrupted.",
    )
    common(p, embedded=True)
    p.add_argument("--data-dir", default=".jnx", help="embedded server's store (default: .jnx)")
    p.add_argument(
        "--port", type=int, default=-1, help="embedded server's client port (default: random)"
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    cluster_flags(p)
    p.add_argument(
        "--roles",
        default=",".join(UP_ROLES),
        help=f"comma-separated roles, one process each (default: {','.join(UP_ROLES)}); "
        "with several hosts, each host's list is its placement rule",
    )
    p.add_argument(
        "--gateway-port", type=int,
        default=int(os.environ.get("JOYNEXUS_GATEWAY_PORT", "8000")),
        help="the policy gateway's port, on --host (default $JOYNEXUS_GATEWAY_PORT or 8000, "
        "openpi's; 0: a free one, printed)",
    )
    p.add_argument("--no-gateway", action="store_true",
                   help="leave the policy gateway out (as --roles without it)")
    p.add_argument(
        "--host-id",
        default=None,
        help="this host's name when several hosts share one deployment (each runs `up "
        "--nats <cluster> --host-id H --roles ...`): instances become <role>-H; a scheduler "
        "listed on several hosts is held by one lease, the others stand by",
    )
    p.add_argument("--base", default="qwen2_5_vl", choices=BASE_FAMILIES,
                   help="the resident base family the inference, actor and actor-forward roles build "
                   "(default qwen2_5_vl; pi05: OpenPI's PaliGemma prefix for pi05_expert heads; "
                   "smolvla: LeRobot SmolVLA's SmolVLM prefix for smolvla_expert heads)")
    p.add_argument("--backbone", default="tiny",
                   help="the base's size (qwen2_5_vl: tiny, bench; pi05: tiny, gemma_300m, gemma_2b; "
                   "smolvla: tiny, smolvlm2_500m)")
    p.add_argument("--backbone-path", default=None, metavar="DIR",
                   help="load the base from this local directory instead (pi05, smolvla: a LeRobot "
                   "policy directory, config.json + model.safetensors; its size is read from the weights)")
    p.set_defaults(run=run_up)

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
    server_security(p)
    cluster_flags(p)
    p.set_defaults(run=run_server)


def apply_config(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``up``/``server --config FILE``: the file's [server] table becomes that
    command's defaults (so flags on the command line still win)."""
    if not argv or argv[0] not in LAUNCHERS:
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
    sub = parser.get_default("_commands")[argv[0]]
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


def run_server(args: argparse.Namespace) -> int:
    from joynexus.ops.runtime.deploy import embedded

    files = tls(args)
    with embedded(
        args.data_dir, namespace=args.namespace, auth=not args.no_auth, port=args.port,
        host=args.host, tls=files, cluster=cluster(args, files), name=server_name(args),
        act_as_admin=False,
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
        wait_for_signal()
    return 0


def run_up(args: argparse.Namespace) -> int:
    from joynexus.ops.runtime.launcher import launch

    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    if args.no_gateway:
        roles = [r for r in roles if r != "gateway"]
    if "gateway" in roles and not gateway_port(args):
        return 2
    with nats_url(args.nats, args.data_dir, **embedded_opts(args)) as url:
        return launch(
            url,
            args.namespace,
            roles,
            out_dir=Path(args.data_dir) / "actor",
            host_id=args.host_id,
            base=(args.base, args.backbone),
            base_path=os.path.abspath(args.backbone_path) if args.backbone_path else None,
        )


def gateway_port(args: argparse.Namespace) -> bool:
    """Bind-check the gateway's port before anything starts (0: choose a free one) and
    hand it to the role's process (``$JOYNEXUS_GATEWAY_*``, kept across restarts); False
    with a clear message when the port is taken."""
    host, port = args.host, args.gateway_port
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            port = int(s.getsockname()[1])
    except OSError as e:
        print(f"joynexus up: the policy gateway cannot listen on {host}:{port} ({e.strerror}); "
              "another deployment's gateway? Pass --gateway-port PORT (0: a free one) or "
              "--no-gateway", file=sys.stderr)
        return False
    os.environ["JOYNEXUS_GATEWAY_HOST"], os.environ["JOYNEXUS_GATEWAY_PORT"] = host, str(port)
    print(f"joynexus up: policy gateway (openpi's protocol) at ws://{host}:{port}", flush=True)
    return True
