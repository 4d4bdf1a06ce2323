"""``joynexus usage``: usage per tenant, for operators (``ops/admin/usage.py``)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from joynexus.ops.admin.usage import usage
from joynexus.ops.cli.common import common


def register(sub: Any) -> None:
    p = sub.add_parser(
        "usage",
        help="usage per tenant: training, inference and simulator seconds, queue byte-seconds",
        description="Metered usage per tenant (the control plane's meter, exact across "
        "restarts): training-service seconds (a grouped step split among its tenants by "
        "rows), inference-service seconds (a batch split by rows), simulator seconds of "
        "the tenant's environment workers, Training Queue byte-seconds, inference "
        "requests and jobs.",
    )
    common(p, embedded=False)
    p.add_argument("--tenant", default=None, help="only this tenant")
    p.add_argument("--since", default=None, metavar="ISO",
                   help="from this time on (ISO 8601, UTC if no zone; counted from its hour)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--data-dir", default=".jnx",
                   help="deployment directory whose credentials/admin.json to use (default .jnx)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(usage(args.nats, args.namespace, tenant=args.tenant, since=args.since,
                             as_json=args.json))
