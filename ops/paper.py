"""The main job: the paper's mixed workload, then its isolated baseline.

The paper's claim is that sharing the services costs less device time than
giving each tenant its own; this measures it on one deployment (3 RL tenants,
one of them on LIBERO, plus 1 SFT tenant, one process per role) against the
same work one tenant at a time (windows added), with the same environment
workers and per-step settings, both measured only once every role is warm.
Everything comes from the event stream, not guesses: busy intervals per
training step and inference batch, job events, and the polled RSS; device
time is 2 x wall time, ``device_time_ratio`` = isolated / shared (the paper:
1.39x), ``train_util_ratio`` and ``infer_util_ratio`` shared / isolated
(1.99x, 1.33x). On a CPU machine the services share the cores, so busy
intervals stretch; ``*_compute_util_ratio`` uses the CPU seconds they report.

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import orjson
import psutil
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from joynexus.agents.datasets import DATASETS_ENV
from joynexus.agents.envworkers.assign import WARM_ENV
from joynexus.agents.procs import die_with_parent
from joynexus.agents.producers.supervisor import SFT_WARM_ENV
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.broker.eventlog import JobEventLog
from joynexus.broker.layout import (
    METRICS_MAX_BYTES_ENV,
    TQ_MAX_BYTES_ENV,
    delete_layout,
    ensure_layout,
)
from joynexus.broker.subjects import HEARTBEAT_KEYS, service_api
from joynexus.ops.admin.tenants import add_tenant
from joynexus.ops.bench.stats import wilson
from joynexus.ops.paper_heads import RECIPES, init_path, prepare_heads
from joynexus.ops.runtime.deploy import role_env
from joynexus.ops.runtime.launcher import role_command
from joynexus.ops.runtime.roles import DEPLOYMENT_ROLES
from joynexus.ops.runtime.threads import role_thread_env
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.jobs import GlobalLimits
from joynexus.schemas.workloads import Scheduling, WorkloadSpec
from joynexus.sdk import Client

ROLES = DEPLOYMENT_ROLES  # the same deployment `joynexus up` starts
RL_TASKS = (("acme", "PickCube-v1"), ("bolt", "PushCube-v1"), ("cora", "LIBERO-spatial-0"))
SFT_TENANT = "dana"
#: The SFT tenant's dataset, in its dataset space under datasets_root(out).
SFT_DATASET = "pick"


def datasets_root(out: Path) -> Path:
    """Where a run's tenants' datasets live: ``<out>/data/<tenant>/<name>``."""
    return out / "data"
PAPER = {"device_time_ratio": 1.39, "train_util_ratio": 1.99, "infer_util_ratio": 1.33}

#: The stream caps of the demo's namespaces (the embedded server's own, and one per
#: phase), unless the environment sets them: the layout's defaults reserve 9 GiB a
#: namespace on the server's store, and a demo's Training Queue holds megabytes (its
#: rollouts are 2 envs x 8 steps; SFT batches of 16 small frames).
DEMO_STREAM_CAPS = {TQ_MAX_BYTES_ENV: "1G", METRICS_MAX_BYTES_ENV: "512M"}


def use_demo_stream_caps(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Give this process (and the roles it starts, which inherit its environment) the
    demo's stream caps where the environment sets none; call it before the embedded
    server's auth sync makes its namespace's layout."""
    for name, value in DEMO_STREAM_CAPS.items():
        if not environ.get(name, "").strip():
            environ[name] = value


