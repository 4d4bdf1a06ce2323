"""The isolation deployment's agents as processes of their own, as `joynexus up` runs them.

In a production deployment every role is its own OS process (one event loop,
one interpreter lock each); the attack catalogue's default deployment runs the
agents in the bench's own process, which is quick to start and lets an attack
reach inside, but makes the victim's probe, the control plane, the inference
engine and the actor's training take turns on one event loop and one lock: a
victim's latency then measures that contention more than the service's
fairness. :class:`AgentProcesses` starts the scheduler, the control plane, one
inference engine and the actor with ``python -m joynexus.ops.cli agent <role>``
(the launcher's command), restarts the actor when it dies and counts that (what
the health manager does, and what the data attacks check), and counts the
bytes the roles log (what the long-strings attack checks).
See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import IO

from joynexus.agents.datasets import DATASETS_ENV
from joynexus.agents.procs import dying_with_parent
from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.broker.natsapi import service_api
from joynexus.ops.isolation.gateway import GATEWAY_ENV, free_port, wait_healthy
from joynexus.ops.runtime.children import stop_all
from joynexus.ops.runtime.launcher import role_command
from joynexus.ops.runtime.threads import role_thread_env
from joynexus.schemas.inference import DEFAULT_MAX_ROWS

#: The roles an attack meets, in start order (the scheduler first: others call it).
ROLES = ("scheduler", "control", "inference", "actor", "gateway")
#: Those with a request server that says when the role serves (the gateway says it
#: over HTTP: ``gateway.healthy``).
ANSWERING = frozenset(ROLES) - {"gateway"}
#: How long the roles may take to start answering (imports of torch on 2 cores).
START_S = 180.0


async def answers(b: Broker, role: str) -> bool:
    """Whether ``role`` serves: the scheduler's snapshot, or a PING of the control
    plane, an inference engine or the actor's policy initialisation."""
    from joynexus.agents.scheduler_client import SchedulerClient

    services = {"control": b.names.control_service, "inference": b.names.inference_service,
                "actor": b.names.policy_init_service}
    try:
        if role == "scheduler":
            await SchedulerClient(b, by="iso", call_timeout_s=1.0, deadline_s=1.0).snapshot()
        else:
            await b.nc.request(service_api("PING", services[role]), b"", timeout=1.0)
    except Exception:
        return False
    return True


class AgentProcesses:
    """The scheduler, control plane, an inference engine and the actor, one process each,
    under ``data``; the actor restarted whenever it exits (counted in ``restarts``)."""

    def __init__(
        self, url: str, namespace: str, data: Path, *, service: Credentials,
        control: Credentials, datasets_root: Path, lease_ttl_s: float = 10.0,
        max_batch: int = 8, max_wait_ms: float = 5.0, roles: tuple[str, ...] = ROLES,
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        self.roles = roles
        self.url, self.namespace, self.data = url, namespace, data
        self.datasets_root = datasets_root
        self.lease_ttl_s, self.max_batch, self.max_wait_ms = lease_ttl_s, max_batch, max_wait_ms
        self.max_rows = max_rows
        self.logs = data / "logs"
        self.creds = {
            "service": service.save(data / "agent-creds" / "service.json"),
            "control": control.save(data / "agent-creds" / "control.json"),
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        #: The gateway's port (0: no gateway among the roles).
        self.gateway_port = free_port() if "gateway" in roles else 0
        self._files: list[IO[bytes]] = []
        self.restarts = 0
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None

    def command(self, role: str) -> list[str]:
        extra = ["--creds", str(self.creds["control" if role == "control" else "service"])]
        if role == "scheduler":
            extra += ["--lease-ttl", str(self.lease_ttl_s)]
        if role == "inference":
            extra += ["--max-batch", str(self.max_batch), "--max-wait-ms", str(self.max_wait_ms),
                      "--max-rows", str(self.max_rows)]
        if role == "control":
            extra += ["--datasets", str(self.datasets_root)]
        if role == "gateway":
            extra += ["--port", str(self.gateway_port)]
        return role_command(role, self.url, self.namespace, instance=f"{role}-0",
                            out_dir=self.data / "actor", extra=extra)

    def spawn(self, role: str) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = open(self.logs / f"{role}.log", "ab")
        self._files.append(log)
        argv, preexec = dying_with_parent(self.command(role))
        self.procs[role] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **role_thread_env(role), DATASETS_ENV: str(self.datasets_root),
                 "PYTHONUNBUFFERED": "1", **(GATEWAY_ENV if role == "gateway" else {})},
            preexec_fn=preexec,
        )

    async def start(self, b: Broker) -> None:
        """Start every role and wait until each serves (``b``: a service connection)."""
        for role in self.roles:
            self.spawn(role)
        deadline = time.monotonic() + START_S
        waiting = set(self.roles) & ANSWERING
        while waiting:
            waiting -= {role for role in list(waiting) if await answers(b, role)}
            if not waiting:
                break
            for role, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"agent {role} exited with {p.returncode} while starting: "
                                       f"{self.tail(role)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(sorted(waiting))} did not serve within "
                                   f"{START_S:.0f}s (logs under {self.logs})")
            await asyncio.sleep(0.5)
        if self.gateway_port:
            gw = self.procs["gateway"]
            await wait_healthy(self.gateway_port, max(5.0, deadline - time.monotonic()),
                               alive=lambda: gw.poll() is None)
        self._watch = asyncio.create_task(self._supervise())

    def tail(self, role: str, chars: int = 600) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / f"{role}.log").read_bytes()[-chars:].decode("utf-8", "replace")
        return ""

    async def _supervise(self) -> None:
        """The actor started again whenever it exits (the health manager's in-place
        restart); any other role's exit is recorded (an attack must not cause one)."""
        while not self._stop.is_set():
            for role, p in list(self.procs.items()):
                if p.poll() is None:
                    continue
                self.errors.append(f"{role} exited {p.returncode}: {self.tail(role, 300)}")
                if role == "actor":
                    self.restarts += 1
                self.spawn(role)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.5)

    @property
    def log_bytes(self) -> int:
        """Bytes the roles have logged so far."""
        total = 0
        for role in self.procs:
            with contextlib.suppress(OSError):
                total += (self.logs / f"{role}.log").stat().st_size
        return total

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            await self._watch
        await asyncio.to_thread(stop_all, list(self.procs.values()))
        for f in self._files:
            f.close()


__all__ = ["ANSWERING", "ROLES", "START_S", "AgentProcesses", "answers"]
