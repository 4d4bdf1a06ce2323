"""No tenant can harm another: a live secured deployment, a victim, and the attack catalogue.

One catalogue, two users: the adversarial suite (``pytest -m adversarial``,
``tests/test_adversarial.py``) asserts every attack, and ``joynexus bench
isolation --json`` (``ops/bench_isolation.py``) reports them.

- :class:`Deployment`: a fresh embedded nats-server with authorization on (or
  an external one, ``url`` + admin credentials) with the agents in this
  process as the service identity (scheduler, control plane as the control
  identity, an inference engine on the tiny backbone, the actor under a
  supervisor that counts its restarts), the tenants' dataset spaces
  (``<datasets root>/<tenant>/<name>``), and helpers: issue a tenant, an SDK
  client, a raw nats-py connection with a tenant's credentials, the security
  events in the metrics stream.
- :class:`Victim`: tenant ``bolt`` trains a small SFT workload whose batches
  it submits itself (``source="tenant"``), and probes the service with cheap
  calls (``get_workload``, ``list_workloads``, ``latest_version``, ``act``)
  whose latencies give p50/p99 for a baseline window and for the window of an
  attack; it also says whether bolt's policy version advanced meanwhile.
- :data:`CATALOGUE`: :class:`Attack` ``(name, run)``; ``run(dep, attacker,
  victim)`` does the attack as tenant ``acme`` and checks its own effect
  precisely (the job stream was not purged, bolt's record still decodes, the
  consumer count stayed bounded...), returning :class:`AttackResult`.
  :func:`run_attack` wraps one in a baseline and an attack window.

The victim is fine when its calls all succeeded, its training advanced, no
security event was filed under it, and its p99 during the attack was within
:data:`P99_RATIO_BOUND` times its baseline's or under :data:`P99_ABS_BOUND_S`
(generous: a 2-core machine is noisy).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import numpy as np

from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.broker.subjects import Names, kv_subject, stream_api
from joynexus.schemas.base import decode
from joynexus.schemas.errors import JoyNexusError, PermissionDenied, error_from_code
from joynexus.schemas.jobs import JobState
from joynexus.schemas.workloads import (
    CONTENT_TYPE,
    MSGPACK,
    ApiReply,
    CloseJob,
    OpenJob,
    PutData,
    WorkloadRecord,
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
#: The victim is within bound when its p99 during an attack is at most this many
#: times its baseline p99, or at most this many seconds.
P99_RATIO_BOUND = 5.0
P99_ABS_BOUND_S = 1.5
#: Each probe call must answer within this (else it counts as failed).
CALL_TIMEOUT_S = 10.0
#: After an attack, how long the victim's training may take to show progress.
PROGRESS_GRACE_S = 30.0
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
    """Counts the bytes of the log records this process emits (warnings and up)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.bytes = 0

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.bytes += len(record.getMessage())


class Deployment:
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
        self.ep: Any = None
        self.admin: Broker = None  # type: ignore[assignment]
        self.service: Broker | None = None
        self.service_creds: Credentials | None = None
        self.creds: dict[str, Credentials] = {}
        #: The quota fields an operator set per tenant (when the service takes quotas).
        self.quotas: dict[str, dict[str, Any]] = {}
        self.clients: dict[str, Client] = {}
        #: The actor of this process: how often it died and was started again, and why.
        self.actor_restarts: int | None = None
        self.actor_errors: list[str] = []
        self.actor: Any = None
        self.scoped_datasets = True
        self.log_bytes = _LogBytes()
        self._stack = contextlib.AsyncExitStack()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._template: asyncio.Task[Path] | None = None

    # -------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> Deployment:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

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
        from joynexus.agents.models.backbone import Backbone, BackboneConfig
        from joynexus.agents.scheduler import SchedulerAgent
        from joynexus.agents.workloads import PolicyInitializer
        from joynexus.ops.deploy import embedded

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
        pool = EnginePool(self.service, backbone, max_batch=8, max_wait_ms=5)
        await pool.scale_to(1)
        st.push_async_callback(pool.close)
        self.actor_restarts = 0
        task = asyncio.create_task(self._supervise_actor(backbone))
        self._tasks.append(task)
        st.push_async_callback(self._stop_tasks)

    async def _supervise_actor(self, backbone: Any) -> None:
        """The actor, started again whenever it dies (what the health manager does),
        counting the restarts: a tenant's data must never cause one."""
        from joynexus.agents.actor import Actor

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
                assert self.actor_restarts is not None
                self.actor_restarts += 1
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
        from joynexus.ops.tenants import add_tenant

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


# ---------------------------------------------------------------- raw API calls
async def api_raw(
    client: Client, verb: str, body: Any, *, binary: bool = False, timeout_s: float = 30.0
) -> ApiReply:
    """One control plane request of ``client``'s tenant with a body built by hand
    (a dict: no client-side validation); raises the error the reply carries."""
    subject = client._b.names.api(client.tenant, verb)
    data = msgspec.msgpack.encode(body) if binary else msgspec.json.encode(body)
    headers = {CONTENT_TYPE: MSGPACK} if binary else None
    msg = await client._b.nc.request(subject, data, timeout=timeout_s, headers=headers)
    reply = decode(msg.data, ApiReply, what=f"reply to {verb}")
    if reply.error is not None:
        raise error_from_code(reply.error.code, reply.error.message)
    return reply


def infer_request(tenant: str, workload: str, signature: str, rows: int, *,
                  instruction: str = "pick the cube", claim: str | None = None) -> bytes:
    from joynexus.schemas.inference import InferRequest, Observation, TensorBytes, encode_msgpack

    obs = Observation(
        images={"base_camera": TensorBytes.from_array(np.zeros((rows, 3, 64, 64), np.uint8))},
        instruction=instruction,
        state=TensorBytes.from_array(np.zeros((rows, 12), np.float32)),
    )
    return encode_msgpack(InferRequest(tenant_id=claim or tenant, policy_key=workload,
                                       schema_signature=signature, observation=obs))