@dataclass
class PaperConfig:
    rl_updates: int = 10
    sft_updates: int = 20
    num_envs: int = 2
    horizon: int = 8
    action_horizon: int = 2
    sft_batch: int = 16
    sft_episodes: int = 4
    eval_episodes: int = 2
    max_policy_staleness: int = 2
    phase_timeout_s: float = 600.0
    #: Environment worker processes per RL tenant (its max_active_rollouts), the
    #: same in the shared run and the isolated baseline.
    workers: int = 1
    #: Shared/isolated pairs measured (the median ratio is the headline).
    repeat: int = 1
    #: The LIBERO tenant's envs per rollout: a LIBERO step (MuJoCo, one 64 px camera)
    #: costs about 2.5 ManiSkill steps on this CPU, so one env of ``horizon`` steps
    #: keeps its rollouts of the same order as the ManiSkill tenants' (num_envs each).
    libero_num_envs: int = 1
    #: LIBERO episodes end after this many steps here (the suites' own limits are
    #: 280-520, ManiSkill's 50): it bounds the final evaluation's time.
    libero_max_steps: int = 50
    #: After the shared run (outside every window), ``eval_points`` versions of each
    #: ManiSkill RL tenant (1: its start, its last, evenly between) are evaluated,
    #: ``eval_episodes`` episodes each (``eval_num_envs`` side by side), pinned: its
    #: learning curve; the LIBERO tenant's ``libero_eval_points`` (its return curve).
    eval_points: int = 3
    libero_eval_points: int = 2
    #: LIBERO's episodes per point: one env, every episode its full 50 steps for a
    #: head that never succeeds (sparse reward: return 0), ~7 s each here; 10 took
    #: 178 s for the first point.
    libero_eval_episodes: int = 4
    eval_num_envs: int = 5
    #: RL from a trained head: the policy's learning rate (the SFT's 1e-3 would
    #: undo it in a few updates).
    rl_learning_rate: float = 1e-4
    #: The starting heads' demonstrations and SFT updates, as a share of
    #: ``paper_heads.RECIPES`` (runs under 2 minutes make tiny heads).
    head_scale: float = 1.0
    #: Updates per tenant of the warm-up round each phase runs before its first
    #: measured window (0: none). A deployment's first workloads pay what later ones
    #: do not (each worker's first build of its tenant's env, the first train step and
    #: forward of each head kind, the inference engine's first batches): in the shared
    #: run's first round that made the window 15-20% longer than its later rounds'.
    #: Both phases run the same warm-up, all tenants at once, outside every window.
    warmup_updates: int = 2

    @classmethod
    def for_minutes(cls, minutes: float, *, repeat: int = 1) -> PaperConfig:
        """Scale the work with the time asked for (4 minutes: 10 RL updates per RL
        tenant and 20 SFT updates per pair; the fixed costs, starting two
        deployments and evaluating, add about two minutes here)."""
        k = max(0.04, minutes / 4.0)
        rl_updates = max(1, round(10 * k))
        return cls(
            rl_updates=rl_updates,
            # A learning curve of three points per RL tenant in runs of 2 minutes and more.
            eval_points=3 if minutes >= 2 else 2,
            sft_updates=max(2, round(20 * k)),
            eval_episodes=2 if minutes < 2 else 10,
            head_scale=1.0 if minutes >= 2 else 0.02,
            phase_timeout_s=max(600.0, 300.0 * minutes),
            repeat=max(1, repeat),
            warmup_updates=2 if minutes >= 2 else 1,
        )


@dataclass
class TenantPlan:
    tenant: str
    spec: WorkloadSpec
    updates: int


@dataclass
class PhaseResult:
    name: str
    wall_s: float = 0.0
    busy: dict[str, float] = field(default_factory=lambda: {"train": 0.0, "infer": 0.0})
    #: CPU seconds the services computed in the window (the busy intervals' wall time
    #: stretches when services share the CPU; this does not).
    compute: dict[str, float] = field(default_factory=lambda: {"train": 0.0, "infer": 0.0})
    intervals: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    peak_rss_mb: dict[str, float] = field(default_factory=lambda: {"train": 0.0, "infer": 0.0})
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    losses: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    #: Inference batches in the window: (distinct tenants, requests) each.
    batches: list[tuple[int, int]] = field(default_factory=list)
    #: Environment steps the workers took in the window.
    env_steps: int = 0
    #: Per RL tenant (base name): (duration s, steps) of every rollout begun in the window.
    rollouts: dict[str, list[tuple[float, int]]] = field(default_factory=lambda: defaultdict(list))
    #: CPU seconds every process of the deployment used in the windows (and by role).
    cpu_s: float = 0.0
    cpu_s_by_role: dict[str, float] = field(default_factory=dict)
    #: Each role's peak RSS and start-to-ready seconds; all processes' peak RSS together.
    roles: dict[str, dict[str, float | None]] = field(default_factory=dict)
    peak_rss_mb_total: float = 0.0
    #: The learning-curve evaluations after the windows: every process's RSS
    #: together at its peak, and the evaluator's.
    eval_peak_rss_mb_total: float = 0.0
    eval_peak_rss_mb_evaluator: float = 0.0
    eval_wall_s: float = 0.0

    def mean_tenants_per_batch(self) -> float | None:
        return (
            round(sum(t for t, _ in self.batches) / len(self.batches), 3) if self.batches else None
        )

    def util(self, service: str) -> float:
        return self.busy[service] / self.wall_s if self.wall_s else 0.0

    def compute_util(self, service: str) -> float:
        return self.compute[service] / self.wall_s if self.wall_s else 0.0


