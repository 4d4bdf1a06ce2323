"""Every agent role as one coroutine: ``run_role(role, broker, stop, opts)``.

``joynexus agent <role>`` runs one of these per process; the launcher and
the tests start several in one process. Each role resumes from durable
state on restart (its durable consumer, the event log, its checkpoint).

Every role beats into the health bucket while it runs
(``hb.<role>.<instance>``, :class:`joynexus.agents.health.Heartbeater`) and
counts the errors it logs into its beats. Role ``health`` is the health
manager in watch mode (heartbeats only: it owns no processes here);
``joynexus up`` runs it in supervise mode, owning one process per role.

Knobs the CLI has no flags for yet come from the environment (the health
manager passes them to the processes it restarts unchanged):
``JOYNEXUS_HEARTBEAT_S`` (heartbeat interval, default 1) and
``JOYNEXUS_ACK_WAIT_S`` (stage workers' ack wait, default 30),
``JOYNEXUS_SYNTHETIC_WORK_S`` (role ``synthetic``: seconds each stage lease and
actor lease is held, as a real step would; default 0),
``JOYNEXUS_DATASETS`` (role ``control``: the root of the tenants' dataset
spaces, ``<root>/<tenant>/<dataset>``; default ``.jnx/datasets``) and
``JOYNEXUS_MAX_EVALS`` (role ``evaluator``: evaluation rounds run at once,
handed out round-robin by tenant; default 2), ``JOYNEXUS_ENV_SPARES`` and
``JOYNEXUS_ENV_WORKERS_MAX`` (role ``producer-rl``: warm idle environment
workers, default 1, and worker processes at most, default 8).

Role ``actor-forward`` runs the ``actor_forward`` stage (behaviour
log-probabilities and critic values of RL jobs, with its own copy of the frozen
base; :mod:`joynexus.agents.actor_forward`).

Role ``producer-rl`` supervises environment worker processes (role
``env-worker``, one or more per RL workload; :mod:`joynexus.agents.envworkers`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joynexus.agents.datasets import default_root
from joynexus.broker.connection import Broker
from joynexus.broker.layout import ensure_layout

log = logging.getLogger(__name__)

ROLES = (
    "scheduler",
    "control",
    "inference",
    "producer-rl",
    "producer-sft",
    "advantage",
    "actor-forward",
    "actor",
    "evaluator",
    "monitor",
    "synthetic",
    "health",
    "env-worker",
)

#: What `joynexus up` starts, in this order (the scheduler first: others call it).
DEPLOYMENT_ROLES = (
    "scheduler",
    "control",
    "inference",
    "advantage",
    "actor-forward",
    "actor",
    "producer-rl",
    "producer-sft",
    "evaluator",
    "monitor",
)


@dataclass
class RoleOptions:
    instance: str
    lease_ttl_s: float = 30.0
    out_dir: Path = Path(".jnx/actor")
    backbone_size: str = "tiny"
    backbone_path: str | None = None
    max_batch: int = 16
    max_wait_ms: float = 5.0
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


#: Modules a role imports, loaded before its first heartbeat: an import of
#: torch blocks the event loop for seconds and would read as a frozen agent.
_ROLE_MODULES = {
    "scheduler": ["joynexus.agents.scheduler"],
    "control": ["joynexus.agents.control", "joynexus.agents.workloads"],
    "inference": ["joynexus.agents.inference"],
    "producer-rl": ["joynexus.agents.envworkers", "joynexus.agents.health"],
    "env-worker": ["joynexus.agents.envworkers", "joynexus.agents.inference"],
    "producer-sft": ["joynexus.agents.workloads"],
    "advantage": ["joynexus.agents.advantage"],
    "actor-forward": ["joynexus.agents.actor_forward", "joynexus.agents.models.backbone"],
    "actor": ["joynexus.agents.actor", "joynexus.agents.models.backbone"],
    "evaluator": ["joynexus.agents.evaluator"],
    "synthetic": ["joynexus.agents.synthetic"],
    "health": ["joynexus.agents.health"],
}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run_role(role: str, b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    """Run ``role`` until ``stop``, beating into the health bucket all along."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
    for module in _ROLE_MODULES.get(role, []):
        importlib.import_module(module)
    await ensure_layout(b)
    from joynexus.agents.health import Heartbeater

    async with Heartbeater(b, role, o.instance, interval_s=o.heartbeat_s).running():
        await _run_role(role, b, stop, o)


