"""``joynexus status``: what the scheduler and JetStream say, as tables or JSON.

See docs/ARCHITECTURE.md, "Names an operator sees" and "Health: heartbeats and in-place restarts"."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from typing import Any

import msgspec
import orjson
from nats.js.errors import NotFoundError

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker
from joynexus.broker.natsapi import service_api
from joynexus.broker.subjects import HEARTBEAT_KEYS, SUPERVISOR_KEYS
from joynexus.ops.admin import shares
from joynexus.ops.admin.bases import base_line, base_of
from joynexus.ops.admin.tables import table
from joynexus.schemas.errors import Unavailable


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
    replies = await _gather_replies(b, service_api("STATS", b.names.inference_service))
    out["base"] = base_of(replies)
    out["inference_engines"] = [
        {
            "instance": r.get("metadata", {}).get("instance") or r.get("id", ""),
            "base_model": r.get("metadata", {}).get("base_model"),
            "endpoints": [
                {
                    "subject": e.get("subject"),
                    "requests": e.get("num_requests", 0),
                    "errors": e.get("num_errors", 0),
                }
                for e in r.get("endpoints", [])
            ],
        }
        for r in replies
    ]
    out["agents"] = await _heartbeats(b)
    out["env_workers"] = env_workers(out["agents"].get("managers", []))
    out["security"] = await _refusals(b)
    out["tenants"] = await _tenants(b)
    out["workloads"] = await _workloads(b, out.get("scheduler", {}).get("versions", {}))
    return out


#: At most this many workload records are listed (the newest first).
MAX_WORKLOADS_SHOWN = 200


async def _workloads(b: Broker, versions: dict[str, int]) -> list[dict[str, Any]] | dict[str, str]:
    """Every workload record (newest first): its state, generation, how it ended and
    its policy's current version. Periodic evaluations are left out."""
    from joynexus.broker.subjects import CURSOR_KEYS
    from joynexus.schemas.base import decode
    from joynexus.schemas.workloads import WorkloadRecord

    try:
        kv = await b.js.key_value(b.names.workloads_bucket)
        keys = await kvwatch.keys(kv)
    except Exception as e:  # no layout yet, or an identity that may not read the bucket
        return {"error": f"workloads not listed ({type(e).__name__}): {e}"}
    recs = []
    for key in keys:
        if key.startswith(CURSOR_KEYS):
            continue
        with contextlib.suppress(Exception):
            rec = decode((await kv.get(key)).value or b"", WorkloadRecord)
            if not rec.periodic:
                recs.append(rec)
    recs.sort(key=lambda r: r.created_at, reverse=True)
    return [
        {
            "tenant": r.tenant_id,
            "workload": r.spec.name,
            "task": r.spec.task_type,
            "generation": r.generation,
            "state": r.state,
            "version": versions.get(f"{r.tenant_id}.{r.spec.name}", 0),
            "target": r.spec.scheduling.completion_target,
            "completed": int(r.result.get("completed", 0)) if r.state in ("done", "failed") else None,
            "reason": r.reason,
        }
        for r in recs[:MAX_WORKLOADS_SHOWN]
    ]


async def _tenants(b: Broker) -> list[dict[str, Any]] | dict[str, str]:
    """Each tenant's usage against its quota (the operator API: admin identity only)."""
    from joynexus.ops.admin.tenants import list_tenants
    from joynexus.schemas.quotas import DEFAULT_QUOTA

    try:
        infos = await asyncio.wait_for(list_tenants(b), 3.0)
    except Exception as e:  # not the admin identity, or no control plane
        return {"error": f"tenants not listed ({type(e).__name__}): connect as the admin identity"}
    out = []
    for t in infos:
        q = t.quota or DEFAULT_QUOTA
        out.append({
            "tenant": t.tenant_id,
            "class": q.priority_class,
            "active_workloads": [t.active_workloads, q.max_active_workloads],
            "workloads": [t.workloads, q.max_workloads],
            "open_jobs": [t.usage.get("open_jobs", 0), q.max_open_jobs],
            "tq_bytes": [t.usage.get("tq_bytes", 0), q.tq_bytes],
            "requests_in_flight": [t.usage.get("requests_in_flight", 0), q.max_requests_in_flight],
        })
    return out


#: At most this many security events are read to add up the refusals.
MAX_SECURITY_EVENTS = 20_000