def round_tenant(tenant: str, r: int) -> str:
    """Round ``r``'s name of a tenant (every round of ``--repeat`` gets fresh tenants,
    so each round's policies, evaluations and figures are its own): acme, acme1, ..."""
    return tenant if r == 0 else f"{tenant}{r}"


def base_tenant(tenant: str) -> str:
    return tenant.rstrip("0123456789")


def warmup_round(cfg: PaperConfig) -> int:
    """The round index of the warm-up tenants (after the measured rounds' names)."""
    return cfg.repeat


def warmup_plans(cfg: PaperConfig, dataset: str) -> list[TenantPlan]:
    """The warm-up round: the measured rounds' workloads (the same builds, heads and
    datasets) with ``warmup_updates`` updates each, under tenants of their own."""
    if cfg.warmup_updates <= 0:
        return []
    small = replace(cfg, rl_updates=cfg.warmup_updates, sft_updates=cfg.warmup_updates)
    return plans(small, dataset, warmup_round(cfg))


def plans(cfg: PaperConfig, dataset: str, r: int = 0) -> list[TenantPlan]:
    """The tenants' workloads of round ``r``; ``dataset`` names the SFT tenant's
    dataset inside its dataset space (``<datasets root>/<SFT_TENANT>/<dataset>``).
    The ManiSkill RL tenants start from their task's SFT head (``paper_heads``:
    privileged state, as the demonstrations), its first updates critic-only."""
    out: list[TenantPlan] = []
    for base, env in RL_TASKS:
        tenant = round_tenant(base, r)
        from_head = env in RECIPES
        spec = WorkloadSpec(
            name="rl",
            task_type="rl",
            env=env,
            num_envs=cfg.libero_num_envs if env.startswith("LIBERO-") else cfg.num_envs,
            horizon=cfg.horizon,
            action_horizon=cfg.action_horizon,
            seed=len(out),
            scheduling=Scheduling(
                max_in_flight=max(2, cfg.workers + 1),
                max_active_rollouts=cfg.workers,
                max_policy_staleness=cfg.max_policy_staleness,
                completion_target=cfg.rl_updates,
            ),
        )
        if from_head:
            spec = msgspec.structs.replace(
                spec, init_from_export=init_path(env), state=["privileged"],
                learning_rate=cfg.rl_learning_rate, critic_warmup=max(1, cfg.rl_updates // 3),
            )
        out.append(TenantPlan(tenant, spec, cfg.rl_updates))
    spec = WorkloadSpec(
        name="sft",
        task_type="sft",
        dataset=dataset,
        batch_size=cfg.sft_batch,
        action_horizon=cfg.action_horizon,
        scheduling=Scheduling(max_in_flight=16, completion_target=cfg.sft_updates),
    )
    out.append(TenantPlan(round_tenant(SFT_TENANT, r), spec, cfg.sft_updates))
    return out


class RoleProcesses:
    """One process per role on ``namespace``; RSS of the two services polled."""

    def __init__(
        self, url: str, namespace: str, out: Path, *, env_workers: int = 3, libero_max_steps: int = 50
    ) -> None:
        self.url, self.namespace, self.out = url, namespace, out
        self.libero_max_steps = libero_max_steps
        #: Warm environment workers (the RL tenants' workers of one window), started
        #: with the deployment so that no window pays a worker's start-up.
        self.env_workers = env_workers
        #: The env each worker warms, one per RL tenant's worker (WARM_ENV, in turn):
        #: each worker holds one simulator kind, not all.
        self.warm_envs = tuple(env for _, env in RL_TASKS)
        self.roles: tuple[str, ...] = ROLES
        #: The tenants' dataset spaces (<root>/<tenant>), given to the control role.
        self.datasets = datasets_root(out)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.peak_rss_mb = {"train": 0.0, "infer": 0.0}
        #: Peak RSS per role (env-worker: the largest worker), and of every process
        #: of the deployment together (its roles and their env workers).
        self.role_rss_mb: dict[str, float] = {}
        self.peak_rss_mb_total = 0.0
        #: Seconds from a role's process start to its first heartbeat (it beats once
        #: its imports are done and it runs).
        self.ready_s: dict[str, float] = {}
        self.started_at = 0.0
        #: CPU seconds each role used in each measured window, in order.
        self.window_cpu_s: list[dict[str, float]] = []
        self._logs: list[Any] = []
        self.creds: dict[str, Credentials] = {}

    async def tenant(self, b: Broker, tenant: str) -> Client:
        """A client of ``tenant`` with credentials the operator (this process) issues."""
        if tenant not in self.creds:
            self.creds[tenant], _ = await add_tenant(b, tenant, url=self.url)
        return await Client.connect(credentials=self.creds[tenant])

    def start(self) -> None:
        self.started_at = time.time()
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for role in self.roles:
            log = open(logs / f"{self.namespace}-{role}.log", "wb")
            self._logs.append(log)
            cmd = role_command(
                role,
                self.url,
                self.namespace,
                instance=f"{role}-0",
                out_dir=self.out / "checkpoints" / self.namespace,
            )
            cmd += ["--data-dir", str(self.out)]  # argparse: the last one wins
            self.procs[role] = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    **role_thread_env(role),  # the cores shared on purpose
                    **role_env(role),
                    DATASETS_ENV: str(self.datasets.resolve()),
                    "PYTHONUNBUFFERED": "1",
                    "JOYNEXUS_ENV_SPARES": str(self.env_workers),
                    "JOYNEXUS_ENV_WORKERS_MAX": str(self.env_workers),
                    "JOYNEXUS_LIBERO_MAX_STEPS": str(self.libero_max_steps),
                    # Each worker builds and resets its tenant's kind of env before it
                    # is ready: LIBERO's first env costs ~40 s here, which held the
                    # LIBERO tenant back 21-68 s into the shared window.
                    WARM_ENV: ",".join(self.warm_envs),
                    SFT_WARM_ENV: "1",  # the SFT tenant's dataset reader loaded, too
                },
                preexec_fn=die_with_parent,
            )

    def processes(self) -> dict[str, list[psutil.Process]]:
        """The live processes of each role; env workers (producer-rl's children) as
        role ``env-worker``."""
        out: dict[str, list[psutil.Process]] = defaultdict(list)
        for role, p in self.procs.items():
            if p.poll() is not None:
                continue
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(p.pid)
                out[role].append(proc)
                if role == "producer-rl":
                    out["env-worker"] += proc.children(recursive=True)
        return out

    def rss_mb(self) -> dict[str, list[float]]:
        """Each role's processes' RSS now (MiB)."""
        out: dict[str, list[float]] = defaultdict(list)
        for role, procs in self.processes().items():
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    out[role].append(proc.memory_info().rss / 2**20)
        return out

    def poll_rss(self) -> None:
        total = 0.0
        for role, sizes in self.rss_mb().items():
            for rss in sizes:
                total += rss
                self.role_rss_mb[role] = max(self.role_rss_mb.get(role, 0.0), rss)
                service = {"actor": "train", "inference": "infer"}.get(role)
                if service:
                    self.peak_rss_mb[service] = max(self.peak_rss_mb[service], rss)
        self.peak_rss_mb_total = max(self.peak_rss_mb_total, total)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each role's processes used so far."""
        out: dict[str, float] = defaultdict(float)
        for role, procs in self.processes().items():
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    out[role] += t.user + t.system
        return out

    def check_alive(self) -> None:
        for role, p in self.procs.items():
            if p.poll() is not None:
                raise JoyNexusError(
                    f"role {role} exited with {p.returncode}; see {self.out / 'logs'}/{self.namespace}-{role}.log"
                )

    def stop_role(self, role: str, timeout_s: float = 30.0) -> None:
        """Stop one role's process (and its children) for good, before the rest; it
        is no longer checked, measured or stopped with them."""
        p = self.procs.pop(role, None)
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self._logs:
            log.close()


