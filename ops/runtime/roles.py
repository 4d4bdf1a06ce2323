"""Every agent role, by name, in one registry: ``run_role(role, broker, stop, opts)``.

A role is a :class:`Role`: what it imports before its first heartbeat, where
``joynexus up`` starts it, and its runner; ``ROLES`` and ``DEPLOYMENT_ROLES``
are read off :data:`REGISTRY`, so a new role is one entry. ``joynexus agent
<role>`` runs one per process; the launcher and the tests start several in
one process. Every role beats while it runs and resumes from durable state
(its durable consumer, the event log, its checkpoint) when restarted. A beat
carries the process's RSS and, once the role serves, ``ready_s``: seconds from
the process's start to then (:attr:`Role.ready_when` says how a role tells).

Knobs the CLI has no flags for come from the environment (the health manager
passes them unchanged to the processes it restarts): ``JOYNEXUS_HEARTBEAT_S``
(default 1), ``JOYNEXUS_ACK_WAIT_S`` (stage workers' ack wait, 30),
``JOYNEXUS_LEASE_TTL_S`` (the scheduler's lease, 6), ``JOYNEXUS_SYNTHETIC_WORK_S``
(role ``synthetic``: seconds each stage and actor lease is held, 0),
``JOYNEXUS_DATASETS`` (role ``control``: root of ``<root>/<tenant>/<dataset>``,
``.jnx/datasets``), ``JOYNEXUS_MAX_EVALS`` (role ``evaluator``: rounds at once,
2), ``JOYNEXUS_ENV_SPARES`` and ``JOYNEXUS_ENV_WORKERS_MAX`` (role
``producer-rl``: warm idle environment workers, 1, and at most, 8),
``JOYNEXUS_ENV_WARM`` (the env each new worker builds and resets before it is
ready, comma-separated, one per worker in turn: PickCube-v1), ``JOYNEXUS_SFT_WARM``
(role ``producer-sft``: "1" loads LeRobot's dataset reader before it is ready) and
``JOYNEXUS_CORES`` (the cores the launcher plans every role's threads from,
``ops/runtime/threads.py``).

See docs/ARCHITECTURE.md, "Processes" and "Light roles".
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import orjson

from joynexus.agents.datasets import default_root
from joynexus.broker.connection import Broker
from joynexus.broker.layout import ensure_layout
from joynexus.broker.natsapi import service_api
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.inference import DEFAULT_MAX_ROWS

log = logging.getLogger(__name__)


@dataclass
class RoleOptions:
    instance: str
    lease_ttl_s: float = 30.0
    out_dir: Path = Path(".jnx/actor")
    backbone_size: str = "tiny"
    backbone_path: str | None = None
    #: The resident base family (``agents.models.families``: qwen2_5_vl, pi05, smolvla); actor,
    #: actor-forward and inference build it at ``backbone_size``.
    base_family: str = "qwen2_5_vl"
    max_batch: int = 16
    max_rows: int = DEFAULT_MAX_ROWS
    max_wait_ms: float = 5.0
    #: Inference: torch intra-op threads (None: ``serving_threads``'s default).
    torch_threads: int | None = None
    #: Where roles write local output (monitor report data, traces).
    data_dir: Path = Path(".jnx")
    heartbeat_s: float = field(
        default_factory=lambda: float(os.environ.get("JOYNEXUS_HEARTBEAT_S", "1.0"))
    )
    ack_wait_s: float = field(
        default_factory=lambda: float(os.environ.get("JOYNEXUS_ACK_WAIT_S", "30.0"))
    )
    #: Control: the root of the tenants' dataset spaces ($JOYNEXUS_DATASETS or .jnx/datasets).
    datasets_root: Path = field(default_factory=default_root)
    #: Evaluator: evaluation rounds at once (turns round-robin by tenant).
    max_evals: int = field(
        default_factory=lambda: int(os.environ.get("JOYNEXUS_MAX_EVALS", "2"))
    )
    #: The NATS URL this role was given (producer-rl hands it to its env workers).
    nats_url: str = ""
    #: Told once when the role serves (after the heartbeat's ready mark, which
    #: :func:`run_role` adds); runners call ``o.ready()``.
    ready: Callable[[], None] = field(default=lambda: None, repr=False)
    #: Told where the role serves clients outside NATS (the gateway's URL): its
    #: heartbeats carry it, and ``joynexus status`` shows it.
    announce: Callable[[str], None] = field(default=lambda address: None, repr=False)


Runner = Callable[[Broker, asyncio.Event, RoleOptions], Awaitable[None]]


@dataclass(frozen=True)
class Role:
    """One role: its name, what it needs loaded, whether `joynexus up` starts it."""

    name: str
    run: Runner
    #: Imported before the first heartbeat: an import of torch blocks the event
    #: loop for seconds and would read as a frozen agent.
    imports: tuple[str, ...] = ()
    #: Place in what `joynexus up` starts by default (the scheduler first:
    #: others call it); None: not started by default.
    up_order: int | None = None
    #: Whether `joynexus up --roles` may name it (not ``health``: the launcher
    #: is the health manager itself).
    supervised: bool = True
    #: Takes `--out` (its checkpoints' directory) when the launcher starts it.
    writes_checkpoints: bool = False
    #: How the role tells it serves: ``runner`` (its runner calls ``o.ready()``) or
    #: ``announced`` (it publishes a ``system`` metric with ``ready`` and its instance).
    ready_when: Literal["runner", "announced"] = "runner"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _scheduler(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.leases import RoleLease, host_id
    from joynexus.agents.scheduler import SchedulerAgent

    # One decider across hosts: serve while holding the lease, stand by otherwise.
    lease = RoleLease(
        b,
        "scheduler",
        f"{host_id()}/{o.instance}",
        ttl_s=int(os.environ.get("JOYNEXUS_LEASE_TTL_S", "6")),
    )
    agent = SchedulerAgent(b, instance=o.instance, lease_ttl_s=o.lease_ttl_s, lease=lease)
    if not await agent.stand_by(stop):
        return
    await agent.start()
    o.ready()
    _say(
        f"{o.instance}: serving {b.names.scheduler_service} ({agent.rebuild_stats['jobs']} jobs "
        f"rebuilt; lease held as {lease.holder})"
    )
    stopped = asyncio.create_task(stop.wait())
    deposed = asyncio.create_task(agent.deposed.wait())
    await asyncio.wait({stopped, deposed}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    deposed.cancel()
    if agent.deposed.is_set():
        await agent.stop()
        # Exit non-zero: the supervisor restarts it in place, and it stands by.
        raise SystemExit(f"{o.instance}: deposed: another host's scheduler holds the lease")
    await agent.stop()
    await lease.release()


async def _control(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.control import ControlPlane
    from joynexus.agents.producers.init import PolicyInitializer

    control = ControlPlane(
        b,
        # Light: a new workload's fresh weights are built by the actor role (its
        # endpoint); checks and copies of another version need no torch.
        init_policy=PolicyInitializer(b, remote=True),
        instance=o.instance,
        datasets_root=o.datasets_root,
    )
    await control.start()
    o.ready()
    _say(
        f"{o.instance}: serving {b.names.control_service} on {b.names.all_api} "
        f"(datasets under {o.datasets_root}/<tenant>)"
    )
    await stop.wait()
    await control.stop()


async def _inference(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.inference import run_inference_agent

    ready = asyncio.create_task(_ready_when_answering(b, b.names.inference_service, o))
    try:
        await run_inference_agent(
            b,
            stop,
            size=o.backbone_size,
            backbone_path=o.backbone_path,
            family=o.base_family,
            max_batch=o.max_batch,
            max_rows=o.max_rows,
            max_wait_ms=o.max_wait_ms,
            instance=o.instance,
            threads=o.torch_threads,
        )
    finally:
        ready.cancel()


async def _ready_when_answering(
    b: Broker, service: str, o: RoleOptions, every_s: float = 0.25
) -> None:
    """``o.ready()`` once an engine of this process (``<instance>-<k>`` in the micro
    service's metadata) answers the service's PING."""
    inbox = b.nc.new_inbox()
    found = asyncio.Event()

    async def on_reply(msg: Any) -> None:
        try:
            m = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            return
        meta = m.get("metadata") if isinstance(m, dict) else None
        inst = meta.get("instance") if isinstance(meta, dict) else None
        if isinstance(inst, str) and inst.rsplit("-", 1)[0] == o.instance:
            found.set()

    sub = await b.nc.subscribe(inbox, cb=on_reply)
    try:
        while not found.is_set():
            await b.nc.publish(service_api("PING", service), b"", reply=inbox)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(found.wait(), every_s)
        o.ready()
    finally:
        await sub.unsubscribe()


async def _producer_rl(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.envworkers import EnvSupervisor

    url = o.nats_url or b.nc.connected_url.geturl()  # type: ignore[union-attr]
    _say(f"{o.instance}: environment workers for the RL workloads (hb.env-worker.*)")
    await EnvSupervisor(
        b, instance=o.instance, url=url, data_dir=o.data_dir, heartbeat_s=o.heartbeat_s
    ).run(stop)


async def _env_worker(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.envworkers import EnvWorker

    await EnvWorker(b, instance=o.instance).run(stop)


async def _producer_sft(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.producers.supervisor import ProducerAgent

    await ProducerAgent(b, "sft", instance=o.instance).run(stop)


async def _advantage(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.advantage import AdvantageAgent

    o.ready()
    await AdvantageAgent(b, instance=o.instance, ack_wait_s=o.ack_wait_s).worker.run(stop)


async def _actor_forward(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.actor.forward import ActorForwardAgent
    from joynexus.agents.models.families import build_base

    # The resident frozen base (the same one the actor and the engine load).
    backbone = await asyncio.to_thread(build_base, o.base_family, o.backbone_size, o.backbone_path)
    o.ready()
    await ActorForwardAgent(b, backbone, instance=o.instance, ack_wait_s=o.ack_wait_s).run(stop)


async def _actor(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.actor.agent import Actor
    from joynexus.agents.models.families import build_base

    backbone = await asyncio.to_thread(build_base, o.base_family, o.backbone_size, o.backbone_path)
    o.ready()
    await Actor(b, backbone, instance=o.instance, out_dir=o.out_dir).run(stop)


#: The evaluator's CPU niceness (``$JOYNEXUS_EVAL_NICE``): its simulators are background
#: work, so the request servers and the trainer on the same cores go first (issue 24:
#: two 500-episode evaluations of one tenant, within its quota, made another tenant's
#: calls 2.4x slower at p50 on 2 cores). 0 keeps the default priority.
EVAL_NICE_ENV = "JOYNEXUS_EVAL_NICE"


async def _evaluator(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.evaluator import Evaluator

    nice = int(os.environ.get(EVAL_NICE_ENV, "10") or 0)
    if nice > 0:
        os.nice(nice)

    # Stops within a step on `stop` (SIGTERM/SIGINT of `joynexus agent`), leaving
    # unfinished evaluations active for the next evaluator.
    o.ready()
    await Evaluator(b, instance=o.instance, max_concurrent=max(1, o.max_evals)).run(stop)


async def _monitor(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.monitor import MonitorAgent

    o.ready()
    await MonitorAgent(b, out_dir=o.data_dir / "monitor", instance=o.instance).run(stop)


async def _gateway(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.gateway import run_gateway

    await run_gateway(b, stop, o.ready, instance=o.instance,  # $JOYNEXUS_GATEWAY_*
                      announce=o.announce)


async def _synthetic(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    from joynexus.agents.stage import StageWorker

    pipe = _paced_pipeline(b, o.instance, float(os.environ.get("JOYNEXUS_SYNTHETIC_WORK_S", 0)))
    stage = StageWorker(
        b,
        pipe.client("advantage-0"),
        "advantages",
        pipe.advantage_work,
        batch=32,
        ack_wait_s=o.ack_wait_s,
    )
    o.ready()
    await asyncio.gather(stage.run(stop), pipe.actor(stop=stop))


async def _health(b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    # Watch mode (heartbeats only, it owns no processes); `joynexus up` runs the
    # manager in supervise mode instead (ops/runtime/launcher.py).
    from joynexus.agents.health import HealthCore, HealthManager

    _say(f"{o.instance}: watching heartbeats in {b.names.health_bucket}")
    o.ready()
    await HealthManager(b, instance=o.instance, core=HealthCore(heartbeat_s=o.heartbeat_s)).run(
        stop
    )


def _paced_pipeline(b: Broker, instance: str, work_s: float) -> Any:
    """A synthetic pipeline whose stage work and actor steps take ``work_s`` each."""
    from joynexus.agents.synthetic import SyntheticPipeline
    from joynexus.schemas.jobs import TrainingJob

    class Paced(SyntheticPipeline):
        async def advantage_work(self, job: TrainingJob) -> int | None:
            await asyncio.sleep(work_s)
            return await super().advantage_work(job)

        def client(self, name: str) -> Any:
            c = super().client(name)
            if name.startswith("actor") and work_s > 0:
                complete = c.complete

                async def paced_complete(*a: Any, **kw: Any) -> Any:
                    await asyncio.sleep(work_s)  # the step, between lease and complete
                    return await complete(*a, **kw)

                c.complete = paced_complete  # type: ignore[method-assign]
            return c

    return Paced(b, instance=instance)


_A = "joynexus.agents."

#: Every role by name, in the order `joynexus agent --help` lists them.
REGISTRY: dict[str, Role] = {
    r.name: r
    for r in (
        Role("scheduler", _scheduler, (_A + "scheduler",), up_order=0),
        Role("control", _control, (_A + "control", _A + "producers.init"), up_order=1),
        Role("inference", _inference, (_A + "inference",), up_order=2),
        Role(
            "producer-rl",
            _producer_rl,
            (_A + "envworkers", _A + "health"),
            up_order=6,
            ready_when="announced",
        ),
        Role(
            "producer-sft",
            _producer_sft,
            (_A + "producers.supervisor",),
            up_order=7,
            ready_when="announced",
        ),
        Role("advantage", _advantage, (_A + "advantage",), up_order=3),
        Role(
            "actor-forward",
            _actor_forward,
            (_A + "actor.forward", _A + "models.backbone"),
            up_order=4,
        ),
        Role(
            "actor",
            _actor,
            (_A + "actor.agent", _A + "models.backbone"),
            up_order=5,
            writes_checkpoints=True,
        ),
        Role("evaluator", _evaluator, (_A + "evaluator",), up_order=8),
        Role("monitor", _monitor, (), up_order=9),
        Role("gateway", _gateway, (_A + "gateway",)),
        Role("synthetic", _synthetic, (_A + "synthetic",)),
        Role("health", _health, (_A + "health",), supervised=False),
        # Started by producer-rl, one or more per RL workload (agents/envworkers/).
        Role(
            "env-worker",
            _env_worker,
            (_A + "envworkers", _A + "inference"),
            ready_when="announced",
        ),
    )
}

ROLES: tuple[str, ...] = tuple(REGISTRY)

#: What `joynexus up` starts, in this order.
DEPLOYMENT_ROLES: tuple[str, ...] = tuple(
    name
    for _, name in sorted(
        (r.up_order, r.name) for r in REGISTRY.values() if r.up_order is not None
    )
)


def by_name(name: str) -> Role:
    """The role called ``name``; ValueError naming the roles for any other."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown role {name!r}; roles are {ROLES}") from None


