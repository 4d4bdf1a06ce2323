"""The main job's accounting: a phase's metric events read back, the busy time,
CPU seconds, inference batches and rollouts inside its measured windows
(:func:`account`), its event log for ``joynexus plan --from-run``, and the
shared/isolated pair's figures (:func:`summarize`).

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import contextlib
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import orjson
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from joynexus.broker.connection import Broker
from joynexus.ops.mainjob.config import (
    PAPER,
    RL_TASKS,
    PhaseResult,
    TenantPlan,
    base_tenant,
    env_kind_of,
)


async def read_metrics(b: Broker) -> list[dict[str, Any]]:
    """Every metric event of this namespace so far."""
    sub = await b.js.pull_subscribe(
        b.names.all_metrics,
        stream=b.names.metrics_stream,
        config=ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30.0
        ),
    )
    out: list[dict[str, Any]] = []
    info = await sub.consumer_info()
    remaining = info.num_pending or 0
    while remaining > 0:
        msgs = await sub.fetch(min(remaining, 1000), timeout=5)
        for m in msgs:
            remaining = m.metadata.num_pending
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(m.data))
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
    return out


def account(
    result: PhaseResult,
    metrics: list[dict[str, Any]],
    windows: list[tuple[float, float]],
    tenants: set[str],
) -> None:
    """Busy time inside the measured windows, with intervals on the phase's
    timeline (isolated windows laid end to end), and each tenant's losses."""
    offset = 0.0
    for w0, w1 in windows:
        for m in metrics:
            if m.get("kind") == "system" and m.get("service") == "env" and "busy_start" in m:
                lo, hi = max(float(m["busy_start"]), w0), min(float(m["busy_end"]), w1)
                if hi > lo:
                    worker = str(m.get("instance", "")).rsplit("-", 1)[-1]
                    lane = f"env {base_tenant(str(m.get('tenant', '')))} {worker}"
                    result.intervals[lane].append(
                        (round(lo - w0 + offset, 3), round(hi - w0 + offset, 3))
                    )
                    if float(m["busy_start"]) >= w0:
                        result.env_steps += int(m.get("steps", 0))
                        result.rollouts[base_tenant(str(m.get("tenant", "")))].append(
                            (float(m["busy_end"]) - float(m["busy_start"]), int(m.get("steps", 0)))
                        )
                continue
            if (
                m.get("kind") == "system"
                and m.get("service") == "infer"
                and w0 <= float(m.get("busy_start", 0)) < w1
            ):
                result.batches.append((int(m.get("tenants", 1)), int(m.get("requests", 1))))
            if m.get("kind") == "system" and m.get("service") in ("train", "infer"):
                lo, hi = max(float(m["busy_start"]), w0), min(float(m["busy_end"]), w1)
                if hi > lo:
                    result.busy[m["service"]] += hi - lo
                    span = float(m["busy_end"]) - float(m["busy_start"])
                    share = (hi - lo) / span if span > 0 else 1.0
                    result.compute[m["service"]] += float(m.get("cpu_s", 0.0)) * share
                    result.intervals[m["service"]].append(
                        (round(lo - w0 + offset, 3), round(hi - w0 + offset, 3))
                    )
        offset += w1 - w0
    for m in metrics:
        if m.get("kind") == "learning" and "loss" in m and m["tenant_id"] in tenants:
            result.losses[base_tenant(m["tenant_id"])].append(
                (int(m["version"]), float(m["loss"]))
            )
    for curve in result.losses.values():
        curve.sort()


def write_event_log(
    out: Path,
    name: str,
    metrics: list[dict[str, Any]],
    rounds: list[list[TenantPlan]],
    windows: list[list[tuple[float, float]]],
    *,
    isolated: bool,
) -> None:
    """The phase's event log for replay (``joynexus plan --from-run``):
    ``<out>/events/<name>.jsonl``, first a header line (the measured windows, the
    tenants of each and their workloads), then every system and learning metric
    event of the namespace (busy intervals of train/infer/env, losses) and every
    job event (``state``, ``at``: lines without ``kind``)."""
    d = out / "events"
    d.mkdir(parents=True, exist_ok=True)
    groups = [
        [[p] for p in tenants] if isolated else [tenants] for tenants in rounds
    ]
    header = {
        "phase": name,
        "isolated": isolated,
        "windows": [
            [
                {"start": w0, "end": w1, "tenants": [
                    {"tenant": p.tenant, "updates": p.updates,
                     "spec": orjson.loads(msgspec.json.encode(p.spec))} for p in g
                ]}
                for (w0, w1), g in zip(ws, gs, strict=True)
            ]
            for ws, gs in zip(windows, groups, strict=True)
        ],
    }
    with open(d / f"{name}.jsonl", "wb") as f:
        f.write(orjson.dumps(header) + b"\n")
        for m in metrics:
            if m.get("kind") in ("system", "learning") or "state" in m:
                f.write(orjson.dumps(m) + b"\n")


