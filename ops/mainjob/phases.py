"""The main job's phases: one warm deployment per phase, its tenants' workloads
run in measured windows (all at once when shared, one at a time when isolated),
then their outcomes and learning curves (:func:`run_phase`).

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from nats.js.api import DeliverPolicy

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.eventlog import JobEventLog
from joynexus.broker.layout import (
    delete_layout,
    ensure_layout,
)
from joynexus.ops.mainjob.accounting import account, read_metrics, write_event_log
from joynexus.ops.mainjob.config import (
    PaperConfig,
    PhaseResult,
    TenantPlan,
    base_tenant,
    env_kind_of,
)
from joynexus.ops.mainjob.deployment import RoleProcesses, wait_ready
from joynexus.ops.measure.stats import wilson
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.jobs import GlobalLimits
from joynexus.sdk import Client


async def run_tenants(
    b: Broker,
    dep: RoleProcesses,
    tenants: list[TenantPlan],
    label: str,
    timeout_s: float,
    progress: bool,
    *,
    measured: bool = True,
) -> tuple[float, float]:
    """Create the workloads, wait until each reached its updates; returns the window
    (its CPU seconds by role noted in ``dep.window_cpu_s`` if ``measured``)."""
    clients = {
        p.tenant: await dep.tenant(b, p.tenant)
        for p in tenants
    }
    sched = SchedulerClient(b, by="paper")
    cpu0 = dep.cpu_seconds()
    t0 = time.time()
    try:
        for p in tenants:
            await clients[p.tenant].create_workload(p.spec)
        while True:
            dep.poll_rss()
            dep.check_alive()
            snap = await sched.snapshot()
            done = {
                p.tenant: snap.jobs_by_tenant_state.get(p.tenant, {}).get("completed", 0)
                for p in tenants
            }
            if progress:
                line = "  ".join(
                    f"{t} {done[t]}/{p.updates}" for t, p in ((p.tenant, p) for p in tenants)
                )
                print(
                    f"\r  {label:<10} {time.time() - t0:6.1f}s  {line}   ",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            if all(done[p.tenant] >= p.updates for p in tenants):
                break
            if time.time() - t0 > timeout_s:
                raise JoyNexusError(f"{label}: not finished after {timeout_s:.0f}s ({done})")
            await asyncio.sleep(0.5)
        t1 = time.time()
        cpu1 = dep.cpu_seconds()
        if measured:
            dep.window_cpu_s.append(
                {r: round(cpu1[r] - cpu0.get(r, 0.0), 2) for r in cpu1})
    finally:
        if progress:
            print(file=sys.stderr)
        for c in clients.values():
            await c.close()
    return t0, t1


def curve_versions(final: int, points: int) -> list[int]:
    """The versions a learning curve evaluates: 1 (the start), ``final`` and
    ``points - 2`` evenly between."""
    if final <= 1 or points <= 1:
        return [max(1, final)]
    inner = {round(1 + (final - 1) * k / (points - 1)) for k in range(1, points - 1)}
    return sorted({1, final} | inner)


async def _evaluate_curve(
    c: Client, p: TenantPlan, final: int, cfg: PaperConfig, progress: bool
) -> list[dict[str, Any]]:
    """The tenant's learning curve: its curve versions evaluated, pinned, one after
    another (``eval_episodes`` each, side by side in ``eval_num_envs`` envs; LIBERO's
    ``libero_eval_points``, ``libero_eval_episodes`` and ``libero_num_envs``), with the
    success's 95% interval."""
    libero = p.spec.env.startswith("LIBERO-")
    points = cfg.libero_eval_points if libero else cfg.eval_points
    num_envs = cfg.libero_num_envs if libero else cfg.eval_num_envs
    episodes = min(cfg.eval_episodes, cfg.libero_eval_episodes) if libero else cfg.eval_episodes
    out = []
    for v in curve_versions(final, points):
        t0 = time.time()
        failed: list[str] = []
        while True:
            try:
                rep = await c.evaluate(p.spec.name, episodes=episodes, version=v,
                                       num_envs=max(1, min(num_envs, episodes)), seed=1000)
                break
            except JoyNexusError as e:
                # One failed evaluation (its reason is in the record) is run once more,
                # and the report says so; a second failure ends the run.
                if failed:
                    raise
                failed.append(str(e))
                print(f"  evaluation of {p.tenant} v{v} failed ({e}); running it again",
                      file=sys.stderr, flush=True)
        n = int(rep.get("episodes", episodes))
        k = round(float(rep["success_rate"]) * n)
        row = {"version": v, "episodes": n, "success_rate": rep["success_rate"],
               "success_ci95": list(wilson(k, n)), "mean_return": rep.get("mean_return"),
               "eval_s": round(time.time() - t0, 1), **({"failed_first": failed} if failed else {})}
        out.append(row)
        if progress:
            print(f"  evaluated {p.tenant} ({p.spec.env}) v{v}: {n} episodes, success "
                  f"{row['success_rate']:.2f} {row['success_ci95']}, return "
                  f"{row['mean_return'] or 0:.2f}, {row['eval_s']:.0f} s", file=sys.stderr, flush=True)
    return out


