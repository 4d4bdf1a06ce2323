"""The live secured deployment the attacks run against, and the tenants' batches.

:class:`SecuredDeployment` is a fresh embedded nats-server with authorization on (or
an external one: ``url`` and admin credentials) with the agents in this process
under the service identity (scheduler, control plane as the control identity,
an inference engine on the tiny backbone, the actor under a supervisor that
counts its restarts), the tenants' dataset spaces, and what an attack needs to
act and to look: a tenant's credentials, SDK client or bare nats-py connection,
the security events, the server's log. It is also the fixture of
``tests/system/test_security.py``. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import numpy as np

from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.broker.subjects import Names
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.inference import DEFAULT_MAX_ROWS
from joynexus.schemas.workloads import (
    WorkloadSpec,
)
from joynexus.sdk import Client

log = logging.getLogger(__name__)


NS = "jnx"
MODEL = "qwen2.5-vl-tiny"
VICTIM = "bolt"
ATTACKER = "acme"
MiB = 1024 * 1024
#: The victim's workload and dataset (in its own dataset space).
VICTIM_WORKLOAD = "pick"
DATASET = "pick"
#: The attacker's Training Queue quota (operator-set), so the quota attack is quick.
ATTACKER_TQ_BYTES = 32 * MiB


# ---------------------------------------------------------------- batches
def sft_batch(rows: int, seed: int, *, image: int = 64) -> dict[str, np.ndarray]:
    """Demonstrations for the PickCube-shaped SFT workloads (action_horizon 2)."""
    rng = np.random.default_rng(seed)
    return {
        "obs_image_base_camera": rng.integers(0, 255, (rows, 3, image, image), dtype=np.uint8),
        "obs_state": rng.standard_normal((rows, 12), dtype=np.float32),
        "actions": rng.uniform(-1, 1, (rows, 2, 4)).astype(np.float32),
    }


def sft_spec(name: str, dataset: str, **kw: Any) -> WorkloadSpec:
    return WorkloadSpec(
        name=name, task_type="sft", dataset=dataset, source="tenant", action_horizon=2, **kw
    )


def _supported(fn: Callable[..., Any], **kw: Any) -> dict[str, Any]:
    """The keyword arguments ``fn`` accepts (parts of the service land one by one)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params}


# ---------------------------------------------------------------- the deployment
@dataclass
class RawConn:
    """A bare nats-py connection and the asynchronous errors the server sent it."""

    nc: Any
    errors: list[str]

    def saw(self, text: str) -> bool:
        return any(text.lower() in e.lower() for e in self.errors)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.close()