async def infer_raw(client: Client, payload: bytes, *, timeout_s: float = 15.0) -> Any:
    """One inference request on ``client``'s own subject: the reply (InferResult | InferError)."""
    from joynexus.schemas.inference import InferReply, decode_msgpack

    msg = await client._b.nc.request(client._b.names.infer(MODEL, client.tenant), payload,
                                     timeout=timeout_s)
    return decode_msgpack(msg.data, InferReply, what="inference reply")


async def _cancel(client: Client, name: str) -> None:
    with contextlib.suppress(Exception):
        await client.cancel_workload(name)


def _code(e: BaseException) -> str:
    return getattr(e, "code", type(e).__name__)


def _short(e: BaseException | str, n: int = 160) -> str:
    s = e if isinstance(e, str) else f"{_code(e)}: {e}"
    return s if len(s) <= n else s[:n] + "..."


# ---------------------------------------------------------------- the victim
@dataclass
class Stats:
    n: int = 0
    p50: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    errors: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, xs: list[float], errors: list[str]) -> Stats:
        if not xs:
            return cls(errors=errors)
        s = sorted(xs)
        return cls(n=len(s), p50=statistics.median(s),
                   p99=s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)], max=s[-1],
                   errors=errors)

    def brief(self) -> dict[str, Any]:
        return {"n": self.n, "p50_ms": round(self.p50 * 1000, 1),
                "p99_ms": round(self.p99 * 1000, 1), "errors": len(self.errors)}


class Victim:
    """Tenant ``bolt``: a small SFT workload it feeds itself, and a probe of cheap calls."""

    def __init__(self, dep: Deployment, tenant: str = VICTIM, workload: str = VICTIM_WORKLOAD):
        self.dep, self.tenant, self.workload = dep, tenant, workload
        self.client: Client = None  # type: ignore[assignment]
        self.feed_errors: list[str] = []
        self.submitted = 0
        self._feeder: asyncio.Task[None] | None = None

    async def start(self, *, within_s: float = 180.0) -> None:
        if self.tenant not in self.dep.creds:
            await self.dep.issue(self.tenant)
        self.client = await self.dep.client(self.tenant)
        ds = await self.dep.dataset(self.tenant)
        await self.client.create_workload(sft_spec(self.workload, ds))
        self._feeder = asyncio.create_task(self._feed())
        deadline = time.monotonic() + within_s
        while await self.client.latest_version(self.workload) < 2:  # one step trained
            if time.monotonic() > deadline:
                raise AssertionError(f"the victim's first job was not trained in {within_s}s "
                                     f"(feeder errors: {self.feed_errors[-3:]})")
            await asyncio.sleep(0.3)
        await self.act()  # the engine has loaded bolt's policy

    async def stop(self) -> None:
        if self._feeder is not None:
            self._feeder.cancel()
            with contextlib.suppress(BaseException):
                await self._feeder

    async def _feed(self) -> None:
        seed = 1000
        while True:
            try:
                await self.client.submit_sft_batch(self.workload, sft_batch(4, seed))
                self.submitted += 1
                await asyncio.sleep(0.3)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.feed_errors.append(_short(e))
                await asyncio.sleep(0.5)
            seed += 1

    async def act(self) -> np.ndarray:
        b = sft_batch(1, 0)
        return await self.client.act(self.workload, images={"base_camera": b[
            "obs_image_base_camera"]}, state=b["obs_state"], timeout_s=CALL_TIMEOUT_S)

    def _calls(self) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
        c, w = self.client, self.workload
        return [("get_workload", lambda: c.get_workload(w)), ("list_workloads", c.list_workloads),
                ("act", self.act), ("latest_version", lambda: c.latest_version(w))]

    async def _sample(self, stop: asyncio.Event, xs: list[float], errors: list[str]) -> None:
        calls = self._calls()
        i = 0
        while not stop.is_set():
            what, call = calls[i % len(calls)]
            i += 1
            t0 = time.perf_counter()
            try:
                await asyncio.wait_for(call(), CALL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                errors.append(f"{what}: {_short(e)}")
            xs.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)

    async def version(self) -> int:
        try:
            return await asyncio.wait_for(self.client.latest_version(self.workload),
                                          CALL_TIMEOUT_S)
        except Exception:
            return -1

    async def baseline(self, seconds: float = 2.0) -> Stats:
        xs: list[float] = []
        errors: list[str] = []
        stop = asyncio.Event()
        task = asyncio.create_task(self._sample(stop, xs, errors))
        await asyncio.sleep(seconds)
        stop.set()
        await task
        return Stats.of(xs, errors)

    async def during(
        self, attack: Awaitable[Any], *, min_s: float = 1.0
    ) -> tuple[Any, Stats, bool, float]:
        """Run ``attack`` while probing; (its result, the probe's stats, whether bolt's
        policy version advanced since the attack started, the attack's seconds)."""
        xs: list[float] = []
        errors: list[str] = []
        v0 = await self.version()
        stop = asyncio.Event()
        t0 = time.monotonic()
        task = asyncio.create_task(self._sample(stop, xs, errors))
        try:
            result = await attack
            left = min_s - (time.monotonic() - t0)
            if left > 0:
                await asyncio.sleep(left)
        finally:
            stop.set()
            await task
        took = time.monotonic() - t0
        deadline = time.monotonic() + PROGRESS_GRACE_S
        progressed = False
        while True:
            v = await self.version()
            if v > v0 >= 0:
                progressed = True
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        return result, Stats.of(xs, errors), progressed, round(took, 1)


# ---------------------------------------------------------------- attacks
@dataclass
class AttackResult:
    held: bool
    detail: str


@dataclass
class Attack:
    name: str
    run: Callable[[Deployment, str, str], Awaitable[AttackResult]]
    #: The issue's class ("What was observed" item) it belongs to, or "found".
    klass: str = ""
    timeout_s: float = 90.0
    #: Needs the agents in this process (their restarts, the service identity).
    in_process: bool = False


class Checks:
    """Named checks of one attack; the attack held when every one passed."""

    def __init__(self) -> None:
        self.items: list[tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, note: str = "") -> bool:
        self.items.append((name, bool(ok), note))
        return bool(ok)

    def result(self) -> AttackResult:
        failed = [f"{n}: {note}" if note else n for n, ok, note in self.items if not ok]
        passed = [n for n, ok, _ in self.items if ok]
        if failed:
            return AttackResult(False, "FAILED " + "; ".join(failed)
                                + (f" | held: {', '.join(passed)}" if passed else ""))
        notes = [f"{n} ({note})" if note else n for n, _, note in self.items]
        return AttackResult(True, "; ".join(notes))