def cores_bound(shared: PhaseResult, isolated: PhaseResult, cores: int | None = None) -> dict[str, Any]:
    """What the cores allow: the shared run used ``shared.cpu_s`` CPU seconds, which
    ``cores`` cores cannot run in less than that over ``cores`` seconds of wall time,
    so with the same CPU spent the ratio is at most isolated wall / that floor. How
    busy each run kept the cores says how CPU-bound it was (1.0: every core busy the
    whole window); a ratio past the bound needs the same work in fewer CPU seconds
    (less contention between simulators, idle roles that spend less)."""
    from joynexus.ops.runtime.threads import deployment_cores

    cores = cores or deployment_cores()
    floor_s = shared.cpu_s / cores if shared.cpu_s else 0.0
    return {
        "cores": cores,
        "isolated_cpu_s": isolated.cpu_s,
        "shared_cpu_s": shared.cpu_s,
        "shared_floor_wall_s": round(floor_s, 2),
        "max_device_time_ratio": round(isolated.wall_s / floor_s, 3) if floor_s else None,
        "shared_core_utilization": (
            round(shared.cpu_s / (cores * shared.wall_s), 3) if shared.wall_s else None),
        "isolated_core_utilization": (
            round(isolated.cpu_s / (cores * isolated.wall_s), 3) if isolated.wall_s else None),
    }



def rollout_stats(r: PhaseResult) -> dict[str, Any]:
    """Rollout durations per RL tenant and steps/s per simulator kind (a rollout's
    steps over its duration: the simulator, the policy's inference requests and
    the resets it paid, while sharing the CPU with everything else)."""
    envs = dict(RL_TASKS)
    by_tenant: dict[str, Any] = {}
    kinds: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for tenant, rolls in sorted(r.rollouts.items()):
        if not rolls:
            continue
        env = envs.get(tenant, "")
        busy, steps = sum(d for d, _ in rolls), sum(n for _, n in rolls)
        durations = sorted(d for d, _ in rolls)
        by_tenant[tenant] = {
            "env": env,
            "rollouts": len(rolls),
            "steps_per_rollout": round(steps / len(rolls), 1),
            "mean_rollout_s": round(busy / len(rolls), 3),
            "median_rollout_s": round(statistics.median(durations), 3),
            "max_rollout_s": round(durations[-1], 3),
            "steps_per_s": round(steps / busy, 2) if busy else None,
        }
        kinds[env_kind_of(env)] += rolls
    return {
        "rollouts_by_tenant": by_tenant,
        "env_steps_per_s_by_kind": {
            k: round(sum(n for _, n in v) / sum(d for d, _ in v), 2)
            for k, v in sorted(kinds.items())
            if sum(d for d, _ in v) > 0
        },
    }


def summarize(shared: PhaseResult, isolated: PhaseResult) -> dict[str, Any]:
    def phase(r: PhaseResult) -> dict[str, Any]:
        return {
            "wall_s": round(r.wall_s, 2),
            "device_time_s": round(2 * r.wall_s, 2),
            "busy_s": {k: round(v, 2) for k, v in r.busy.items()},
            "device_busy_s": round(sum(r.busy.values()), 2),
            "utilization": {k: round(r.util(k), 4) for k in r.busy},
            "compute_s": {k: round(v, 2) for k, v in r.compute.items()},
            "compute_utilization": {k: round(r.compute_util(k), 4) for k in r.compute},
            "peak_rss_mb": r.peak_rss_mb,
            "inference_batches": len(r.batches),
            "mean_tenants_per_batch": r.mean_tenants_per_batch(),
            "mean_requests_per_batch": (
                round(sum(q for _, q in r.batches) / len(r.batches), 3) if r.batches else None
            ),
            "env_steps": r.env_steps,
            "env_steps_per_s": round(r.env_steps / r.wall_s, 2) if r.wall_s else None,
            "cpu_s": r.cpu_s,
            "cpu_s_by_role": r.cpu_s_by_role,
            "peak_rss_mb_total": r.peak_rss_mb_total,
            "roles": r.roles,
            **rollout_stats(r),
        }

    ratio = lambda a, b: round(a / b, 3) if b else None  # noqa: E731
    return {
        "device_time_ratio": ratio(isolated.wall_s, shared.wall_s),
        "device_busy_ratio": ratio(sum(isolated.busy.values()), sum(shared.busy.values())),
        "train_util_ratio": ratio(shared.util("train"), isolated.util("train")),
        "infer_util_ratio": ratio(shared.util("infer"), isolated.util("infer")),
        # The same ratios from CPU seconds computed (not stretched by CPU contention).
        "train_compute_util_ratio": ratio(
            shared.compute_util("train"), isolated.compute_util("train")
        ),
        "infer_compute_util_ratio": ratio(
            shared.compute_util("infer"), isolated.compute_util("infer")
        ),
        "mean_tenants_per_batch": shared.mean_tenants_per_batch(),
        "cores_bound": cores_bound(shared, isolated),
        "paper": PAPER,
        "shared": phase(shared),
        "isolated": phase(isolated),
        # Per tenant: the shared run's outcome, with the isolated run's beside it.
        "tenants": {
            t: {**shared.tenants[t], "isolated": isolated.tenants.get(t)} for t in shared.tenants
        },
    }
