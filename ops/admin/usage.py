"""``joynexus usage``: what each tenant used, for operators (``broker.usage``).

Reads the meter's checkpoint (KV ``<NS>_USAGE``) and folds the events after it
(read-only), so the figures are current even between two checkpoints.
See docs/ARCHITECTURE.md, "Usage metering".
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

from joynexus.broker.connection import Broker
from joynexus.broker.usage import read_usage
from joynexus.broker.usagestate import parse_since, report
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
