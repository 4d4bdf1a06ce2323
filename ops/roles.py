"""Every agent role as one coroutine: ``run_role(role, broker, stop, opts)``.

``joynexus agent <role>`` runs one of these per process; the launcher and
the tests start several in one process. Each role resumes from durable
state on restart (its durable consumer, the event log, its checkpoint).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

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
    "actor",
    "evaluator",
    "synthetic",
)

#: What `joynexus up` starts, in this order (the scheduler first: others call it).
DEPLOYMENT_ROLES = (
    "scheduler",
    "control",
    "inference",
    "advantage",
    "actor",
    "producer-rl",
    "producer-sft",
    "evaluator",
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


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run_role(role: str, b: Broker, stop: asyncio.Event, o: RoleOptions) -> None:
    await ensure_layout(b)
    if role == "scheduler":
        from joynexus.agents.scheduler import SchedulerAgent

        agent = SchedulerAgent(b, instance=o.instance, lease_ttl_s=o.lease_ttl_s)
        await agent.start()
        _say(
            f"{o.instance}: serving {b.names.scheduler_service} ({agent.rebuild_stats['jobs']} jobs rebuilt)"
        )
        await stop.wait()
        await agent.stop()
    elif role == "control":
        from joynexus.agents.control import ControlPlane
        from joynexus.agents.workloads import PolicyInitializer

        control = ControlPlane(b, init_policy=PolicyInitializer(b), instance=o.instance)
        await control.start()
        _say(f"{o.instance}: serving {b.names.control_service} on {b.names.all_api}")
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
    elif role in ("producer-rl", "producer-sft"):
        from joynexus.agents.workloads import ProducerAgent

        await ProducerAgent(b, role.removeprefix("producer-"), instance=o.instance).run(stop)
    elif role == "advantage":
        from joynexus.agents.advantage import AdvantageAgent

        await AdvantageAgent(b, instance=o.instance).worker.run(stop)
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

        await Evaluator(b, instance=o.instance).run(stop)
    elif role == "synthetic":
        from joynexus.agents.synthetic import SyntheticPipeline

        pipe = SyntheticPipeline(b, instance=o.instance)
        await asyncio.gather(pipe.stage_worker().run(stop), pipe.actor(stop=stop))
    else:
        raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