async def _tenant_outcomes(
    b: Broker, dep: RoleProcesses, tenants: list[TenantPlan], cfg: PaperConfig | None,
    result: PhaseResult, progress: bool = False,
) -> None:
    """Each tenant's updates and states; with ``cfg``, each RL tenant's learning
    curve too (every tenant's evaluations at once, after the windows)."""
    snap = await SchedulerClient(b, by="paper").snapshot()
    clients = {p.tenant: await dep.tenant(b, p.tenant) for p in tenants}

    async def watch_rss() -> None:  # the evaluations' memory, outside the windows
        while True:
            now = dep.rss_mb()
            result.eval_peak_rss_mb_total = max(result.eval_peak_rss_mb_total,
                                                round(sum(map(sum, now.values())), 1))
            result.eval_peak_rss_mb_evaluator = max(result.eval_peak_rss_mb_evaluator,
                                                    round(max(now.get("evaluator", [0.0])), 1))
            await asyncio.sleep(1.0)

    watcher = asyncio.ensure_future(watch_rss()) if cfg is not None else None
    t0 = time.time()
    try:
        versions = {p.tenant: await clients[p.tenant].latest_version(p.spec.name) for p in tenants}
        rl = [p for p in tenants if p.spec.task_type == "rl"] if cfg and cfg.eval_episodes else []
        curves = dict(zip(
            (p.tenant for p in rl),
            await asyncio.gather(*(_evaluate_curve(clients[p.tenant], p, versions[p.tenant], cfg,
                                                   progress)
                                   for p in rl if cfg)),
            strict=True,
        ))
    finally:
        result.eval_wall_s = round(time.time() - t0, 1)
        if watcher is not None:
            watcher.cancel()
        for c in clients.values():
            await c.close()
    for p in tenants:
        states = snap.jobs_by_tenant_state.get(p.tenant, {})
        history = curves.get(p.tenant, [])
        result.tenants[base_tenant(p.tenant)] = {
            "task_type": p.spec.task_type,
            "env_or_dataset": p.spec.env or Path(p.spec.dataset).name,
            "simulator": env_kind_of(p.spec.env) if p.spec.env else None,
            "starts_from": "sft head" if p.spec.init_from_export else "fresh head",
            "updates": states.get("completed", 0),
            "final_version": versions[p.tenant],
            "dropped_stale": states.get("dropped", 0),
            "failed": states.get("failed", 0),
            "eval_success": history[-1]["success_rate"] if history else None,
            **({"eval_history": history} if history else {}),
        }