async def refused(
    call: Awaitable[Any], codes: tuple[str, ...], *, mention: str = "", within_s: float = 10.0
) -> tuple[bool, str]:
    """Whether ``call`` fails with one of ``codes`` within ``within_s`` (an
    ``invalid_spec`` must name ``mention``, so a refusal for another reason is
    not taken for this one); and a note."""
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(call, within_s + 5)
    except JoyNexusError as e:
        took = time.perf_counter() - t0
        ok = e.code in codes and (e.code != "invalid_spec" or not mention or mention in str(e))
        return ok and took <= within_s, f"{_short(e, 120)} in {took:.2f}s"
    except TimeoutError:
        return False, f"no answer within {within_s + 5:.0f}s"
    except Exception as e:
        return False, f"unexpected {_short(e, 120)}"
    return False, "accepted"


async def _attacker_workload(dep: Deployment, attacker: str, name: str) -> tuple[Client, Any]:
    client = await dep.client(attacker)
    ds = await dep.dataset(attacker)
    wl = await client.create_workload(sft_spec(name, ds))
    return client, wl.record


# -- 1. reply subjects ---------------------------------------------------------
async def attack_reply_subject(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """Ordinary requests on the attacker's own subjects, with reply subjects that
    name the JetStream API, another tenant's records, a forged security event,
    the identities bucket and another tenant's inbox."""
    n, js, ck = dep.names, dep.admin.js, Checks()
    client, rec = await _attacker_workload(dep, attacker, "reply-probe")
    vclient = await dep.client(victim)
    vkey = n.workload_key(victim, VICTIM_WORKLOAD)
    wkv = await js.key_value(n.workloads_bucket)
    pkv = await js.key_value(n.policy_bucket)
    ikv = await js.key_value(n.identities_bucket)
    jobs0 = (await js.stream_info(n.jobs_stream)).state
    tq0 = await js.stream_info(n.tq_stream)
    wrev0 = (await wkv.get(vkey)).revision
    seq0 = await dep.metrics_seq()
    # bolt listens on its own inbox: nothing of acme's may arrive there.
    vraw = await dep.raw(victim)
    inbox_msgs: list[Any] = []
    victim_inbox = f"{n.inbox_prefix(victim)}.x"

    async def on_inbox(msg: Any) -> None:
        inbox_msgs.append(msg)

    await vraw.nc.subscribe(victim_inbox, cb=on_inbox)  # exactly the target, not bolt's own
    await vraw.nc.flush()
    targets = [
        stream_api("PURGE", n.jobs_stream),
        stream_api("DELETE", n.tq_stream),
        kv_subject(n.workloads_bucket, vkey),
        kv_subject(n.policy_bucket, n.policy_key(victim, VICTIM_WORKLOAD)),
        n.metrics("security", victim),
        kv_subject(n.identities_bucket, "evil"),
        victim_inbox,
    ]
    raw = await dep.raw(attacker)
    try:
        # The inference engine has acme's policy loaded (a real request first).
        ok = await infer_raw(client, infer_request(attacker, "reply-probe",
                                                   rec.schema_signature, 1))
        ck.add("acme's own request answered", hasattr(ok, "actions"), type(ok).__name__)
        for t in targets:
            await raw.nc.publish(n.api(attacker, "list_workloads"), b"{}", reply=t)
            await raw.nc.publish(n.api(attacker, "get_workload"),
                                 b'{"name": "reply-probe"}', reply=t)
        await raw.nc.flush()
        await asyncio.sleep(1.5)
        seq_mid = await dep.metrics_seq()
        api_events = [e for e in await dep.security_events(attacker, seq0)
                      if e.get("action") == "reply"]
        ck.add("control plane reported a reply event", bool(api_events),
               f"{len(api_events)} events")
        payload = infer_request(attacker, "reply-probe", rec.schema_signature, 1)
        for t in targets:
            await raw.nc.publish(n.infer(MODEL, attacker), payload, reply=t)
        await raw.nc.flush()
        await asyncio.sleep(1.5)
        inf_events = [e for e in await dep.security_events(attacker, seq_mid)
                      if e.get("action") == "reply"]
        ck.add("inference engine reported a reply event", bool(inf_events),
               f"{len(inf_events)} events")
    finally:
        await raw.close()
    # Effects, each checked where it would show.
    try:
        jobs1 = (await js.stream_info(n.jobs_stream)).state
        ck.add("job log not purged", jobs1.first_seq == jobs0.first_seq
               and jobs1.messages >= jobs0.messages,
               f"messages {jobs0.messages} -> {jobs1.messages}")
    except Exception as e:
        ck.add("job log not purged", False, _short(e))
    try:
        tq1 = await js.stream_info(n.tq_stream)
        ck.add("TQ stream not deleted", tq1.created == tq0.created)
    except Exception as e:
        ck.add("TQ stream not deleted", False, _short(e))
    try:
        entry = await wkv.get(vkey)
        decode(entry.value or b"", WorkloadRecord)
        ck.add("bolt's workload record intact", entry.revision == wrev0,
               f"revision {wrev0} -> {entry.revision}")
    except Exception as e:
        ck.add("bolt's workload record intact", False, _short(e))
    try:
        from joynexus.schemas.inference import PolicyRecord

        hist = await pkv.history(n.policy_key(victim, VICTIM_WORKLOAD))
        for h in hist:
            if h.value:
                decode(h.value, PolicyRecord)
        await vclient.latest_version(VICTIM_WORKLOAD)
        await vclient.get_workload(VICTIM_WORKLOAD)
        ck.add("bolt's policy records decode", True, f"{len(hist)} revisions")
    except Exception as e:
        ck.add("bolt's policy records decode", False, _short(e))
    forged = await dep.security_events(victim, seq0)
    ck.add("no event filed under bolt", not forged, f"{len(forged)} events")
    try:
        await ikv.get("evil")
        ck.add("no identity 'evil' written", False, "the key exists")
    except Exception:
        ck.add("no identity 'evil' written", True)
    await vraw.close()
    ck.add("nothing reached bolt's inbox", not inbox_msgs, f"{len(inbox_msgs)} messages")
    await _cancel(client, "reply-probe")
    if not all(ok for _, ok, _ in ck.items):  # repair what a failed attack broke
        from joynexus.broker.layout import ensure_layout

        with contextlib.suppress(Exception):
            await ensure_layout(dep.admin)
    return ck.result()


# -- 2. revocation after a bad record -----------------------------------------
async def attack_bad_identity_record(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """Garbage and a record whose key does not match its user in the identities
    bucket; then a tenant added and removed must still be applied."""
    from joynexus.broker.permissions import hash_password
    from joynexus.ops.tenants import add_tenant, remove_tenant
    from joynexus.schemas.base import encode
    from joynexus.schemas.identities import TenantIdentity

    n, ck = dep.names, Checks()
    ikv = await dep.admin.js.key_value(n.identities_bucket)
    pw = "let-me-in-" + secrets.token_hex(4)
    forged = TenantIdentity(tenant_id="mallory", user=n.tenant_user(victim),
                            password_hash=await asyncio.to_thread(hash_password, pw))
    bad_keys = {"aaa-garbage": b"\x00not json{", "mallory": encode(forged),
                "zzz-wrongtype": b'{"tenant_id": 5, "user": [], "password_hash": null}'}
    for k, v in bad_keys.items():
        await ikv.put(k, v)
    newbie = "tom" + secrets.token_hex(2)
    try:
        creds, reply = await add_tenant(dep.admin, newbie, url=dep.url)
        ck.add("tenant add applied", reply.applied == "yes", reply.applied)
        c = await Client.connect(credentials=creds)
        try:
            await c.list_workloads()
            ck.add("new tenant connects", True)
            reply = await remove_tenant(dep.admin, newbie)
            ck.add("tenant rm applied", reply.applied == "yes", reply.applied)
            revoked = False
            for _ in range(50):
                try:
                    await c.list_workloads()
                except PermissionDenied:
                    revoked = True
                    break
                except Exception:
                    pass
                await asyncio.sleep(0.1)
            ck.add("live connection revoked", revoked)
        finally:
            with contextlib.suppress(Exception):
                await c.close()
        try:
            c2 = await Client.connect(credentials=creds)
            await c2.close()
            ck.add("revoked credentials refused", False, "connected")
        except PermissionDenied:
            ck.add("revoked credentials refused", True)
        try:
            r = await dep.raw_as(n.tenant_user(victim), pw)
            await r.close()
            ck.add("mismatched record gives no login as bolt", False, "connected as jnx.bolt")
        except Exception:
            ck.add("mismatched record gives no login as bolt", True)
    except Exception as e:
        ck.add("add/rm with bad records present", False, _short(e))
    finally:
        for k in bad_keys:
            with contextlib.suppress(Exception):
                await ikv.purge(k)
    return ck.result()


# -- 3. per-call server resources ----------------------------------------------
async def attack_request_flood(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """2,000 fire-and-forget list_workloads / failing create_workload requests."""
    n, ck = dep.names, Checks()
    await dep.client(attacker)
    raw = await dep.raw(attacker)
    codes: dict[str, int] = {}
    replies = 0
    done = asyncio.Event()
    total = 2000

    async def on_reply(msg: Any) -> None:
        nonlocal replies
        replies += 1
        try:
            r = decode(msg.data, ApiReply)
            code = r.error.code if r.error else "ok"
        except Exception:
            code = "undecodable"
        codes[code] = codes.get(code, 0) + 1
        if replies >= total:
            done.set()

    prefix = n.inbox_prefix(attacker)
    log0 = dep.server_log()
    await raw.nc.subscribe(f"{prefix}.flood.>", cb=on_reply, pending_msgs_limit=100_000)
    start = await dep.consumers()
    peak = start
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            with contextlib.suppress(Exception):
                peak = max(peak, await dep.consumers())
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    bad_create = msgspec.json.encode(
        {"spec": {"name": "flood", "task_type": "sft", "dataset": "no-such-dataset"}}
    )
    try:
        for i in range(total):
            verb, body = ("list_workloads", b"{}") if i % 2 else ("create_workload", bad_create)
            await raw.nc.publish(n.api(attacker, verb), body, reply=f"{prefix}.flood.{i}")
        await raw.nc.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 45)
        await asyncio.sleep(0.5)
    finally:
        sampling = False
        await sampler
        await raw.close()
    ck.add("consumers bounded", peak - start < 50, f"{start} -> peak {peak}")
    ck.add("excess refused as rate_limited", codes.get("rate_limited", 0) > 0,
           f"replies {replies}/{total}: {dict(sorted(codes.items()))}")
    other = {k: v for k, v in codes.items() if k not in ("ok", "rate_limited", "invalid_spec")}
    ck.add("no other errors", not other, str(other))
    cut = dep.cut_connections(log0)
    ck.add("no agent connection cut off", not cut, " | ".join(c[-160:] for c in cut[:2]))
    vclient = await dep.client(victim)
    try:
        await asyncio.wait_for(vclient.list_workloads(), CALL_TIMEOUT_S)
        ck.add("bolt's calls work after", True)
    except Exception as e:
        ck.add("bolt's calls work after", False, _short(e))
    return ck.result()


# -- 4. NaN batches --------------------------------------------------------------
def _nan_batches() -> dict[str, dict[str, np.ndarray]]:
    nan_actions = sft_batch(4, 7)
    nan_actions["actions"][1, 0, 2] = np.nan
    inf_state = sft_batch(4, 8)
    inf_state["obs_state"][0, 3] = np.inf
    huge = sft_batch(4, 9)
    huge["actions"][:] = np.float32(3e38)
    return {"nan actions": nan_actions, "inf state": inf_state, "3e38 actions": huge}


async def attack_nan_batch(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """SFT batches with NaN / inf / overflowing values, through the SDK and by hand."""
    from joynexus.schemas.inference import TensorBytes

    ck = Checks()
    restarts0 = dep.actor_restarts
    client, _ = await _attacker_workload(dep, attacker, "nan-sft")
    try:
        batches = _nan_batches()
        ok, note = await refused(client.submit_sft_batch("nan-sft", batches["nan actions"]),
                                 ("invalid_spec",))
        ck.add("SDK submit refused", ok, note)
        for what, b in batches.items():  # past any client-side check: the door itself
            if what == "3e38 actions":
                continue  # finite: whether it is in range is the schema's call (below)
            opened = await client._api("open_job", OpenJob(workload="nan-sft", sample_count=4))
            if opened.job is None:
                ck.add(f"{what}: open_job", False, opened.refused)
                continue
            fields = {k: TensorBytes.from_array(v) for k, v in b.items()}
            ok, note = await refused(
                client._api("put_data", PutData(job_id=opened.job.job_id, fields=fields),
                            binary=True), ("invalid_spec",))
            ck.add(f"{what}: put_data refused", ok, note)
            with contextlib.suppress(Exception):
                await client._api("close_job", CloseJob(job_id=opened.job.job_id))
        await asyncio.sleep(2.0)
        if dep.service is not None:
            from joynexus.agents.scheduler_client import SchedulerClient

            jobs = await SchedulerClient(dep.service, by="iso").list_jobs(
                attacker, policy_key="nan-sft")
            trained = [j.job_id for j in jobs if j.state in (
                JobState.READY, JobState.LEASED, JobState.COMPLETED)]
            ck.add("no NaN job reached training", not trained,
                   f"{len(jobs)} jobs: {sorted({j.state.value for j in jobs})}")
        if restarts0 is not None:
            ck.add("actor not restarted", dep.actor_restarts == restarts0,
                   f"restarts {restarts0} -> {dep.actor_restarts}: {dep.actor_errors[-1:]}")
    finally:
        await _cancel(client, "nan-sft")
    return ck.result()


async def attack_nan_in_step(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """Rows that passed the door and still break a grouped step (written into the
    Training Queue by the service itself, as a producer bug would): only the
    attacker's job fails, with the reason; the actor goes on."""
    from joynexus.agents.scheduler_client import SchedulerClient
    from joynexus.broker.tq import TrainingQueue
    from joynexus.schemas.jobs import JobMetadata

    ck = Checks()
    assert dep.service is not None
    restarts0 = dep.actor_restarts
    client, rec = await _attacker_workload(dep, attacker, "nan-step")
    sched = SchedulerClient(dep.service, by="iso-producer")
    try:
        job = await sched.reserve(
            attacker, "sft", policy_key="nan-step", sample_count=4, producer_role="iso",
            metadata=JobMetadata(schema_signature=rec.schema_signature,
                                 extra={"instruction": "pick the cube"}),
        )
        if job is None:
            ck.add("reserve", False, sched.last_refusal)
            return ck.result()
        data = sft_batch(4, 11)
        data["actions"][:] = np.nan
        await TrainingQueue(dep.service).async_put(data, tenant_id=attacker,
                                                   partition_id=job.partition_id)
        await sched.mark(job.job_id, JobState.READY)
        deadline = time.monotonic() + 40
        state = job
        while time.monotonic() < deadline:
            state = await sched.get_job(job.job_id)
            if state.state in (JobState.FAILED, JobState.COMPLETED, JobState.DROPPED):
                break
            await asyncio.sleep(0.3)
        ck.add("the attacker's job failed", state.state is JobState.FAILED,
               f"{state.state.value}: {state.reason[:100]}")
        ck.add("actor not restarted", dep.actor_restarts == restarts0,
               f"restarts {restarts0} -> {dep.actor_restarts}: {dep.actor_errors[-1:]}")
        v = await client.latest_version("nan-step")
        ck.add("no NaN version published", v == 1, f"latest v{v}")
    finally:
        await _cancel(client, "nan-step")
    return ck.result()


# -- 5. another tenant's dataset --------------------------------------------------
async def attack_foreign_dataset(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """SFT workloads naming the victim's dataset (relative, absolute, via symlinks),
    system files and missing paths: one refusal, revealing nothing."""
    ck = Checks()
    client = await dep.client(attacker)
    own = await dep.dataset(attacker)
    await dep.dataset(victim)
    root = dep.datasets_root.resolve()
    vpath = root / victim / DATASET
    space = root / attacker
    with contextlib.suppress(FileExistsError):
        (space / "link").symlink_to(vpath, target_is_directory=True)
    (space / "meta-link").mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (space / "meta-link" / "meta").symlink_to(vpath / "meta", target_is_directory=True)
    try:  # a control: acme's own dataset is accepted (so the refusals are about paths)
        await client.create_workload(sft_spec("ds-own", own))
        ck.add("own dataset accepted", True)
    except Exception as e:
        ck.add("own dataset accepted", False, _short(e))
    await _cancel(client, "ds-own")
    names = [f"../{victim}/{DATASET}", str(vpath), f"../{victim}/nothere", "/etc/passwd",
             "/nonexistent-jnx/x", "link", "meta-link", f"{DATASET}/../../{victim}/{DATASET}"]
    messages: dict[str, str] = {}
    for i, name in enumerate(names):
        body = {"spec": {"name": f"ds-{i}", "task_type": "sft", "dataset": name,
                         "source": "tenant", "action_horizon": 2}}
        try:
            await asyncio.wait_for(api_raw(client, "create_workload", body), 20)
            messages[name] = "ACCEPTED"
            await _cancel(client, f"ds-{i}")
        except JoyNexusError as e:
            messages[name] = f"{e.code}: {e}".replace(name, "<NAME>")
        except Exception as e:
            messages[name] = f"unexpected {_short(e)}"
    distinct = set(messages.values())
    ck.add("all refused", all(m.startswith("invalid_spec") for m in messages.values()),
           "; ".join(f"{k}: {v[:60]}" for k, v in messages.items()
                     if not v.startswith("invalid_spec")))
    ck.add("one message for all", len(distinct) == 1, f"{len(distinct)} distinct: "
           + " | ".join(sorted(m[:90] for m in distinct)))
    leaks = [m for m in distinct if str(root) in m or victim in m or "root:" in m]
    ck.add("no path, file content or tenant of bolt's shown", not leaks,
           " | ".join(m[:120] for m in leaks))
    return ck.result()


# -- 6. quotas and operator bounds ---------------------------------------------------
async def attack_quotas(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """Training Queue bytes, priority, max_in_flight, episodes, action_horizon,
    inference rows and instruction size: past every bound, refused quickly."""
    from joynexus.schemas.inference import InferError, TensorBytes
    from joynexus.schemas.quotas import PRIORITY_CLASSES

    ck = Checks()
    client = await dep.client(attacker)
    ds = await dep.dataset(attacker)
    base = {"task_type": "sft", "dataset": ds, "source": "tenant", "action_horizon": 2}
    quota_codes = ("quota_exceeded", "invalid_spec")

    async def create(name: str, **over: Any) -> Any:
        spec = {"name": name, **base, **over}
        return await api_raw(client, "create_workload", {"spec": spec})

    # priority: not the tenant's to set (refused, or replaced by its class's value)
    try:
        await create("q-prio", scheduling={"priority": 10**18})
        pol = [p for p in (await _sched_snapshot(dep)).policies
               if p.tenant_id == attacker and p.task_type == "sft"]
        want = PRIORITY_CLASSES["standard"]
        ck.add("priority 10**18 not honoured", bool(pol) and pol[0].priority == want,
               f"effective {pol[0].priority if pol else '?'} (class value {want})")
    except JoyNexusError as e:
        ck.add("priority 10**18 not honoured", e.code in quota_codes, _short(e, 100))
    await _cancel(client, "q-prio")
    for what, name, over, mention in (
        ("max_in_flight=10**9", "q-inflight", {"scheduling": {"max_in_flight": 10**9}},
         "max_in_flight"),
        ("action_horizon=250000", "q-horizon", {"action_horizon": 250_000}, "action_horizon"),
    ):
        ok, note = await refused(create(name, **over), quota_codes, mention=mention,
                                 within_s=5.0)
        ck.add(f"{what} refused", ok, note)
        await _cancel(client, name)
    # evaluation episodes (of a policy acme owns)
    await create("q-base")
    await _cancel(client, "q-base")
    ok, note = await refused(api_raw(client, "create_workload", {"spec": {
        "name": "q-eval", "task_type": "eval", "env": "PickCube-v1",
        "init_from_workload": "q-base", "init_from": 1, "episodes": 10**9}}),
        quota_codes, mention="episodes", within_s=20.0)
    ck.add("episodes=10**9 refused", ok, note)
    await _cancel(client, "q-eval")
    # inference: rows and instruction bytes per request
    rec = (await create("q-infer")).workload
    row_bytes = 3 * 64 * 64 + 12 * 4
    rows = min(10_000, int(client._b.max_payload * 0.9) // row_bytes)
    for what, payload in (
        (f"inference with {rows} rows", infer_request(attacker, "q-infer",
                                                      rec.schema_signature, rows)),
        ("instruction near max_payload", infer_request(
            attacker, "q-infer", rec.schema_signature, 1,
            instruction="a" * (client._b.max_payload - 64 * 1024))),
    ):
        t0 = time.perf_counter()
        try:
            got = await asyncio.gather(*(infer_raw(client, payload, timeout_s=10)
                                         for _ in range(3)))
            took = time.perf_counter() - t0
            errs = [g for g in got if isinstance(g, InferError)]
            ok = len(errs) == 3 and all(g.code in ("quota_exceeded", "invalid_spec",
                                                   "payload_too_large") for g in errs)
            ck.add(f"{what} refused", ok and took < 5.0,
                   f"{[g.code if isinstance(g, InferError) else 'served' for g in got]}"
                   f" in {took:.2f}s")
        except Exception as e:
            ck.add(f"{what} refused", False, _short(e))
    await _cancel(client, "q-infer")
    # Training Queue bytes: open jobs (as many as admission lets in flight) and fill
    # them until the quota says no.
    await create("q-tq", scheduling={"max_in_flight": 16})
    quota = int(dep.quotas.get(attacker, {}).get("tq_bytes", 256 * MiB))
    pushed, opened, stop_reason = 0, [], ""
    chunk = sft_batch(480, 3)
    fields = {k: TensorBytes.from_array(v) for k, v in chunk.items()}
    chunk_bytes = sum(v.nbytes for v in chunk.values())
    t0 = time.perf_counter()
    try:
        while pushed <= quota + 4 * chunk_bytes and time.perf_counter() - t0 < 90:
            try:
                r = await client._api("open_job", OpenJob(workload="q-tq", sample_count=480))
            except JoyNexusError as e:
                stop_reason = f"open_job: {_short(e, 100)}"
                break
            if r.job is None:
                stop_reason = f"open_job refused by admission: {r.refused[:80]}"
                break
            opened.append(r.job.job_id)
            try:
                await client._api("put_data", PutData(job_id=r.job.job_id, fields=fields),
                                  binary=True)
                pushed += chunk_bytes
            except JoyNexusError as e:
                stop_reason = f"put_data: {_short(e, 100)}"
                break
        ck.add("TQ bytes past the quota refused", "quota_exceeded" in stop_reason,
               f"pushed {pushed / MiB:.0f} MiB (quota {quota / MiB:.0f} MiB); "
               f"{stop_reason or 'never refused'}")
        vclient = await dep.client(victim)
        try:
            await asyncio.wait_for(vclient.submit_sft_batch(VICTIM_WORKLOAD, sft_batch(4, 77)),
                                   30)
            ck.add("bolt's submit succeeds meanwhile", True)
        except Exception as e:
            ck.add("bolt's submit succeeds meanwhile", False, _short(e))
    finally:
        for job_id in opened:
            with contextlib.suppress(Exception):
                await client._api("abort_job", CloseJob(job_id=job_id, reason="quota attack"))
        await _cancel(client, "q-tq")
    return ck.result()


async def _sched_snapshot(dep: Deployment) -> Any:
    from joynexus.agents.scheduler_client import SchedulerClient

    b = dep.service or dep.admin
    return await SchedulerClient(b, by="iso").snapshot()


# -- 7. bounded strings, failed logins, the operator's inbox --------------------------
async def attack_long_strings(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """200 requests carrying 1 MB strings where names go (a claimed tenant, a
    workload name, a job id, a subject token): the metrics stream, the security
    events and the log grow by little."""
    n, ck = dep.names, Checks()
    client, rec = await _attacker_workload(dep, attacker, "long-probe")
    big = "x" * MiB
    bytes0, seq0, logs0 = await dep.metrics_bytes(), await dep.metrics_seq(), dep.log_bytes.bytes
    log0 = dep.server_log()
    claim = infer_request(attacker, "long-probe", rec.schema_signature, 1, claim=victim + big)
    try:
        raw = await dep.raw(attacker)
        try:
            for i in range(190):
                if i % 3 == 0:
                    await raw.nc.publish(n.infer(MODEL, attacker), claim,
                                         reply=raw.nc.new_inbox())
                elif i % 3 == 1:
                    await raw.nc.publish(n.api(attacker, "get_workload"),
                                         msgspec.json.encode({"name": big}),
                                         reply=raw.nc.new_inbox())
                else:
                    await raw.nc.publish(n.api(attacker, "close_job"),
                                         msgspec.json.encode({"job_id": big}),
                                         reply=raw.nc.new_inbox())
                if i % 20 == 19:
                    await raw.nc.flush()
            await raw.nc.flush()
        finally:
            await raw.close()
        refused_subjects = 0
        for _ in range(10):  # a 1 MB subject token: one connection each (the server drops it)
            try:
                r = await dep.raw(attacker)
                with contextlib.suppress(Exception):
                    await r.nc.publish(n.api(attacker, "v" * MiB), b"{}")
                    await r.nc.flush(timeout=2)
                refused_subjects += 1
                await r.close()
            except Exception:
                refused_subjects += 1
        await asyncio.sleep(3.0)
        grew = await dep.metrics_bytes() - bytes0
        ck.add("metrics stream grew < 2 MB", grew < 2 * MiB, f"+{grew / 1024:.0f} KiB")
        events = await dep.security_events(attacker, seq0)
        biggest = max((e["_bytes"] for e in events), default=0)
        ck.add("security events bounded", biggest < 16 * 1024,
               f"{len(events)} events, largest {biggest} B")
        logs = dep.log_bytes.bytes - logs0
        ck.add("log grew < 2 MB", logs < 2 * MiB, f"+{logs / 1024:.0f} KiB")
        vev = await dep.security_events(victim, seq0)
        ck.add("nothing filed under bolt", not vev, f"{len(vev)} events")
        cut = dep.cut_connections(log0)
        ck.add("no agent connection cut off", not cut, " | ".join(c[-160:] for c in cut[:2]))
    finally:
        await _cancel(client, "long-probe")
    return ck.result()


async def attack_failed_logins(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """50 wrong-password logins as the victim's user: not filed as the victim's misdeeds."""
    ck = Checks()
    seq0 = await dep.metrics_seq()
    user = dep.names.tenant_user(victim)
    refused_n = 0
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal refused_n
        try:
            r = await dep.raw_as(user, f"wrong-{i}")
            await r.close()
        except Exception:
            refused_n += 1

    for k in range(0, 50, 10):
        await asyncio.gather(*(one(i) for i in range(k, k + 10)))
    took = time.perf_counter() - t0
    ck.add("all refused", refused_n == 50, f"{refused_n}/50 in {took:.1f}s")
    await asyncio.sleep(3.0)
    vev = await dep.security_events(victim, seq0)
    ck.add("none filed as bolt's", not vev,
           f"{len(vev)} events: {[e.get('action') for e in vev[:3]]}")
    return ck.result()


async def attack_service_reads_admin_inbox(
    dep: Deployment, attacker: str, victim: str
) -> AttackResult:
    """The service identity subscribes to the operator API's reply inbox."""
    from joynexus.ops.tenants import list_tenants

    ck = Checks()
    svc = dep.service_creds
    if svc is None:
        return AttackResult(False, "no service credentials to try with")
    prefix = dep.names.admin_inbox_prefix
    r = await dep.raw_as(svc.user or "", svc.password or "")
    got: list[Any] = []

    async def on_msg(msg: Any) -> None:
        got.append(msg)

    try:
        await r.nc.subscribe(f"{prefix}.>", cb=on_msg)
        await r.nc.flush()
        await list_tenants(dep.admin)  # an operator request: its reply goes to that inbox
        for _ in range(50):  # the server's error arrives asynchronously
            if r.saw("permissions violation"):
                break
            await asyncio.sleep(0.1)
        ck.add("subscription refused", r.saw("permissions violation"),
               "; ".join(e[:100] for e in r.errors[:2]) or "no error from the server")
        ck.add("no operator reply read", not got, f"{len(got)} messages")
    finally:
        await r.close()
    return ck.result()


# -- found: non-finite waits, hostile bodies -------------------------------------
async def attack_non_finite_wait(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """read_events with wait_s NaN (msgpack carries it): answered, not parked forever."""
    ck = Checks()
    client = await dep.client(attacker)
    for what, wait in (("NaN", float("nan")), ("-inf", float("-inf"))):
        t0 = time.perf_counter()
        try:
            await api_raw(client, "read_events",
                          {"after_seq": 10**12, "limit": 10, "wait_s": wait},
                          binary=True, timeout_s=25)
            ck.add(f"wait_s={what} answered", True, f"{time.perf_counter() - t0:.1f}s")
        except JoyNexusError as e:
            ck.add(f"wait_s={what} answered", e.code != "error",
                   f"{_short(e, 80)} in {time.perf_counter() - t0:.1f}s")
        except Exception as e:
            ck.add(f"wait_s={what} answered", False, _short(e, 80))
    return ck.result()


HOSTILE_BODIES: tuple[tuple[str, bytes, bool], ...] = (
    ("empty object", b"{}", False),  # every field at its default (an empty name...)
    ("not json", b"\xff\xfe{", False),
    ("a list", b"[1, 2]", False),
    ("wrong types", b'{"name": {"$gt": ""}, "job_id": 5, "workload": [], "spec": "x"}', False),
    ("deep nesting", b"[" * 5000 + b"]" * 5000, False),
    ("msgpack garbage", b"\xc1\xc1\xc1", True),
    ("huge numbers", b'{"after_seq": 1e400, "limit": -99999999999999999999, '
                     b'"offset": -5, "sample_count": 1e300}', False),
)


async def attack_hostile_bodies(dep: Deployment, attacker: str, victim: str) -> AttackResult:
    """Malformed bodies on every API verb: each a clear error, never an internal one."""
    from joynexus.agents.control import VERBS

    n, ck = dep.names, Checks()
    client = await dep.client(attacker)
    bad: list[str] = []
    count = 0
    for verb in VERBS:
        for what, body, binary in HOSTILE_BODIES:
            count += 1
            headers = {CONTENT_TYPE: MSGPACK} if binary else None
            try:
                msg = await client._b.nc.request(n.api(attacker, verb), body, timeout=10,
                                                 headers=headers)
                r = decode(msg.data, ApiReply)
                if r.error is None:
                    if what not in ("empty object", "a list", "wrong types", "huge numbers"):
                        bad.append(f"{verb}/{what}: accepted")
                elif r.error.code == "error" or "internal error" in r.error.message \
                        or "Traceback" in r.error.message:
                    bad.append(f"{verb}/{what}: {r.error.message[:80]}")
            except Exception as e:
                bad.append(f"{verb}/{what}: {_short(e, 60)}")
    ck.add("every hostile body refused clearly", not bad,
           f"{len(bad)}/{count}: " + "; ".join(bad[:4]))
    return ck.result()


CATALOGUE: list[Attack] = [
    Attack("request_flood", attack_request_flood, "3: per-call server resources", 120),
    Attack("nan_batch", attack_nan_batch, "4: a bad batch takes the actor down", 60),
    Attack("nan_in_step", attack_nan_in_step, "4: a bad batch takes the actor down", 60,
           in_process=True),
    Attack("foreign_dataset", attack_foreign_dataset, "5: reads other tenants' files", 90),
    Attack("quotas", attack_quotas, "6: no quotas, no operator bounds", 150),
    Attack("long_strings", attack_long_strings, "7: unbounded strings", 60),
    Attack("failed_logins", attack_failed_logins, "7: failed logins filed as the victim's", 60),
    Attack("service_reads_admin_inbox", attack_service_reads_admin_inbox,
           "7: the service reads the operator's replies", 30),
    Attack("non_finite_wait", attack_non_finite_wait, "7: a non-finite wait_s parks", 60),
    Attack("hostile_bodies", attack_hostile_bodies, "7: internal errors on hostile input", 60),
    Attack("bad_identity_record", attack_bad_identity_record, "2: revocation stops silently", 60),
    # Last: when it does not hold it purges the job log and deletes streams.
    Attack("reply_subject", attack_reply_subject, "1: replies to any subject", 60),
]
BY_NAME = {a.name: a for a in CATALOGUE}


# ---------------------------------------------------------------- one attack, measured
@dataclass
class Outcome:
    name: str
    klass: str
    held: bool
    detail: str
    baseline: Stats
    during: Stats
    progressed: bool
    seconds: float
    victim_events: int = 0

    @property
    def p50_ratio(self) -> float:
        return round(self.during.p50 / self.baseline.p50, 2) if self.baseline.p50 else 0.0

    @property
    def p99_ratio(self) -> float:
        return round(self.during.p99 / self.baseline.p99, 2) if self.baseline.p99 else 0.0

    @property
    def within_bound(self) -> bool:
        return self.during.p99 <= max(P99_RATIO_BOUND * self.baseline.p99, P99_ABS_BOUND_S)

    @property
    def victim_ok(self) -> bool:
        return (self.progressed and self.within_bound and not self.during.errors
                and not self.victim_events)

    def victim_detail(self) -> str:
        return (f"victim: baseline {self.baseline.brief()}, during {self.during.brief()}, "
                f"p99 ratio {self.p99_ratio} (bound {P99_RATIO_BOUND}x or "
                f"{P99_ABS_BOUND_S}s), progressed={self.progressed}, "
                f"security events under it {self.victim_events}, "
                f"errors {self.during.errors[:3]}")

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name, "class": self.klass, "held": self.held,
            "victim_ok": self.victim_ok,
            "victim_p50_ratio": self.p50_ratio, "victim_p99_ratio": self.p99_ratio,
            "victim_p99_ms": round(self.during.p99 * 1000, 1),
            "baseline_p99_ms": round(self.baseline.p99 * 1000, 1),
            "victim_errors": len(self.during.errors),
            "victim_error_sample": self.during.errors[:3],
            "victim_progressed": self.progressed, "seconds": self.seconds,
            "detail": self.detail,
        }


async def run_attack(
    dep: Deployment, victim: Victim, attack: Attack, *, attacker: str = ATTACKER,
    baseline_s: float = 2.0,
) -> Outcome:
    """A baseline window of the victim, then the attack with the victim probed."""
    base = await victim.baseline(baseline_s)
    seq0 = await dep.metrics_seq()

    async def go() -> AttackResult:
        try:
            return await asyncio.wait_for(attack.run(dep, attacker, victim.tenant),
                                          attack.timeout_s)
        except TimeoutError:
            return AttackResult(False, f"the attack did not finish within {attack.timeout_s}s")
        except Exception as e:
            log.exception("attack %s raised", attack.name)
            return AttackResult(False, f"the attack raised {type(e).__name__}: {str(e)[:300]}")

    result, during, progressed, took = await victim.during(go())
    victim_events = len(await dep.security_events(victim.tenant, seq0))
    return Outcome(attack.name, attack.klass, result.held, result.detail, base, during,
                   progressed, took, victim_events)


async def prepare(dep: Deployment) -> Victim:
    """The tenants (the attacker with an operator-set Training Queue quota) and the
    victim's workload trained once."""
    await dep.issue(ATTACKER, tq_bytes=ATTACKER_TQ_BYTES)
    victim = Victim(dep)
    await victim.start()
    return victim
