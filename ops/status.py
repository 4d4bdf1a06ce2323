"""``joynexus status``: what the scheduler and JetStream say, as tables or JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
from nats.js.errors import NotFoundError

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.schemas.errors import Unavailable


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


async def collect(b: Broker) -> dict[str, Any]:
    out: dict[str, Any] = {"namespace": b.names.namespace, "streams": {}, "consumers": {}}
    for stream in (b.names.jobs_stream, b.names.tq_stream, b.names.metrics_stream):
        try:
            info = await b.js.stream_info(stream)
        except NotFoundError:
            continue
        out["streams"][stream] = {"messages": info.state.messages, "bytes": info.state.bytes}
        try:
            for c in await b.js.consumers_info(stream):
                out["consumers"][c.name] = {
                    "stream": stream,
                    "pending": c.num_pending,
                    "ack_pending": c.num_ack_pending,
                    "redelivered": c.num_redelivered,
                }
        except NotFoundError:
            pass
    try:
        snap = await SchedulerClient(b, by="status", call_timeout_s=2, deadline_s=3).snapshot()
        out["scheduler"] = msgspec.to_builtins(snap)
    except Unavailable as e:
        out["scheduler"] = {"error": str(e)}
    return out


def render(s: dict[str, Any]) -> str:
    parts = [f"JoyNexus namespace {s['namespace']!r}"]
    sched = s.get("scheduler", {})
    if "error" in sched:
        parts.append(f"scheduler: UNAVAILABLE ({sched['error']})")
    else:
        states = [
            "reserved",
            "producing",
            "needs_advantages",
            "computing_advantages",
            "ready",
            "leased",
            "completed",
            "dropped",
            "failed",
        ]
        rows = [
            [t, *[c.get(st, 0) for st in states]]
            for t, c in sorted(sched.get("jobs_by_tenant_state", {}).items())
        ]
        parts.append("Jobs per tenant and state\n" + table(rows, ["tenant", *states]))
        prow = [
            [
                p["tenant_id"],
                p["task_type"],
                p.get("priority", 0),
                p.get("max_in_flight", 2),
                p.get("max_active_rollouts", 1),
                p.get("completion_target") or "-",
                p.get("max_policy_staleness") if p.get("max_policy_staleness") is not None else "-",
                sched.get("versions", {}).get(f"{p['tenant_id']}.default", 0),
            ]
            for p in sched.get("policies", [])
        ]
        parts.append(
            "Tenant-task policies\n"
            + table(
                prow,
                [
                    "tenant",
                    "task",
                    "priority",
                    "in-flight",
                    "rollouts",
                    "target",
                    "staleness",
                    "version",
                ],
            )
        )
        parts.append(
            f"active rollouts: {sched.get('active_rollouts', 0)} "
            f"(global max {sched.get('limits', {}).get('max_active_rollouts', 3)}), "
            f"leases held: {sched.get('leases', 0)}"
        )
    srows = [[k, v["messages"], f"{v['bytes'] / 1e6:.2f} MB"] for k, v in s["streams"].items()]
    parts.append("Streams\n" + table(srows, ["stream", "messages", "bytes"]))
    if s["consumers"]:
        crows = [
            [k, v["stream"], v["pending"], v["ack_pending"], v["redelivered"]]
            for k, v in s["consumers"].items()
        ]
        parts.append(
            "Consumers\n"
            + table(crows, ["consumer", "stream", "pending", "ack pending", "redelivered"])
        )
    return "\n\n".join(parts)


async def status(url: str, namespace: str, *, as_json: bool = False) -> int:
    b = await Broker.connect(url, name="status", namespace=namespace)
    try:
        s = await collect(b)
    finally:
        await b.close()
    print(json.dumps(s, indent=2) if as_json else render(s), file=sys.stdout)
    return 1 if "error" in s.get("scheduler", {}) else 0