async def run_phase(
    url: str,
    out: Path,
    name: str,
    rounds: list[list[TenantPlan]],
    *,
    isolated: bool,
    cfg: PaperConfig,
    progress: bool,
    warmup: list[TenantPlan] | None = None,
) -> list[PhaseResult]:
    """One warm deployment per phase, one result per round (fresh tenants each):
    shared runs a round's tenants at once; isolated runs them one at a time (each
    window measured alone, laid end to end). ``warmup``'s tenants run first, all at
    once, in both phases alike, outside every window."""
    results = [PhaseResult(name) for _ in rounds]
    ns = f"{name[:4]}{uuid.uuid4().hex[:6]}"
    n_rl = sum(1 for p in rounds[0] if p.spec.task_type == "rl")
    # The same warm pool in both phases (isolated: one tenant's workers busy at a
    # time, the same workers per tenant as when shared), so that the next tenant's
    # window never waits for the previous one's workers to come back.
    dep = RoleProcesses(
        url, ns, out, env_workers=cfg.workers * n_rl, libero_max_steps=cfg.libero_max_steps
    )
    b = await Broker.connect(url, name=f"paper-{ns}", namespace=ns)
    windows: list[list[tuple[float, float]]] = [[] for _ in rounds]
    try:
        await ensure_layout(b)
        # The producers announce readiness on the metrics subject: listen before they start.
        ready_wait = asyncio.ensure_future(wait_ready(b, dep))
        await asyncio.sleep(0.2)
        dep.start()
        await ready_wait
        # The global bound does not bind: each tenant's own max_active_rollouts does.
        await SchedulerClient(b, by="paper").set_limits(
            GlobalLimits(max_active_rollouts=max(3, cfg.workers * n_rl))
        )
        if warmup:
            await run_tenants(b, dep, warmup, f"{name}:warm-up", cfg.phase_timeout_s, progress,
                              measured=False)
        for r, tenants in enumerate(rounds):
            groups = [[p] for p in tenants] if isolated else [tenants]
            tag = f"{name}" if len(rounds) == 1 else f"{name}#{r + 1}"
            for group in groups:
                label = f"{tag}:{base_tenant(group[0].tenant)}" if isolated else tag
                windows[r].append(
                    await run_tenants(b, dep, group, label, cfg.phase_timeout_s, progress)
                )
        metrics = await read_metrics(b)
        for r, tenants in enumerate(rounds):
            account(results[r], metrics, windows[r], {p.tenant for p in tenants})
        jobs = [
            {"at": s.event.at, "tenant": s.event.job.tenant_id, "job": s.event.job.job_id,
             "task_type": s.event.job.task_type, "state": s.event.job.state.value,
             "reason": s.event.job.reason}
            async for s in JobEventLog(b)._read(b.names.all_jobs, DeliverPolicy.ALL)
        ]
        write_event_log(out, name, metrics + jobs, rounds, windows, isolated=isolated)
        # The learning curves are evaluated once, after the first shared round's
        # windows (pinned versions: the isolated run trains the same work).
        if not isolated:
            # No rollout runs after the windows: the env workers and the envs they keep
            # built (~5 GB) go before the evaluations, which run in the evaluator's own.
            dep.stop_role("producer-rl")
        for r, tenants in enumerate(rounds):
            await _tenant_outcomes(b, dep, tenants, None if isolated or r else cfg, results[r],
                                   progress)
    finally:
        dep.stop()
        try:
            # The phase is over and its event log is in the report: free what its
            # streams reserve on the server (the Training Queue's cap, 8 GiB by default)
            # before the next phase reserves its own.
            await delete_layout(b)
        except Exception as e:  # the phase's own error, if any, is the one to raise
            print(f"[{name}] could not delete namespace {ns}'s streams: {e!r}", file=sys.stderr)
        finally:
            await b.close()
    per_round = len(dep.window_cpu_s) // max(1, len(rounds))
    for r, res in enumerate(results):
        res.peak_rss_mb = {k: round(v, 1) for k, v in dep.peak_rss_mb.items()}
        res.wall_s = sum(w1 - w0 for w0, w1 in windows[r])
        by_role: dict[str, float] = defaultdict(float)
        for w in dep.window_cpu_s[r * per_round:(r + 1) * per_round]:
            for role, cpu in w.items():
                by_role[role] += cpu
        res.cpu_s_by_role = {k: round(v, 2) for k, v in sorted(by_role.items())}
        res.cpu_s = round(sum(by_role.values()), 2)
        res.peak_rss_mb_total = round(dep.peak_rss_mb_total, 1)
        res.roles = {
            role: {"rss_mb": round(dep.role_rss_mb.get(role, 0.0), 1),
                   "ready_s": dep.ready_s.get(role)}
            for role in sorted({*dep.role_rss_mb, *dep.ready_s})
        }
    return results
