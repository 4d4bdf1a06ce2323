"""Several "hosts" sharing one deployment on a loopback nats cluster
(:class:`HostsRig`): each host a ``joynexus up`` process with its own supervisor,
roles and data directory, killed whole by the host-loss drills
(ops/bench/faults.py, ops/bench/customfaults.py), and their settings
(``HOSTS_ENV``: short leases, so a lost host is noticed in seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.layout import LayoutOptions, ensure_layout
from joynexus.ops.bench.faultrig import TENANTS, FaultRig, wait_until

__all__ = ["HOSTS_ENV", "HostsRig"]


def _spawn_logged(cmd: list[str], log_path: Path, env: dict[str, str]) -> Any:
    import subprocess

    with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


class HostsRig(FaultRig):
    """Several "hosts" sharing one deployment on a loopback cluster: each host is a
    ``joynexus up --nats <its node> --host-id H --roles ...`` process (its own
    supervisor, roles and data directory; no disk in common), the synthetic
    producers run here, connected to the nodes that survive."""

    def __init__(
        self,
        namespace: str,
        hosts: dict[str, tuple[str, list[str]]],
        *,
        rig_urls: list[str],
        work: Path,
        env: dict[str, str] | None = None,
        tenants: tuple[tuple[str, str], ...] = TENANTS,
    ) -> None:
        super().__init__(rig_urls[0], namespace, [], out_dir=work, env=env, tenants=tenants)
        self.hosts = hosts  # host -> (its node's URL, its roles), started in this order
        self.rig_urls = rig_urls
        self.work = work
        self.procs: dict[str, Any] = {}

    async def start(self) -> None:
        self.b = await Broker.connect(self.rig_urls, name="hosts-rig", namespace=self.namespace)

        async def layout_ready() -> bool:
            try:
                replicas = int(self.env.get("JOYNEXUS_REPLICAS", "1"))
                await ensure_layout(self.b, LayoutOptions(tq_ttl_s=600, replicas=replicas))
                return True
            except Exception:  # no JetStream meta leader yet
                return False

        await wait_until(layout_ready, 90, "the layout on the cluster", every=0.5)
        self.sched = SchedulerClient(self.b, by="hosts-rig", call_timeout_s=2.0, deadline_s=90)
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        for host, (url, roles) in self.hosts.items():
            d = self.work / f"host-{host}"
            d.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "joynexus.ops.cli", "up", "--nats", url,
                   "--namespace", self.namespace, "--host-id", host, "--roles", ",".join(roles),
                   "--data-dir", str(d)]
            self.procs[host] = await asyncio.to_thread(_spawn_logged, cmd, d / "up.log", env)

            async def beating(host: str = host, roles: list[str] = roles) -> bool:
                state = await self.supervisor(host)
                return state is not None and sum(
                    1 for x in state.slots if x.state == "running"
                ) == len(roles)

            await wait_until(beating, 300, f"host {host}'s roles running", every=0.5)
            if "scheduler" in roles and host == next(iter(self.hosts)):
                await wait_until(
                    partial(self.lease_holder, f"{host}/"), 60, f"host {host} holding the lease"
                )

    async def supervisor(self, host: str) -> Any:
        import msgspec

        from joynexus.agents.health import SupervisorState

        kv = await self.b.js.key_value(self.b.names.health_bucket)
        try:
            entry = await kv.get(f"mgr.health-{host}")
        except Exception:
            return None
        if not entry.value:
            return None
        return msgspec.json.decode(entry.value, type=SupervisorState)

    async def lease_holder(self, prefix: str = "") -> str | None:
        from joynexus.agents.leases import RoleLease

        try:
            rec, _ = await RoleLease(self.b, "scheduler", "hosts-rig").current()
        except Exception:  # the bucket's stream is electing a new leader (a node died)
            return None
        if rec is None or not rec.holder.startswith(prefix):
            return None
        return rec.holder

    async def kill_host(self, host: str) -> list[int]:
        """SIGKILL the host's supervisor and every role process it runs, at once."""
        state = await self.supervisor(host)
        pids = [self.procs[host].pid] + [x.pid for x in (state.slots if state else []) if x.pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    async def close(self, *, delete: bool = True) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                await asyncio.to_thread(p.wait, 30)
            except Exception:
                p.kill()
        await super().close(delete=delete)


HOSTS_ENV = {
    **{"JOYNEXUS_ACK_WAIT_S": "3", "JOYNEXUS_SYNTHETIC_WORK_S": "0.3"},
    "JOYNEXUS_HEARTBEAT_S": "0.5",
    "JOYNEXUS_LEASE_TTL_S": "3",  # the scheduler lease: how long a lost host holds it
    "JOYNEXUS_JOB_LEASE_TTL_S": "3",  # actor/stage leases: how long its jobs stay held
    "JOYNEXUS_REPLICAS": "3",
}
