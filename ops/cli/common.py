"""What several commands share: the connection options (``--nats``, ``--namespace``,
``--creds``), the embedded server's security and cluster options, and the process
identity ``--creds`` gives."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any


def common(p: argparse.ArgumentParser, *, embedded: bool) -> None:
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
        server_security(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def cluster_flags(p: argparse.ArgumentParser) -> None:
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


def server_security(p: argparse.ArgumentParser) -> None:
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


def use_credentials(args: argparse.Namespace) -> None:
    """Make ``--creds`` (or the data dir's own identity, when connecting to an
    existing server) this process's identity: every connection without explicit
    credentials uses ``$JOYNEXUS_CREDS``."""
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


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM, then return (so context managers clean up:
    the auth sync stops, the server gets its SIGTERM and flushes its store)."""
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def tls(args: argparse.Namespace) -> Any:
    from joynexus.ops.runtime.natsconfig import TlsFiles
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


def cluster(args: argparse.Namespace, tls: Any) -> Any:
    if not getattr(args, "cluster", None):
        return None
    from joynexus.ops.runtime.natsconfig import ClusterOptions

    routes = tuple(r.strip() for r in args.routes.split(",") if r.strip())
    return ClusterOptions(
        name=args.cluster, host=args.host, port=args.cluster_port, routes=routes, tls=tls
    )


def server_name(args: argparse.Namespace) -> str:
    """Unique per node of a cluster (nats-server requires it): host and route port."""
    if not getattr(args, "cluster", None):
        return "jnx"
    import socket

    return f"jnx-{socket.gethostname()}-{args.cluster_port}"


def embedded_opts(args: argparse.Namespace) -> dict[str, Any]:
    files = tls(args)
    opts = {"auth": not args.no_auth, "tls": files, "namespace": args.namespace}
    if args.command == "up":
        opts.update(
            port=args.port, host=args.host, cluster=cluster(args, files), name=server_name(args)
        )
    return opts
