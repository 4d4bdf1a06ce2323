"""The main job's deployment: one process per role on a phase's namespace
(:class:`RoleProcesses`, the same roles `joynexus up` starts), their RSS and CPU
seconds polled, and :func:`wait_ready` until every role serves.

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import psutil

from joynexus.agents.datasets import DATASETS_ENV
from joynexus.agents.envworkers.assign import WARM_ENV
from joynexus.agents.procs import dying_with_parent
from joynexus.agents.producers.supervisor import SFT_WARM_ENV
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.broker.natsapi import service_api
from joynexus.broker.subjects import HEARTBEAT_KEYS
from joynexus.ops.admin.tenants import add_tenant
from joynexus.ops.mainjob.config import RL_TASKS, ROLES, datasets_root
from joynexus.ops.runtime.children import stop_all
from joynexus.ops.runtime.deploy import role_env
from joynexus.ops.runtime.launcher import role_command
from joynexus.ops.runtime.threads import role_thread_env
from joynexus.schemas.errors import JoyNexusError
from joynexus.sdk import Client


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
            argv, preexec = dying_with_parent(cmd)
            self.procs[role] = subprocess.Popen(
                argv,
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
                preexec_fn=preexec,
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
        stop_all(self.procs.values())
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