class _LogBytes(logging.Handler):
    """Counts the bytes of the log records this process emits (warnings and up), and
    those its agent processes wrote to their logs (``others``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.own = 0
        self.others: Callable[[], int] = lambda: 0

    @property
    def bytes(self) -> int:
        return self.own + self.others()

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.own += len(record.getMessage())


class SecuredDeployment:
    """A live secured deployment for attacks (async context manager).

    Without ``url``: a fresh embedded nats-server (authorization on, its auth
    sync in a thread) under ``data_dir`` (a temporary one if None) and the
    agents in this process. With ``url``: an external deployment whose agents
    already run; ``admin_creds`` (file or Credentials) is required, and
    ``datasets_root`` must be the service's datasets root on this machine.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        namespace: str = NS,
        url: str | None = None,
        admin_creds: Credentials | str | Path | None = None,
        service_creds: Credentials | str | Path | None = None,
        datasets_root: str | Path | None = None,
        lease_ttl_s: float = 10.0,
        open_job_ttl_s: float = 8.0,
        prefetch_dataset: bool = True,
        processes: bool = False,
        gateway_url: str = "",
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        self.names = Names(namespace)
        self.namespace = namespace
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self.external = url is not None
        self.url = url or ""
        self._admin_creds = admin_creds
        self._service_creds = service_creds
        self._datasets_root = Path(datasets_root) if datasets_root is not None else None
        self.lease_ttl_s = lease_ttl_s
        self.open_job_ttl_s = open_job_ttl_s
        self.prefetch_dataset = prefetch_dataset
        #: The agents in processes of their own (:mod:`.processes`), as in production,
        #: instead of in this process.
        self.processes = processes
        #: A fresh deployment's inference engine: rows per batch (``--max-rows``).
        self.max_rows = max_rows
        #: The policy gateway's address (a fresh deployment starts one: ``.gateway``).
        self.gateway_url = gateway_url
        self.agents: Any = None
        #: Roles started on demand (:meth:`start_role`) beside in-process agents.
        self.extra_agents: Any = None
        self.ep: Any = None
        self.admin: Broker = None  # type: ignore[assignment]
        self.service: Broker | None = None
        self.service_creds: Credentials | None = None
        self.creds: dict[str, Credentials] = {}
        #: The quota fields an operator set per tenant (when the service takes quotas).
        self.quotas: dict[str, dict[str, Any]] = {}
        self.clients: dict[str, Client] = {}
        #: The actor of this process: how often it died and was started again, and why.
        self._actor_restarts: int | None = None
        self.actor_errors: list[str] = []
        self.actor: Any = None
        self.scoped_datasets = True
        self.log_bytes = _LogBytes()
        self._stack = contextlib.AsyncExitStack()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._template: asyncio.Task[Path] | None = None

    # -------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> SecuredDeployment:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    @property
    def actor_restarts(self) -> int | None:
        """How often the actor died and was started again (None: not known, for an
        external deployment)."""
        return self.agents.restarts if self.agents is not None else self._actor_restarts

    @property
    def data(self) -> Path:
        assert self._data_dir is not None
        return self._data_dir

    @property
    def datasets_root(self) -> Path:
        assert self._datasets_root is not None
        return self._datasets_root

    async def _start(self) -> None:
        st = self._stack
        if self._data_dir is None:
            self._data_dir = Path(st.enter_context(tempfile.TemporaryDirectory(prefix="jnx-iso-")))
        self.data.mkdir(parents=True, exist_ok=True)
        if self._datasets_root is None:
            self._datasets_root = self.data / "datasets"
        self.datasets_root.mkdir(parents=True, exist_ok=True)
        logging.getLogger().addHandler(self.log_bytes)
        st.callback(logging.getLogger().removeHandler, self.log_bytes)
        if self.prefetch_dataset:  # made while the server and the agents start
            self._template = asyncio.create_task(asyncio.to_thread(self._make_template))
        st.push_async_callback(self._reap_template)
        if self.external:
            await self._attach()
        else:
            await self._launch()
        st.push_async_callback(self._close_clients)

    async def _reap_template(self) -> None:
        if self._template is not None and not self._template.done():
            with contextlib.suppress(BaseException):
                await self._template

    def _make_template(self) -> Path:
        """One small LeRobot dataset (PickCube, 1 episode, 64 px) copied into dataset spaces."""
        from joynexus.agents.envs.lerobot_data import generate_dataset

        path = self.data / "dataset-template"
        if not (path / "meta" / "info.json").is_file():
            shutil.rmtree(path, ignore_errors=True)
            generate_dataset("PickCube-v1", path, episodes=1, obs="rgb", image_size=64, seed=0)
        return path

    async def _attach(self) -> None:
        admin = (
            Credentials.load(self._admin_creds)
            if isinstance(self._admin_creds, str | Path) else self._admin_creds
        )
        if admin is None:
            raise JoyNexusError("an external deployment needs the admin credentials (--creds)")
        self.admin = await Broker.connect(
            self.url, name="iso-admin", namespace=self.namespace, credentials=admin
        )
        self._stack.push_async_callback(self.admin.close)
        svc = self._service_creds
        self.service_creds = Credentials.load(svc) if isinstance(svc, str | Path) else svc
        if self.service_creds is not None:  # reads the scheduler's view of the attacker's jobs
            self.service = await Broker.connect(self.url, name="iso-service",
                                                namespace=self.namespace,
                                                credentials=self.service_creds)
            self._stack.push_async_callback(self.service.close)

    async def _launch(self) -> None:
        import torch

        from joynexus.agents.control import ControlPlane
        from joynexus.agents.inference import EnginePool
        from joynexus.agents.models.backbone import Backbone
        from joynexus.agents.models.backbone_config import BackboneConfig
        from joynexus.agents.producers import PolicyInitializer
        from joynexus.agents.scheduler import SchedulerAgent
        from joynexus.ops.runtime.deploy import embedded

        st = self._stack
        ep = st.enter_context(embedded(self.data / "nats", namespace=self.namespace,
                                       act_as_admin=False))
        self.ep, self.url = ep, ep.url
        self.service_creds = ep.service
        control_creds = getattr(ep, "control", None) or ep.service
        self.admin = await Broker.connect(self.url, name="iso-admin", namespace=self.namespace,
                                          credentials=ep.admin)
        st.push_async_callback(self.admin.close)
        self.service = await Broker.connect(self.url, name="iso-service",
                                            namespace=self.namespace, credentials=ep.service)
        st.push_async_callback(self.service.close)
        if self.processes:
            assert control_creds is not None
            await self._launch_processes(control_creds)
            self.gateway_url = f"ws://127.0.0.1:{self.agents.gateway_port}"
            return
        control_b = await Broker.connect(self.url, name="iso-control",
                                         namespace=self.namespace, credentials=control_creds)
        st.push_async_callback(control_b.close)
        torch.manual_seed(0)
        backbone = Backbone.build(BackboneConfig(size="tiny"))
        sched = SchedulerAgent(self.service, instance="sched", lease_ttl_s=self.lease_ttl_s,
                               expire_every_s=0.2)
        await sched.start()
        st.push_async_callback(sched.stop)
        self.scoped_datasets = "datasets_root" in inspect.signature(ControlPlane).parameters
        control = ControlPlane(
            control_b, init_policy=PolicyInitializer(control_b), instance="control",
            open_job_ttl_s=self.open_job_ttl_s,
            **_supported(ControlPlane, datasets_root=self.datasets_root),
        )
        await control.start()
        st.push_async_callback(control.stop)
        pool = EnginePool(self.service, backbone, max_batch=8, max_wait_ms=5, max_rows=self.max_rows)
        await pool.scale_to(1)
        st.push_async_callback(pool.close)
        from joynexus.ops.isolation.gateway import start_in_process

        self.gateway_url = f"ws://127.0.0.1:{await start_in_process(self.service, st)}"
        self._actor_restarts = 0
        task = asyncio.create_task(self._supervise_actor(backbone))
        self._tasks.append(task)
        st.push_async_callback(self._stop_tasks)

    async def _launch_processes(self, control_creds: Credentials) -> None:
        from joynexus.ops.isolation.processes import AgentProcesses

        assert self.service is not None and self.service_creds is not None
        self.agents = AgentProcesses(
            self.url, self.namespace, self.data / "agents", service=self.service_creds,
            control=control_creds, datasets_root=self.datasets_root, lease_ttl_s=self.lease_ttl_s,
            max_rows=self.max_rows,
        )
        self._stack.push_async_callback(self.agents.stop)
        await self.agents.start(self.service)
        self.actor_errors = self.agents.errors
        self.log_bytes.others = lambda: self.agents.log_bytes

    async def start_role(self, role: str) -> bool:
        """One more agent role in a process of its own, once (e.g. the evaluator, which
        only the periodic-evaluation attack needs); False for an external deployment,
        whose operator runs its roles."""
        from joynexus.ops.isolation.processes import AgentProcesses

        if self.external:
            return False
        procs = self.agents or self.extra_agents
        if procs is None:
            assert self.service is not None and self.service_creds is not None
            procs = self.extra_agents = AgentProcesses(
                self.url, self.namespace, self.data / "agents-extra",
                service=self.service_creds, control=self.service_creds,
                datasets_root=self.datasets_root, roles=())
            self._stack.push_async_callback(procs.stop)
            await procs.start(self.service)
        if role not in procs.procs:
            procs.spawn(role)
        return True

    async def _supervise_actor(self, backbone: Any) -> None:
        """The actor, started again whenever it dies (what the health manager does),
        counting the restarts: a tenant's data must never cause one."""
        from joynexus.agents.actor.agent import Actor

        assert self.service is not None
        while not self._stop.is_set():
            self.actor = Actor(self.service, backbone, instance="actor",
                               out_dir=self.data / "actor", lease_wait_s=0.5)
            try:
                await self.actor.run(self._stop)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                assert self._actor_restarts is not None
                self._actor_restarts += 1
                self.actor_errors.append(f"{type(e).__name__}: {str(e)[:300]}")
                log.warning("isolation: the actor died (%s); starting it again", e)
                await asyncio.sleep(0.5)

    async def _stop_tasks(self) -> None:
        self._stop.set()
        _done, pending = await asyncio.wait(self._tasks, timeout=30) if self._tasks else ((), ())
        for t in pending:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _close_clients(self) -> None:
        for c in list(self.clients.values()):
            with contextlib.suppress(Exception):
                await c.close()
        self.clients.clear()

    # -------------------------------------------------------------- tenants
    async def issue(self, tenant: str, **quota: Any) -> Credentials:
        """Issue ``tenant`` its credentials (``quota``: Quota fields an operator sets)."""
        from joynexus.ops.admin.tenants import add_tenant

        kw: dict[str, Any] = {}
        if quota:
            from joynexus.schemas.quotas import Quota

            kw = _supported(add_tenant, quota=Quota(**quota))
        creds, reply = await add_tenant(self.admin, tenant, url=self.url, **kw)
        if reply.applied != "yes":
            raise JoyNexusError(f"tenant_add {tenant}: the server applied it? {reply.applied}")
        self.creds[tenant] = creds
        if kw:
            self.quotas[tenant] = quota
        return creds

    async def client(self, tenant: str) -> Client:
        """The tenant's SDK client (one per tenant, kept until the deployment ends)."""
        c = self.clients.get(tenant)
        if c is None:
            c = self.clients[tenant] = await Client.connect(credentials=self.creds[tenant])
        return c

    async def drop_client(self, tenant: str) -> None:
        """Forget (and close) the tenant's kept client: the server closed its connection
        (a pause, a revocation), so the next :meth:`client` connects afresh."""
        c = self.clients.pop(tenant, None)
        if c is not None:
            with contextlib.suppress(Exception):
                await c.close()

    async def raw(self, tenant: str) -> RawConn:
        """A bare nats-py connection with the tenant's credentials, collecting server errors."""
        creds = self.creds[tenant]
        return await self.raw_as(creds.user or "", creds.password or "",
                                 inbox_prefix=self.names.inbox_prefix(tenant))

    async def raw_as(self, user: str, password: str, *, inbox_prefix: str = "") -> RawConn:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        kw: dict[str, Any] = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
        nc = await nats.connect(self.url, user=user, password=password, error_cb=on_error,
                                max_reconnect_attempts=0, allow_reconnect=False,
                                connect_timeout=5, **kw)
        return RawConn(nc, errors)

    async def dataset(self, tenant: str, name: str = DATASET) -> str:
        """A dataset in ``tenant``'s dataset space; what its specs name it by."""
        path = self.datasets_root / tenant / name
        if not (path / "meta" / "info.json").is_file():
            if self._template is None:
                self._template = asyncio.create_task(asyncio.to_thread(self._make_template))
            template = await self._template
            path.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(shutil.copytree, template, path, dirs_exist_ok=True)
        return name if self.scoped_datasets else str(path)

    # -------------------------------------------------------------- observations
    async def metrics_seq(self) -> int:
        info = await self.admin.js.stream_info(self.names.metrics_stream)
        return int(info.state.last_seq)

    async def metrics_bytes(self) -> int:
        info = await self.admin.js.stream_info(self.names.metrics_stream)
        return int(info.state.bytes)

    async def security_events(self, tenant: str, after_seq: int = 0) -> list[dict[str, Any]]:
        """Every security event filed under ``tenant`` (stream sequence > ``after_seq``)."""
        sub = await self.admin.js.subscribe(
            self.names.metrics("security", tenant), ordered_consumer=True
        )
        out: list[dict[str, Any]] = []
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except (TimeoutError, nats.errors.TimeoutError):
                    return out
                seq = msg.metadata.sequence.stream
                if seq > after_seq:
                    try:
                        event = json.loads(msg.data)
                    except ValueError:
                        event = {"undecodable": msg.data[:200].decode("utf-8", "replace")}
                    event["_seq"], event["_bytes"] = seq, len(msg.data)
                    out.append(event)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def wait_security(
        self, tenant: str, pred: Callable[[dict[str, Any]], bool], what: str,
        within: float = 15.0, after_seq: int = 0,
    ) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + within
        while True:
            for e in await self.security_events(tenant, after_seq):
                if pred(e):
                    return e
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"no security event: {what}")
            await asyncio.sleep(0.2)

    def server_log(self) -> list[str]:
        """The embedded server's recent log lines (empty for an external server)."""
        server = getattr(self.ep, "server", None)
        return list(getattr(server, "_log", ()) or ())

    def cut_connections(self, before: list[str]) -> list[str]:
        """Server log lines since ``before`` that say it cut a client off (a slow
        consumer, a write deadline): a tenant's traffic must not cost an agent its
        connection."""
        seen = set(before)
        return [line for line in self.server_log() if line not in seen
                and ("slow consumer" in line.lower() or "write deadline" in line.lower())]

    async def consumers(self) -> int:
        """Consumers on the server's account (every JetStream consumer of every stream)."""
        return int((await self.admin.js.account_info()).consumers)
