"""The capacity planner's simulator: the real :class:`SchedulerCore` on a simulated clock.

A discrete-event simulation (no I/O, no wall clock, deterministic for a
seed) whose scheduler is the real pure core, driven as the agent drives it,
so admission, leases, lease order and staleness drops are the service's own.
Around it are cost models: a grouped step costs ``train_step_s +
train_per_job_s * (jobs - 1) + train_per_row_s * rows`` (plus
``actor_overhead_s`` per job), an inference batch ``infer_batch_s +
infer_per_row_s * rows`` (plus ``batcher_s`` per request), a rollout
``calls`` requests with ``sim_per_call_s`` of simulator time after each, and
every scheduler decision ``1 / sched_decisions_per_s`` (one at a time, so its
utilization shows when it is the bottleneck). The window ends at the first
progress poll after every tenant reached its updates.

The plan, its costs, the event loop and the simulated services are in
ops/plan/world.py; this module runs a window. See docs/ARCHITECTURE.md, "The
capacity planner".
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from joynexus.agents.scheduler_client import Backoff
from joynexus.ops.plan.world import (
    Costs,
    DeploymentPlan,
    Inference,
    Proc,
    Signal,
    Sim,
    SimScheduler,
    TenantSpec,
)
from joynexus.schemas.jobs import (
    GlobalLimits,
    JobState,
    TrainingJob,
    WorkloadPolicy,
)

S = JobState

#: The RL producers' wait between refused reserves (``agents.producers.rl.BACKOFF``).
RL_BACKOFF = Backoff()


@dataclass
class Result:
    """What one simulated window did."""

    wall_s: float
    done_s: float
    busy: dict[str, float]
    intervals: dict[str, list[tuple[float, float]]]
    updates: dict[str, int]
    drops: dict[str, int]
    waits: list[float]
    waits_by_tenant: dict[str, list[float]]
    decisions: int
    sched_busy_s: float
    batcher_busy_s: float
    batches: list[tuple[int, int]]
    train_steps: int
    finished: bool
    usage: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Per tenant: the simulated times its jobs completed.
    completed_at: dict[str, list[float]] = field(default_factory=dict)


def simulate(dep: DeploymentPlan, costs: Costs) -> Result:
    sim = Sim(dep.seed)

    def jit(x: float) -> float:
        if not costs.jitter or x <= 0:
            return x
        return x * (1.0 + costs.jitter * (2.0 * sim.rng.random() - 1.0))

    limits = GlobalLimits(max_active_rollouts=max(1, dep.global_max_active_rollouts))
    sched = SimScheduler(sim, costs, limits)
    infer = Inference(sim, dep, costs, jit)
    versions: dict[str, int] = {}
    completed: Counter[str] = Counter()
    train_iv: list[tuple[float, float]] = []
    env_iv: dict[str, list[tuple[float, float]]] = defaultdict(list)
    usage: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
    stage_q: list[TrainingJob] = []
    stage_wake = [Signal(sim)]
    train_steps = [0]
    active_env = [0]

    for t in dep.tenants:
        sched.set_policy(WorkloadPolicy(
            tenant_id=t.name, task_type=t.task, workload=t.task,  # type: ignore[arg-type]
            max_in_flight=t.max_in_flight,
            max_active_rollouts=max(1, t.max_active_rollouts),
            completion_target=t.updates,
            max_policy_staleness=t.max_policy_staleness if t.task == "rl" else None,
            priority=t.priority,
            weight=t.weight,
        ))
        versions[t.name] = 1
        sched.core.versions[f"{t.name}.{t.task}"] = 1

    def all_done() -> bool:
        return all(completed[t.name] >= t.updates for t in dep.tenants)

    def producer(t: TenantSpec) -> Proc:
        yield t.startup_s
        backoff = RL_BACKOFF.first_s
        job_id = sched.new_id()
        while completed[t.name] + sched.core.in_flight[f"{t.name}.{t.task}"] < t.updates or \
                completed[t.name] < t.updates:
            yield sched.delay()
            got = sched.reserve(t.name, t.task, versions[t.name], t.rows, job_id)
            if not isinstance(got, TrainingJob):
                if completed[t.name] >= t.updates:
                    sched.leave(job_id)
                    return
                # The service's producers wait in the admission queue (a long poll);
                # without it (or past its bound) they poll with backoff.
                sig = sched.wait(job_id, t.name, t.task, got.code) if dep.queued_admission else None
                if sig is not None:
                    yield sig
                    continue
                yield backoff
                backoff = RL_BACKOFF.next(backoff)
                continue
            job, job_id = got, sched.new_id()
            backoff = RL_BACKOFF.first_s
            if t.task == "sft":
                yield jit(costs.sft_produce_s)
                yield sched.delay()
                sched.mark(job.job_id, S.READY)
                continue
            yield sched.delay()
            sched.mark(job.job_id, S.PRODUCING)
            t0 = sim.now
            active_env[0] += 1
            for _ in range(t.calls):
                yield infer.submit(t.name, t.num_envs)
                yield jit(costs.sim_per_call_s + costs.sim_contention_s * (active_env[0] - 1))
            active_env[0] -= 1
            env_iv[t.name].append((t0, sim.now))
            usage[t.name]["env_s"] += sim.now - t0
            yield jit(costs.rollout_overhead_s)
            yield sched.delay()
            sched.mark(job.job_id, S.NEEDS_ADVANTAGES)
            stage_q.append(job)
            wake, stage_wake[0] = stage_wake[0], Signal(sim)
            wake.fire()
        sched.leave(job_id)

    def advantages() -> Proc:
        while True:
            if not stage_q:
                yield stage_wake[0]
                continue
            job = stage_q.pop(0)
            yield sched.delay()
            held = sched.lease_stage(job.job_id, "advantages")
            yield jit(costs.advantages_s)
            yield sched.delay()
            sched.mark_stage_done(held, S.READY)

    def actor() -> Proc:
        pending: list[TrainingJob] = []
        while True:
            # A lease costs the scheduler a decision; a long poll that finds nothing
            # waits in its memory (no append), as the agent's lease_next does.
            if not pending:
                job = sched.lease_next(set())
                if job is None:
                    if all_done():
                        return
                    yield sched.ready
                    continue
                yield sched.delay()
                pending.append(job)
            while len(pending) < dep.max_group:
                more = sched.lease_next(set())
                if more is None:
                    break
                yield sched.delay()
                pending.append(more)
            group: list[TrainingJob] = []
            seen: set[str] = set()
            for job in list(pending):
                if job.tenant_id not in seen:
                    seen.add(job.tenant_id)
                    group.append(job)
                    pending.remove(job)
            rows = sum(j.sample_count for j in group)
            steps = math.ceil(rows / dep.microbatch) if dep.microbatch else 1
            d = jit(costs.train_step_s * steps + costs.train_per_job_s * (len(group) - 1)
                    + costs.train_per_row_s * rows)
            t0 = sim.now
            yield d
            train_iv.append((t0, sim.now))
            train_steps[0] += 1
            for j in group:
                usage[j.tenant_id]["train_s"] += d * j.sample_count / max(1, rows)
            for j in group:
                yield jit(costs.actor_overhead_s)
                versions[j.tenant_id] += 1
                yield sched.delay()
                sched.complete(j, versions[j.tenant_id])
                completed[j.tenant_id] += 1

    for t in dep.tenants:
        for _ in range(max(1, t.workers) if t.task == "rl" else 1):
            sim.start(producer(t))
    sim.start(advantages())
    for _ in range(max(1, dep.trainers)):
        sim.start(actor())

    sim.run(all_done, dep.horizon_s)
    done_s = sim.now
    finished = all_done()
    wall = math.ceil(done_s / dep.poll_s) * dep.poll_s if dep.poll_s and finished else done_s
    waits_by: dict[str, list[float]] = defaultdict(list)
    completed_at: dict[str, list[float]] = defaultdict(list)
    for job_id, h in sched.history.items():
        job = sched.core.jobs.get(job_id)
        if job is not None and "completed" in h:
            completed_at[job.tenant_id].append(h["completed"])
        if "ready" in h and "leased" in h:
            job = sched.core.jobs.get(job_id)
            if job is not None:
                waits_by[job.tenant_id].append(h["leased"] - h["ready"])
    busy = {
        "train": sum(e - s for s, e in train_iv),
        "infer": sum(e - s for s, e in infer.intervals),
        "env": sum(e - s for iv in env_iv.values() for s, e in iv),
    }
    for name, v in infer.busy_by_tenant.items():
        usage[name]["infer_s"] += v
    intervals: dict[str, list[tuple[float, float]]] = {
        "train": train_iv, "infer": infer.intervals,
        **{f"env {t}": iv for t, iv in env_iv.items()},
    }
    return Result(
        wall_s=wall, done_s=done_s, busy=busy, intervals=intervals,
        updates={t.name: completed[t.name] for t in dep.tenants},
        drops={t.name: sched.drops[t.name] for t in dep.tenants},
        waits=[w for ws in waits_by.values() for w in ws], waits_by_tenant=dict(waits_by),
        decisions=sched.decisions, sched_busy_s=sched.busy_s, batcher_busy_s=infer.batcher_busy_s,
        batches=infer.batches, train_steps=train_steps[0], finished=finished,
        usage={name: dict(c) for name, c in usage.items()},
        completed_at={t: sorted(ts) for t, ts in completed_at.items()},
    )


def isolated(dep: DeploymentPlan, costs: Costs) -> list[Result]:
    """Each tenant alone on the same deployment, one after another."""
    out = []
    for t in dep.tenants:
        one = DeploymentPlan(**{**dep.__dict__, "tenants": [t]})
        out.append(simulate(one, costs))
    return out