async def wait_ready(b: Broker, dep: RoleProcesses, timeout_s: float = 300.0) -> None:
    """Until the scheduler, the control plane and an inference engine answer and
    both producers are warm (they announce it with a ``ready`` system metric)."""
    ready: set[str] = set()

    async def on_metric(msg: Any) -> None:
        with contextlib.suppress(Exception):
            m = orjson.loads(msg.data)
            if m.get("ready"):
                ready.add(m.get("service", ""))

    sub = await b.nc.subscribe(b.names.metrics("system"), cb=on_metric)
    health = await b.js.key_value(b.names.health_bucket)

    async def beats() -> None:  # each role's first heartbeat: its start-to-ready time
        if not dep.started_at or set(dep.procs) <= set(dep.ready_s):
            return  # every role seen: no more reads of the bucket's keys
        with contextlib.suppress(Exception):
            for key in await kvwatch.keys(health):
                role = key.split(".")[1] if key.startswith(HEARTBEAT_KEYS) else ""
                if role in dep.procs and role not in dep.ready_s:
                    dep.ready_s[role] = round(time.time() - dep.started_at, 2)

    try:
        await SchedulerClient(b, by="paper", call_timeout_s=2, deadline_s=timeout_s).snapshot()
        deadline = time.monotonic() + timeout_s
        pending = {b.names.control_service, b.names.inference_service,
                   b.names.policy_init_service}
        producers = {r for r in dep.roles if r.startswith("producer-")}
        while pending or not producers <= ready:
            dep.check_alive()
            if time.monotonic() > deadline:
                raise JoyNexusError(
                    f"the deployment is not up after {timeout_s:.0f}s (waiting for "
                    f"{sorted(pending) or 'warm producers'}); see the role logs"
                )
            for service in list(pending):
                with contextlib.suppress(Exception):
                    await b.nc.request(service_api("PING", service), b"", timeout=1)
                    pending.discard(service)
            await beats()
            dep.poll_rss()
            await asyncio.sleep(0.5)
        await beats()
    finally:
        await sub.unsubscribe()


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