async def _refusals(b: Broker) -> list[dict[str, Any]]:
    """Refused attempts per tenant (security metric events) and the last one of each.

    An event stands for ``count`` refusals (1 when absent: ``metrics.security``
    counts repeats), so the events are read and their counts added up (the
    oldest :data:`MAX_SECURITY_EVENTS` of them, the rest count 1 each; ``events``
    is how many the stream holds per tenant). Failed logins are tenant ``_``'s
    (with ``claimed_user``)."""
    stream, subject = b.names.metrics_stream, b.names.metrics("security", "*")
    try:
        info = await b.js.stream_info(stream, subjects_filter=subject)
    except NotFoundError:
        return []
    per_subject = dict(info.state.subjects or {})
    total = sum(per_subject.values())
    sums: dict[str, int] = {}
    read: dict[str, int] = {}
    if total:
        with contextlib.suppress(Exception):
            await _read_security(b, subject, min(total, MAX_SECURITY_EVENTS), sums, read)
    out = []
    for subj, events in sorted(per_subject.items()):
        last: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            last = orjson.loads((await b.js.get_last_msg(stream, subj)).data or b"{}")
        # Events not read (past the bound) count 1 each.
        refusals = sums.get(subj, 0) + max(0, events - read.get(subj, 0))
        out.append({"tenant": subj.rsplit(".", 1)[-1], "refusals": refusals,
                    "events": events, "last": last})
    return out


async def _read_security(
    b: Broker, subject: str, n: int, sums: dict[str, int], read: dict[str, int]
) -> None:
    """Add up the ``count`` of the first ``n`` events on ``subject``, per subject."""
    sub = await b.js.subscribe(subject, ordered_consumer=True)
    try:
        seen = 0
        while seen < n:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                return
            seen += 1
            read[msg.subject] = read.get(msg.subject, 0) + 1
            try:
                e = orjson.loads(msg.data)
            except orjson.JSONDecodeError:
                e = {}
            c = e.get("count") if isinstance(e, dict) else None
            sums[msg.subject] = sums.get(msg.subject, 0) + (
                int(c) if isinstance(c, int) and not isinstance(c, bool) and c > 0 else 1
            )
            if msg.metadata.num_pending == 0:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _gather_replies(
    b: Broker, subject: str, wait_s: float = 2.0, quiet_s: float = 0.3
) -> list[dict[str, Any]]:
    """Every responder's reply to one request (micro services answer $SRV.* each):
    until ``quiet_s`` passes with no new reply after the first, or ``wait_s`` in all
    (a loaded machine answers late; a fixed short window missed engines)."""
    inbox = b.nc.new_inbox()
    replies: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def on_reply(msg: Any) -> None:
        with contextlib.suppress(ValueError):
            replies.append(json.loads(msg.data))
        arrived.set()

    sub = await b.nc.subscribe(inbox, cb=on_reply)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    try:
        await b.nc.publish(subject, b"", reply=inbox)
        while (left := deadline - loop.time()) > 0:
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), timeout=min(left, quiet_s) if replies else left)
            except TimeoutError:
                if replies:
                    break  # quiet since the last reply
    finally:
        await sub.unsubscribe()
    return replies


async def _heartbeats(b: Broker) -> dict[str, Any]:
    """Each agent's last heartbeat and each health manager's state (KV ``<NS>_HEALTH``)."""
    try:
        kv = await b.js.key_value(b.names.health_bucket)
        watcher = await kvwatch.watch(kv)  # nats-py's marker can come early
    except Exception:  # no health bucket: no health manager in this deployment
        return {"heartbeats": [], "managers": []}
    out: list[dict[str, Any]] = []
    managers: list[dict[str, Any]] = []
    now = time.time()
    try:
        async for entry in watcher:
            if entry is None:
                break
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                continue
            with contextlib.suppress(ValueError):
                value = json.loads(entry.value)
                if entry.key.startswith(SUPERVISOR_KEYS):  # a health manager: its slots and decisions
                    managers.append(value)
                    continue
                if not entry.key.startswith(HEARTBEAT_KEYS):  # an assignment, a role's lease
                    continue
                value["age_s"] = round(now - float(value.get("at", now)), 1)
                out.append(value)
    finally:
        await watcher.stop()
    beats = sorted(out, key=lambda h: (h.get("role", ""), h.get("instance", "")))
    return {"heartbeats": beats, "managers": managers}