async def run_role(name: str, b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    """Run role ``name`` until ``stop``, beating into the health bucket all along
    (``hb.<role>.<instance>``; the beats count the errors it logs, carry the RSS and,
    once the role serves, ``ready_s``; ``o.ready`` is told then too)."""
    r = by_name(name)
    for module in r.imports:
        importlib.import_module(module)
    await ensure_layout(b)
    from joynexus.agents.health import Heartbeater

    hb = Heartbeater(b, r.name, o.instance, interval_s=o.heartbeat_s)
    told = o.ready
    said: list[float] = []

    def ready() -> None:
        if not said:
            said.append(hb.mark_ready())
            told()

    def announce(address: str) -> None:
        hb.address = address

    o = replace(o, ready=ready, announce=announce)
    async with hb.running():
        if r.ready_when == "runner":
            await r.run(b, stop, o)
            return
        # Subscribed before the runner starts: its announcement follows on this connection.
        sub = await b.nc.subscribe(b.names.metrics("system"))
        announced = asyncio.create_task(_ready_on_announce(sub, o))
        try:
            await r.run(b, stop, o)
        finally:
            await cancel_and_wait(announced)


async def _ready_on_announce(sub: Any, o: RoleOptions) -> None:
    """``o.ready()`` when this process publishes a ``system`` metric with ``ready`` and
    its instance (``sub``: the metrics' subscription; NATS echoes a connection's own
    messages), then stop listening."""
    try:
        async for msg in sub.messages:
            try:
                m = orjson.loads(msg.data)
            except orjson.JSONDecodeError:
                continue
            if isinstance(m, dict) and m.get("ready") is True and m.get("instance") == o.instance:
                o.ready()
                return
    finally:
        await sub.unsubscribe()