async def _run_role(role: str, b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    if role == "scheduler":
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
    elif role == "control":
        from joynexus.agents.control import ControlPlane
        from joynexus.agents.workloads import PolicyInitializer

        control = ControlPlane(
            b,
            init_policy=PolicyInitializer(b),
            instance=o.instance,
            datasets_root=o.datasets_root,
        )
        await control.start()
        _say(
            f"{o.instance}: serving {b.names.control_service} on {b.names.all_api} "
            f"(datasets under {o.datasets_root}/<tenant>)"
        )
        await stop.wait()
        await control.stop()
    elif role == "inference":
        from joynexus.agents.inference import run_inference_agent

        await run_inference_agent(
            b,
            stop,
            size=o.backbone_size,
            backbone_path=o.backbone_path,
            max_batch=o.max_batch,
            max_wait_ms=o.max_wait_ms,
            instance=o.instance,
        )
    elif role == "producer-rl":
        from joynexus.agents.envworkers import EnvSupervisor

        url = o.nats_url or b.nc.connected_url.geturl()  # type: ignore[union-attr]
        _say(f"{o.instance}: environment workers for the RL workloads (hb.env-worker.*)")
        await EnvSupervisor(
            b, instance=o.instance, url=url, data_dir=o.data_dir, heartbeat_s=o.heartbeat_s
        ).run(stop)
    elif role == "env-worker":
        from joynexus.agents.envworkers import EnvWorker

        await EnvWorker(b, instance=o.instance).run(stop)
    elif role == "producer-sft":
        from joynexus.agents.workloads import ProducerAgent

        await ProducerAgent(b, "sft", instance=o.instance).run(stop)
    elif role == "advantage":
        from joynexus.agents.advantage import AdvantageAgent

        await AdvantageAgent(b, instance=o.instance, ack_wait_s=o.ack_wait_s).worker.run(stop)
    elif role == "actor-forward":
        from joynexus.agents.actor_forward import ActorForwardAgent
        from joynexus.agents.models.backbone import Backbone, BackboneConfig

        # The resident frozen base (the same one the actor and the engine load).
        backbone = await asyncio.to_thread(
            Backbone.build,
            BackboneConfig(size=o.backbone_size, path=o.backbone_path),  # type: ignore[arg-type]
        )
        await ActorForwardAgent(b, backbone, instance=o.instance, ack_wait_s=o.ack_wait_s).run(stop)
    elif role == "actor":
        from joynexus.agents.actor import Actor
        from joynexus.agents.models.backbone import Backbone, BackboneConfig

        backbone = await asyncio.to_thread(
            Backbone.build,
            BackboneConfig(size=o.backbone_size, path=o.backbone_path),  # type: ignore[arg-type]
        )
        await Actor(b, backbone, instance=o.instance, out_dir=o.out_dir).run(stop)
    elif role == "evaluator":
        from joynexus.agents.evaluator import Evaluator

        # Stops within a step on `stop` (SIGTERM/SIGINT of `joynexus agent`), leaving
        # unfinished evaluations active for the next evaluator.
        await Evaluator(b, instance=o.instance, max_concurrent=max(1, o.max_evals)).run(stop)
    elif role == "monitor":
        from joynexus.agents.monitor import MonitorAgent

        await MonitorAgent(b, out_dir=o.data_dir / "monitor", instance=o.instance).run(stop)
    elif role == "synthetic":
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
        await asyncio.gather(stage.run(stop), pipe.actor(stop=stop))
    elif role == "health":
        from joynexus.agents.health import HealthCore, HealthManager

        _say(f"{o.instance}: watching heartbeats in {b.names.health_bucket}")
        await HealthManager(b, instance=o.instance, core=HealthCore(heartbeat_s=o.heartbeat_s)).run(
            stop
        )
    else:
        raise ValueError(f"unknown role {role!r}; roles are {ROLES}")


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