def env_workers(managers: list[dict[str, Any]]) -> dict[str, Any]:
    """Environment worker processes per RL workload (from the ``producer-rl``
    supervisors' views): ``{"by_workload": {key: n}, "standby": n, "workers": [...]}``."""
    workers = [
        {**sl, "supervisor": m.get("instance"), "workload": sl.get("detail") or ""}
        for m in managers
        for sl in m.get("slots", [])
        if sl.get("role") == "env-worker"
    ]
    by: dict[str, int] = {}
    for w in workers:
        if w["workload"]:
            by[w["workload"]] = by.get(w["workload"], 0) + 1
    return {
        "by_workload": by,
        "standby": sum(1 for w in workers if not w["workload"]),
        "workers": workers,
    }


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
        if rows := shares.share_rows(sched):
            parts.append(shares.TITLE + "\n" + table(rows, shares.HEADER))
        parts.append(
            f"active rollouts: {sched.get('active_rollouts', 0)} "
            f"(global max {sched.get('limits', {}).get('max_active_rollouts', 3)}), "
            f"leases held: {sched.get('leases', 0)}"
        )
    engines = s.get("inference_engines", [])
    if engines:
        erows = [
            [e["instance"], ep["subject"], ep["requests"], ep["errors"]]
            for e in engines
            for ep in e["endpoints"]
        ]
        parts.append(
            f"Inference engines (base: {base_line(s.get('base') or {})})\n"
            + table(erows, ["engine", "endpoint", "requests", "errors"])
        )
    else:
        parts.append("Inference engines: none answering")
    ew = s.get("env_workers") or {}
    if ew.get("workers"):
        wrows = [
            [w["workload"] or "(standby)", w.get("instance"), w.get("state"), w.get("pid"),
             w.get("restarts", 0)]
            for w in sorted(ew["workers"], key=lambda w: (w["workload"] or "~", w["instance"]))
        ]
        counts = ", ".join(f"{k} {n}" for k, n in sorted(ew.get("by_workload", {}).items()))
        parts.append(
            f"Environment workers: {len(ew['workers'])} ({counts or 'no RL workload'}; "
            f"standby {ew.get('standby', 0)})\n"
            + table(wrows, ["workload", "instance", "state", "pid", "restarts"])
        )
    health = s.get("agents", {})
    agents = health.get("heartbeats", [])
    for mgr in health.get("managers", []):
        # A producer-rl supervisor's slots are the environment workers shown above.
        env_only = all(sl.get("role") == "env-worker" for sl in mgr.get("slots", []))
        srows = [
            [
                sl.get("role"),
                sl.get("instance"),
                sl.get("state"),
                sl.get("pid"),
                sl.get("restarts", 0),
                (sl.get("last_reason") or "")[:50],
            ]
            for sl in mgr.get("slots", [])
        ]
        if not env_only:
            parts.append(
                f"Health manager {mgr.get('instance')} ({mgr.get('mode')}), "
                f"global restarts {mgr.get('global_restarts', 0)}\n"
                + table(srows, ["role", "instance", "state", "pid", "restarts", "last reason"])
            )
        drows = [
            [d.get("action"), d.get("role"), d.get("instance"), (d.get("reason") or "")[:60]]
            for d in mgr.get("decisions", [])[-8:]
        ]
        if drows:
            parts.append(
                "Recent health decisions\n"
                + table(drows, ["decision", "role", "instance", "reason"])
            )
    if agents:
        arows = [
            [
                a.get("role"),
                a.get("instance"),
                a.get("pid"),
                a.get("state"),
                f"{a.get('age_s')}s",
                f"{a['rss_mb']:.0f} MiB" if a.get("rss_mb") else "-",
                f"{a['ready_s']:.1f}s" if a.get("ready_s") is not None else "-",
                a.get("errors", 0),
                (a.get("last_error") or "")[:40],
            ]
            for a in agents
        ]
        parts.append(
            "Agents (heartbeats; RSS now, ready: seconds from process start to serving)\n"
            + table(
                arows,
                ["role", "instance", "pid", "state", "last beat", "RSS", "ready", "errors",
                 "last error"],
            )
        )
        for a in agents:  # roles serving clients outside NATS (the policy gateway)
            if a.get("address"):
                parts.append(f"{a.get('role')} {a.get('instance')} serves at {a['address']}")
    if s.get("security"):
        now = time.time()
        rrows = [
            [
                r["tenant"],
                r["refusals"],
                f"{now - r['last'].get('at', now):.0f}s ago",
                f"{r['last'].get('source', '')}: {r['last'].get('action', '')} "
                f"{r['last'].get('target', '') or r['last'].get('claimed_user', '')}"[:70],
            ]
            for r in s["security"]
        ]
        parts.append(
            "Refused attempts (security events; tenant _ = not a tenant)\n"
            + table(rrows, ["tenant", "refusals", "last", "last refusal"])
        )
    tenants = s.get("tenants")
    if isinstance(tenants, list) and tenants:
        def used(pair: list[int], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
            return f"{fmt.format(pair[0] / scale)}/{fmt.format(pair[1] / scale)}"

        trows = [
            [t["tenant"], t["class"], used(t["active_workloads"]), used(t["workloads"]),
             used(t["open_jobs"]), used(t["tq_bytes"], 2**20, "{:.1f}"),
             used(t["requests_in_flight"])]
            for t in tenants
        ]
        parts.append(
            "Tenants (in use / quota; `joynexus tenant set NAME --quota KEY=VALUE` changes it)\n"
            + table(trows, ["tenant", "class", "active", "workloads", "open jobs", "TQ MiB",
                            "requests"])
        )
    workloads = s.get("workloads")
    if isinstance(workloads, list) and workloads:
        wrows = [
            [w["tenant"], w["workload"], w["task"], w["generation"], w["state"], w["version"],
             "-" if w["target"] is None else w["target"],
             "" if w["completed"] is None else w["completed"], w["reason"][:60]]
            for w in workloads
        ]
        parts.append(
            "Workloads (newest first; done: its completion target of jobs completed)\n"
            + table(wrows, ["tenant", "workload", "task", "gen", "state", "version", "target",
                            "completed", "why it ended"])
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
