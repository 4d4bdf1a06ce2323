"""The deployment ``joynexus bench learning`` trains on: every role of the real
service in this process, on a fresh embedded, secured nats-server (:class:`Service`),
each role restarted if it crashes (counted in ``restarts``), and the tenant's
client under its own credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The one tenant the benchmark trains for.
TENANT = "acme"


class Service:
    """The roles of a deployment, in this process, on a fresh embedded server."""

    def __init__(
        self, data: Path, *, rl: bool = False, ppo_epochs: int = 1, backbone_path: str | None = None,
        family: str = "qwen2_5_vl",
    ) -> None:
        self.data = data
        self.family = family
        self.backbone_path = backbone_path
        self.rl = rl
        self.ppo_epochs = ppo_epochs
        self.restarts: dict[str, int] = {}
        self.datasets = data / "datasets"
        self.stack = contextlib.AsyncExitStack()
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[Any]] = []
        self.url = ""
        self.admin: Any = None
        #: the agents' identity's connection (a policy gateway may serve on it)
        self.service: Any = None

    async def __aenter__(self) -> Service:
        try:
            await self._start()
        except BaseException:
            await self.stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stack.aclose()

    async def _start(self) -> None:
        import torch

        from joynexus.agents.actor.agent import Actor
        from joynexus.agents.control import ControlPlane
        from joynexus.agents.evaluator import Evaluator
        from joynexus.agents.inference import EnginePool
        from joynexus.agents.models.families import build_base
        from joynexus.agents.producers import PolicyInitializer, ProducerAgent
        from joynexus.agents.scheduler import SchedulerAgent
        from joynexus.broker.connection import Broker
        from joynexus.ops.runtime.deploy import embedded

        st = self.stack
        self.datasets.mkdir(parents=True, exist_ok=True)
        ep = st.enter_context(embedded(self.data / "nats", act_as_admin=False))
        self.url = ep.url
        self.admin = await Broker.connect(self.url, name="bl-admin", credentials=ep.admin)
        st.push_async_callback(self.admin.close)
        service = await Broker.connect(self.url, name="bl-service", credentials=ep.service)
        st.push_async_callback(service.close)
        self.service = service
        control_b = await Broker.connect(
            self.url, name="bl-control", credentials=getattr(ep, "control", None) or ep.service
        )
        st.push_async_callback(control_b.close)
        torch.manual_seed(0)
        backbone = build_base(self.family, "tiny", self.backbone_path)
        sched = SchedulerAgent(service, instance="sched", lease_ttl_s=60.0)
        await sched.start()
        st.push_async_callback(sched.stop)
        control = ControlPlane(
            control_b,
            init_policy=PolicyInitializer(control_b),
            instance="control",
            datasets_root=self.datasets,
        )
        await control.start()
        st.push_async_callback(control.stop)
        pool = EnginePool(service, backbone, max_batch=16, max_wait_ms=5)
        await pool.scale_to(1)
        st.push_async_callback(pool.close)
        st.push_async_callback(self._stop_tasks)
        # The actor keeps its checkpoint, so a restarted one resumes exactly.
        self._supervise("actor", lambda: Actor(
            service, backbone, instance="actor", out_dir=self.data / "actor", lease_wait_s=0.5,
            ppo_epochs=self.ppo_epochs,
        ).run(self.stop))
        self._supervise("producer-sft", lambda: ProducerAgent(
            service, "sft", instance="prod-sft").run(self.stop))
        self._supervise("evaluator", lambda: Evaluator(service, instance="eval").run(self.stop))
        if self.rl:
            from joynexus.agents.actor.forward import ActorForwardAgent
            from joynexus.agents.advantage import AdvantageAgent

            # The stage consumers exist before the first rollout: its job is routed
            # through actor_forward (PPO), not straight to advantages.
            sub = await ActorForwardAgent(service, backbone, instance="fwd").worker.subscribe()
            await sub.unsubscribe()  # the durable consumer stays
            self._supervise("actor-forward", lambda: ActorForwardAgent(
                service, backbone, instance="fwd").run(self.stop))
            self._supervise("advantage", lambda: AdvantageAgent(
                service, instance="adv").worker.run(self.stop))
            self._supervise("producer-rl", lambda: ProducerAgent(
                service, "rl", instance="prod-rl").run(self.stop))

    def _supervise(self, name: str, make: Any) -> None:
        """Run a role coroutine; restart it after a crash (logged, counted)."""
        async def guard() -> None:
            while not self.stop.is_set():
                try:
                    return await make()  # a cancellation (BaseException) passes through
                except Exception:
                    log.exception("bench role %s crashed; restarting", name)
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    await asyncio.sleep(1.0)

        self.tasks.append(asyncio.create_task(guard()))

    async def _stop_tasks(self) -> None:
        self.stop.set()
        if self.tasks:
            _, late = await asyncio.wait(self.tasks, timeout=30)
            for t in late:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def tenant(self) -> Any:
        from joynexus.ops.admin.tenants import add_tenant
        from joynexus.sdk import Client

        creds, _ = await add_tenant(self.admin, TENANT, url=self.url)
        client = await Client.connect(credentials=creds)
        self.stack.push_async_callback(client.close)
        return client
