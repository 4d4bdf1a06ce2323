"""The fault benchmark's rig: real role processes under an in-process health
manager, fed by synthetic producers (:class:`FaultRig`), the :class:`Fault` s it
injects once a victim holds work, and the :func:`audit` of the job log and the
Training Queue after (jobs lost, doubled, partitions leaked).

ops/bench/faults.py runs the benchmark on it; ``tests/system/test_chaos.py`` uses
it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import ServiceUnavailableError

from joynexus.agents.health import HealthCore, HealthManager, RestartBudget
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.agents.synthetic import SyntheticPipeline
from joynexus.broker.connection import Broker
from joynexus.broker.layout import LayoutOptions, delete_layout, ensure_layout
from joynexus.broker.subjects import is_workload_end, parse_job_subject
from joynexus.broker.tq import TrainingQueue
from joynexus.ops.runtime.launcher import role_slots
from joynexus.schemas.jobs import GlobalLimits, JobState, TrainingJob, WorkloadPolicy

TERMINAL = {"completed", "dropped", "failed"}
#: (tenant, task type) fed by the synthetic producers.
TENANTS = (("acme", "rl"), ("cora", "sft"))


@dataclass
class Audit:
    jobs: int = 0
    states: Counter[str] = field(default_factory=Counter)
    doubled: list[str] = field(default_factory=list)
    nonterminal: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    releases: int = 0
    completed_by_tenant: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "final_states": dict(self.states),
            "jobs_lost": len(self.nonterminal),
            "jobs_doubled": len(self.doubled),
            "partitions_leaked": len(self.leaked),
            "releases": self.releases,
        }


async def read_job_subjects(b: Broker) -> dict[tuple[str, str], list[str]]:
    """(tenant, job) -> the states of its events, in log order (every event, not the last)."""
    sub = await b.js.pull_subscribe(
        b.names.all_jobs,
        stream=b.names.jobs_stream,
        config=ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
            headers_only=True,
        ),
    )
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    try:
        while True:
            try:
                msgs = await sub.fetch(512, timeout=1.0)
            except TimeoutError:
                break
            for m in msgs:
                if is_workload_end(m.subject):
                    continue  # a workload's end (done, cancelled), not a job's event
                tenant, job, state = parse_job_subject(m.subject)
                out[(tenant, job)].append(state)
            if msgs and msgs[-1].metadata.num_pending == 0:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out


#: Audits tried before a JetStream "service unavailable" (503) is an error.
AUDIT_ATTEMPTS = 20


async def audit(b: Broker) -> Audit:
    """Every job once through the log; partitions that outlived their job. In a
    cluster that just lost a node, a stream's leader is elected again and JetStream
    answers 503 meanwhile (a CI run's host-lost drill failed on one): the audit starts
    over, up to ``AUDIT_ATTEMPTS`` times, 0.5 s apart."""
    for attempt in range(AUDIT_ATTEMPTS):
        try:
            return await _audit(b)
        except ServiceUnavailableError:
            if attempt == AUDIT_ATTEMPTS - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def _audit(b: Broker) -> Audit:
    a = Audit()
    jobs = await read_job_subjects(b)
    final: dict[str, str] = {}
    for (tenant, job), states in jobs.items():
        a.jobs += 1
        last = states[-1]
        final[job] = last
        a.states[last] += 1
        if states.count("completed") > 1:
            a.doubled.append(job)
        if last not in TERMINAL:
            a.nonterminal.append(f"{tenant}/{job}:{last}")
        if last == "completed":
            a.completed_by_tenant[tenant] += 1
        a.releases += max(0, states.count("leased") - 1)
        a.releases += max(0, states.count("computing_advantages") - 1)
    for tenant, partition in await TrainingQueue(b).list_partitions():
        if final.get(partition) in TERMINAL:
            a.leaked.append(f"{tenant}/{partition}")
    return a


async def wait_until(
    pred: Callable[[], Awaitable[Any]], within: float, what: str, every: float = 0.1
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        got = await pred()
        if got:
            return got
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(every)


@dataclass
class Fault:
    name: str
    instance: str
    sig: int = signal.SIGKILL
    #: Which job shows that the victim holds work right now (None: any time).
    holds: Callable[[TrainingJob], bool] | None = None


class FaultRig:
    """Role processes under an in-process health manager, plus synthetic producers."""

    def __init__(
        self,
        url: str,
        namespace: str,
        roles: list[str],
        *,
        out_dir: Path,
        extra: dict[str, list[str]] | None = None,
        env: dict[str, str] | None = None,
        heartbeat_s: float = 0.5,
        log_dir: Path | None = None,
        budget: RestartBudget | None = None,
        tenants: tuple[tuple[str, str], ...] = TENANTS,
    ) -> None:
        self.url, self.namespace = url, namespace
        self.tenants = tenants
        self.roles = roles
        self.out_dir = out_dir
        self.extra = extra or {}
        self.env = {"JOYNEXUS_HEARTBEAT_S": str(heartbeat_s), **(env or {})}
        self.heartbeat_s = heartbeat_s
        self.log_dir = log_dir
        self.budget = budget or RestartBudget()
        self.stop = asyncio.Event()
        self.produce_stop = asyncio.Event()
        self.tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        self.b = await Broker.connect(self.url, name="fault-rig", namespace=self.namespace)
        await ensure_layout(self.b, LayoutOptions(tq_ttl_s=600))
        slots = role_slots(
            self.url,
            self.namespace,
            self.roles,
            out_dir=self.out_dir,
            extra=self.extra,
            env=self.env,
        )
        self.manager = HealthManager(
            self.b,
            slots,  # type: ignore[arg-type]
            instance="health-rig",
            core=HealthCore(heartbeat_s=self.heartbeat_s, budget=self.budget, start_grace_s=300),
            log_dir=self.log_dir,
            kill_grace_s=5.0,
        )
        self.tasks.append(asyncio.create_task(self.manager.run(self.stop)))
        self.sched = SchedulerClient(self.b, by="fault-rig", call_timeout_s=2.0, deadline_s=90)
        await wait_until(self.all_running, 300, "every role's first heartbeat", every=0.2)

    async def all_running(self) -> bool:
        return all(s.state == "running" for s in self.manager.core.slots.values() if s.owned)

    async def feed_synthetic(self) -> None:
        """Policies for the tenants and synthetic producers in this process."""
        tenants = self.tenants
        await self.sched.set_limits(GlobalLimits(max_active_rollouts=4))
        for tenant, task in tenants:
            await self.sched.set_policy(
                WorkloadPolicy(tenant_id=tenant, task_type=task, max_in_flight=3)  # type: ignore[arg-type]
            )
        self.pipe = SyntheticPipeline(self.b, instance="rig", samples_per_job=4, horizon=4)
        for tenant, task in tenants:
            self.tasks.append(
                asyncio.create_task(
                    self.pipe.producer(tenant, task, stop=self.produce_stop)  # type: ignore[arg-type]
                )
            )

    async def jobs(self) -> list[TrainingJob]:
        out: list[TrainingJob] = []
        for tenant, _ in self.tenants:
            out += await self.sched.list_jobs(tenant)
        return out

    async def completed(self) -> Counter[str]:
        return Counter(j.tenant_id for j in await self.jobs() if j.state is JobState.COMPLETED)

    def pid(self, instance: str) -> int:
        return self.manager.procs[instance].pid

    async def inject(self, fault: Fault, *, within: float = 60.0) -> dict[str, Any]:
        """Wait until the victim holds work, inject, wait for the restart; the timings."""
        if fault.holds is not None:
            holds = fault.holds

            async def holding() -> bool:
                return any(holds(j) for j in await self.jobs())

            await wait_until(holding, within, f"{fault.instance} to hold work", every=0.05)
        before = await self.completed()
        old = self.pid(fault.instance)
        n_decisions = len(self.manager.decisions)
        t0 = time.monotonic()
        os.kill(old, fault.sig)

        async def restarted() -> bool:
            s = self.manager.core.slots[fault.instance]
            return s.state == "running" and s.pid not in (None, old)

        await wait_until(restarted, within, f"{fault.instance} restarted in place", every=0.02)
        restart_s = time.monotonic() - t0
        decision = next(
            d
            for d in list(self.manager.decisions)[n_decisions:]
            if d.action in ("restart", "global_restart")
        )
        return {
            "fault": fault.name,
            "signal": signal.Signals(fault.sig).name,
            "detect_s": round(decision.at - t0, 3),
            "restart_s": round(restart_s, 3),
            "reason": decision.reason,
            "completed_before": dict(before),
        }

    async def progressed(self, before: dict[str, int], within: float = 60.0) -> dict[str, int]:
        """Every tenant completes at least one more job; returns the gains."""

        async def gains() -> dict[str, int] | None:
            now = await self.completed()
            g = {t: now[t] - before.get(t, 0) for t, _ in self.tenants}
            return g if all(v > 0 for v in g.values()) else None

        return await wait_until(gains, within, "every tenant to complete another job", every=0.2)

    async def drain(self, within: float = 60.0) -> Audit:
        """Stop producing, wait until every job is terminal and partitions are gone; audit."""
        self.produce_stop.set()

        async def settled() -> Audit | None:
            a = await audit(self.b)
            return a if not a.nonterminal and not a.leaked else None

        try:
            return await wait_until(settled, within, "every job terminal, partitions cleared", 0.5)
        except TimeoutError:
            return await audit(self.b)

    async def close(self, *, delete: bool = True) -> None:
        self.produce_stop.set()
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if delete:
            with contextlib.suppress(Exception):
                await delete_layout(self.b)
        await self.b.close()
