"""``joynexus usage``: what each tenant used, for operators (``broker.usage``).

Reads the meter's checkpoint (KV ``<NS>_USAGE``) and folds the events after it
(read-only), so the figures are current even between two checkpoints.
See docs/ARCHITECTURE.md, "Usage metering".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

from joynexus.broker.connection import Broker
from joynexus.broker.usage import parse_since, read_usage, report
from joynexus.schemas.jobs import check_name

COLUMNS = (
    ("train_s", "train s"),
    ("infer_s", "infer s"),
    ("env_s", "sim s"),
    ("tq_byte_s", "TQ MB*s"),
    ("infer_requests", "requests"),
    ("rows_trained", "rows trained"),
    ("jobs_completed", "jobs done"),
    ("jobs_dropped", "dropped"),
)


def add_parser(sub: Any, common: Any) -> None:
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


def render(r: dict[str, Any]) -> str:
    head = ["tenant", *(c for _, c in COLUMNS)]
    rows = []
    for t, f in r["tenants"].items():
        vals = [f"{f[k] / 1e6:.1f}" if k == "tq_byte_s" else
                (f"{f[k]:.2f}" if k.endswith("_s") else f"{int(f[k])}") for k, _ in COLUMNS]
        rows.append([t, *vals])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    lines = ["  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                       for i, (x, w) in enumerate(zip(line, widths, strict=True)))
             for line in [head, *rows]]
    as_of = datetime.fromtimestamp(r["as_of"], UTC).isoformat(timespec="seconds")
    out = [f"Usage as of {as_of}" + (
        f" since {datetime.fromtimestamp(r['since_effective'], UTC).isoformat(timespec='seconds')}"
        if r.get("since_effective") else " (since metering began)"), "", *lines]
    if "services" in r:
        s, u = r["services"], r["unattributed"]
        out += ["", "service busy s (all tenants): " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()),
                "not attributable to a tenant: " + ", ".join(f"{k} {v:.2f}" for k, v in u.items()),
                f"events folded: {r['events']}, missed (expired before metering): {r['events_missed']}"]
    return "\n".join(out)


async def usage(url: str, namespace: str, *, tenant: str | None, since: str | None,
                as_json: bool) -> int:
    if tenant is not None:
        check_name("tenant", tenant)
    t0 = parse_since(since)
    b = await Broker.connect(url, name="usage", namespace=namespace)
    try:
        state = await read_usage(b)
    finally:
        await b.close()
    r = report(state, since=t0)
    if tenant is not None:
        r["tenants"] = {k: v for k, v in r["tenants"].items() if k == tenant}
    print(json.dumps(r, indent=2) if as_json else render(r), file=sys.stdout)
    return 0


def dispatch(args: argparse.Namespace) -> int:
    return asyncio.run(usage(args.nats, args.namespace, tenant=args.tenant, since=args.since,
                             as_json=args.json))