async def _metrics(b: Broker) -> list[dict[str, Any]]:
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


def _account(
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


def _write_event_log(
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
        metrics = await _metrics(b)
        for r, tenants in enumerate(rounds):
            _account(results[r], metrics, windows[r], {p.tenant for p in tenants})
        jobs = [
            {"at": s.event.at, "tenant": s.event.job.tenant_id, "job": s.event.job.job_id,
             "task_type": s.event.job.task_type, "state": s.event.job.state.value,
             "reason": s.event.job.reason}
            async for s in JobEventLog(b)._read(b.names.all_jobs, DeliverPolicy.ALL)
        ]
        _write_event_log(out, name, metrics + jobs, rounds, windows, isolated=isolated)
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


def env_kind_of(env: str) -> str:
    return "libero" if env.startswith("LIBERO-") else "maniskill"


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


NOTES = [
    "Device time: a run holds a training device and an inference device from its first "
    "workload to its last update, so device time = 2 x wall time of the measured windows "
    "(the isolated baseline: the windows of its tenants, one after another, added up). On "
    "this CPU machine the devices are the CPU cores: every service and every environment "
    "worker shares them, and no accelerator sits idle or busy; 'device time' is the wall "
    "time the two services would hold their devices for the same work.",
    "What the ratio shows: how much sooner the same work (the same updates per tenant, the "
    "same environment workers per tenant, the same per-step settings) finishes when the "
    "tenants share one deployment than one after another, so how much less time the "
    "services' devices are held. It does not show an accelerator's utilization: on a "
    "2-core machine the gain comes mostly from overlapping the tenants' simulators with "
    "each other and with training and inference on both cores, which one tenant alone "
    "leaves partly idle while its simulator, its inference request or its training step "
    "waits for the others; a machine with accelerators overlaps different resources.",
    "Start-up is in neither run: both start measuring once every role is up and warm "
    "(backbones built, the environment workers' renderers started) and a warm-up round "
    "(every tenant's workload with a few updates, all at once) has run in its "
    "deployment, so the first measured window pays no first env build, first train "
    "step or first batch that the later ones do not; --repeat N measures N pairs and "
    "reports the median.",
]


async def run_paper(
    url: str, out: Path, cfg: PaperConfig, *, progress: bool = True
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    dataset = datasets_root(out) / SFT_TENANT / SFT_DATASET
    if not (dataset / "meta" / "info.json").exists():
        from joynexus.agents.envs.lerobot_data import generate_dataset

        if progress:
            print(
                f"  generating {cfg.sft_episodes} expert demonstrations (LeRobot format) ...",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.to_thread(
            generate_dataset,
            "PickCube-v1",
            dataset,
            episodes=cfg.sft_episodes,
            obs="rgb",
            image_size=64,
            seed=0,
        )
    rounds = [plans(cfg, SFT_DATASET, r) for r in range(cfg.repeat)]
    warmup = warmup_plans(cfg, SFT_DATASET)
    # The RL tenants' starting heads (made once, then cached), outside both windows.
    heads = await prepare_heads(
        url, out, cfg,
        {p.tenant: p.spec.env for ps in [*rounds, warmup] for p in ps
         if p.spec.init_from_export},
        progress=progress,
    )
    # Each later round's SFT tenant, and the warm-up's, has the dataset in its space.
    for r in [*range(1, cfg.repeat), *([warmup_round(cfg)] if warmup else [])]:
        copy = datasets_root(out) / round_tenant(SFT_TENANT, r) / SFT_DATASET
        if not (copy / "meta" / "info.json").exists():
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(dataset, copy)
    shared = await run_phase(
        url, out, "shared", rounds, isolated=False, cfg=cfg, progress=progress, warmup=warmup
    )
    isolated = await run_phase(
        url, out, "isolated", rounds, isolated=True, cfg=cfg, progress=progress, warmup=warmup
    )
    pairs = [summarize(sh, iso) for sh, iso in zip(shared, isolated, strict=True)]
    ratios = [p["device_time_ratio"] for p in pairs]
    # The details of the median pair (the lower middle one for an even N).
    order = sorted(range(len(pairs)), key=lambda i: ratios[i] or 0.0)
    mid = order[(len(order) - 1) // 2]
    results = pairs[mid]
    results["device_time_ratios"] = ratios
    results["device_time_ratio"] = round(statistics.median(r or 0.0 for r in ratios), 3)
    results["mean_tenants_per_batch_per_repeat"] = [p["mean_tenants_per_batch"] for p in pairs]
    results["median_repeat"] = mid + 1
    # Outcomes and evaluations come from the first pair (only it is evaluated).
    results["tenants"] = pairs[0]["tenants"]
    results["config"] = asdict(cfg)
    results["starting_heads"] = heads
    results["warmup"] = {"updates_per_tenant": cfg.warmup_updates,
                         "tenants": [p.tenant for p in warmup]}
    results["notes"] = NOTES
    results["peak_rss_mb_total"] = max(results["shared"]["peak_rss_mb_total"],
                                       results["isolated"]["peak_rss_mb_total"])
    results["roles"] = results["shared"]["roles"]
    results["evaluations"] = {  # the learning curves, after the windows
        "peak_rss_mb_total": shared[0].eval_peak_rss_mb_total,
        "peak_rss_mb_evaluator": shared[0].eval_peak_rss_mb_evaluator,
        "wall_s": shared[0].eval_wall_s,
    }
    results["planner"] = planner_prediction(out)
    results["limits"] = limits_sentence(results)
    if progress:
        print(
            "  measuring the shared-forward speedup grid (Figure 10) ...",
            file=sys.stderr,
            flush=True,
        )
    from joynexus.ops.bench.group import bench_group

    grid = await asyncio.to_thread(bench_group, quick=True, rss=False)
    results["group_speedup"] = grid["group_speedup"]
    results["loss_curves"] = {
        t: {
            "grouped (shared run)": shared[0].losses.get(t, []),
            "serial (isolated run)": isolated[0].losses.get(t, []),
        }
        for t in shared[0].tenants
    }
    def lanes(r: PhaseResult) -> dict[str, list[tuple[float, float]]]:
        # The services first, then one lane per environment worker.
        return dict(sorted(r.intervals.items(), key=lambda kv: (kv[0].startswith("env "), kv[0])))

    results["timelines"] = {"shared": lanes(shared[mid]), "isolated": lanes(isolated[mid])}
    (out / "report.json").write_text(json.dumps(results, indent=2))
    return results


def planner_prediction(out: Path) -> dict[str, Any]:
    """What the capacity planner (``joynexus plan --from-run``) predicts for this run's
    windows from its own event log: the ratio, and the shared window with the
    isolated run's costs (no contention for the cores: what overlapping alone gives)."""
    try:
        from joynexus.ops.plan.planner import plan_from_run

        p = plan_from_run(out)
    except Exception as e:  # the report goes on without it
        return {"error": f"{type(e).__name__}: {e}"}
    iso = p["predicted"]["isolated_wall_s"]
    free = p.get("shared_wall_s_with_isolated_costs")
    return {
        "device_time_ratio": p["predicted"]["device_time_ratio"],
        "error": p["error"],
        "uncontended_device_time_ratio": round(iso / free, 3) if iso and free else None,
    }


def limits_sentence(results: dict[str, Any]) -> str:
    """What limits the ratio here, in a sentence a reader understands."""
    b = results.get("cores_bound") or {}
    pl = results.get("planner") or {}
    bits = [f"Measured {results.get('device_time_ratio')}x"]
    if pl.get("device_time_ratio") is not None:
        bits.append(f"the planner predicts {pl['device_time_ratio']}x for this run from its "
                    "own event log")
    if pl.get("uncontended_device_time_ratio") is not None:
        bits.append(f"{pl['uncontended_device_time_ratio']}x if the shared run's steps cost "
                    "what they cost alone (overlap without contention for the cores)")
    text = "; ".join(bits) + "."
    if b.get("max_device_time_ratio") is not None:
        text += (
            f" The {b['cores']} cores bound it: the shared run spent {b['shared_cpu_s']} CPU s "
            f"(the isolated run {b['isolated_cpu_s']}), which {b['cores']} cores cannot run in "
            f"less than {b['shared_floor_wall_s']} s, so with that much CPU sharing saves at "
            f"most {b['max_device_time_ratio']}x; the shared run kept the cores "
            f"{_as_percent(b.get('shared_core_utilization'))} busy (isolated "
            f"{_as_percent(b.get('isolated_core_utilization'))}), so past that the same work "
            "must cost fewer CPU seconds: its simulators ran slower side by side than alone "
            "(they, inference and training took the same cores from each other)."
        )
    return text


def _as_percent(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def print_summary(results: dict[str, Any], out: Path) -> None:
    sh, iso = results["shared"], results["isolated"]
    print(f"\nJoyNexus main job: the paper's mixed workload (report: {out / 'report.md'})\n")
    rows = [
        ("wall time (s)", sh["wall_s"], iso["wall_s"], ""),
        (
            "device time (s, 2 services)",
            sh["device_time_s"],
            iso["device_time_s"],
            f"{results['device_time_ratio']}x less (paper 1.39x)",
        ),
        ("training busy (s)", sh["busy_s"]["train"], iso["busy_s"]["train"], ""),
        ("inference busy (s)", sh["busy_s"]["infer"], iso["busy_s"]["infer"], ""),
        (
            "training utilization",
            sh["utilization"]["train"],
            iso["utilization"]["train"],
            f"{results['train_util_ratio']}x (paper 1.99x)",
        ),
        (
            "inference utilization",
            sh["utilization"]["infer"],
            iso["utilization"]["infer"],
            f"{results['infer_util_ratio']}x (paper 1.33x)",
        ),
        (
            "training compute (CPU s)",
            sh["compute_s"]["train"],
            iso["compute_s"]["train"],
            f"utilization {results['train_compute_util_ratio']}x",
        ),
        (
            "inference compute (CPU s)",
            sh["compute_s"]["infer"],
            iso["compute_s"]["infer"],
            f"utilization {results['infer_compute_util_ratio']}x",
        ),
        ("training peak RSS (MB)", sh["peak_rss_mb"]["train"], iso["peak_rss_mb"]["train"], ""),
        ("inference peak RSS (MB)", sh["peak_rss_mb"]["infer"], iso["peak_rss_mb"]["infer"], ""),
    ]
    rows += [
        ("env steps/s (all workers)", sh.get("env_steps_per_s"), iso.get("env_steps_per_s"), ""),
        *(
            (f"  {kind} steps/s in rollouts", v, iso.get("env_steps_per_s_by_kind", {}).get(kind), "")
            for kind, v in sh.get("env_steps_per_s_by_kind", {}).items()
        ),
        (
            "tenants per inference batch",
            sh.get("mean_tenants_per_batch"),
            iso.get("mean_tenants_per_batch"),
            "",
        ),
    ]
    print(f"  {'':30} {'shared':>10} {'isolated':>10}  ratio")
    for name, a, b, r in rows:
        print(f"  {name:30} {a!s:>10} {b!s:>10}  {r}")
    if results.get("limits"):
        print(f"\n  What limits the ratio here: {results['limits']}")
    if len(results.get("device_time_ratios", [])) > 1:
        print(
            f"\n  device_time_ratio per repeat: {results['device_time_ratios']} "
            f"(median {results['device_time_ratio']})"
        )
    print(
        f"\n  {'tenant':8} {'task':5} {'env or dataset':17} {'updates':>7} {'version':>7} "
        f"{'stale':>5} {'failed':>6} {'eval':>5} {'rollout s':>9}"
    )
    rolls = sh.get("rollouts_by_tenant", {})
    for t, v in results["tenants"].items():
        ev = "-" if v["eval_success"] is None else f"{v['eval_success']:.2f}"
        roll = rolls.get(t, {}).get("mean_rollout_s", "-")
        print(
            f"  {t:8} {v['task_type']:5} {v.get('env_or_dataset', ''):17} {v['updates']:>7} "
            f"{v['final_version']:>7} {v['dropped_stale']:>5} {v['failed']:>6} {ev:>5} {roll!s:>9}"
        )
    curves = {t: v["eval_history"] for t, v in results["tenants"].items() if v.get("eval_history")}
    if curves:
        print("\n  learning curves (pinned versions, after the windows; success [95% interval], return)")
        for t, history in curves.items():
            start = results["tenants"][t].get("starts_from", "")
            points = "  ".join(
                f"v{h['version']} {h['success_rate']:.2f} [{h['success_ci95'][0]:.2f}, "
                f"{h['success_ci95'][1]:.2f}] {h.get('mean_return') or 0:.1f}"
                for h in history
            )
            print(f"  {t:8} ({start}) {points}")
    evals = results.get("evaluations") or {}
    if evals:
        print(f"  evaluations took {evals.get('wall_s')} s; peak RSS of all processes meanwhile "
              f"{evals.get('peak_rss_mb_total')} MB (evaluator {evals.get('peak_rss_mb_evaluator')} MB)")


async def main_job(
    url: str, out: Path, *, minutes: float = 4.0, as_json: bool = False, repeat: int = 1
) -> int:
    cfg = PaperConfig.for_minutes(minutes, repeat=repeat)
    results = await run_paper(url, out, cfg, progress=not as_json)
    with contextlib.suppress(ImportError):
        from joynexus.ops.report import write_paper_report

        write_paper_report(out, results)
    if as_json:
        print(
            json.dumps(
                {k: v for k, v in results.items() if k not in ("timelines", "loss_curves")},
                indent=2,
            )
        )
    else:
        print_summary(results, out)
    return 0
