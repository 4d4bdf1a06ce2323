"""``joynexus status``: tenants, jobs per state, queues and consumers (``ops/admin/status.py``)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from joynexus.ops.cli.common import common


def register(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="tenants, jobs per state, queues and consumers",
        description="Ask the scheduler for its state and JetStream for queue depths.",
    )
    common(p, embedded=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--data-dir",
        default=".jnx",
        help="deployment directory whose credentials/admin.json to use (default .jnx)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from joynexus.ops.admin.status import status

    return asyncio.run(status(args.nats, args.namespace, as_json=args.json))
