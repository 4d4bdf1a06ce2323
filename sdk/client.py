"""The tenant's client: declare workloads, watch their jobs, fetch policies.

Everything goes over NATS with the tenant's own identity: API calls are
requests on ``<ns>.api.<tenant>.<verb>`` (the control plane takes the tenant
from the subject), job events are read from the tenant's own subjects of the
job event log. Methods that talk to the service return futures: ``await``
them in async code, or use :class:`joynexus.sdk.SyncClient`, whose futures
have a blocking ``.result()``.

This module needs only the base install (no torch).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DeliverPolicy

from joynexus.broker import tracing
from joynexus.broker.connection import Broker
from joynexus.broker.inference_client import InferenceClient
from joynexus.broker.policy import PolicyStore
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import (
    InvalidSpec,
    JoyNexusError,
    Timeout,
    Unavailable,
    error_from_code,
)
from joynexus.schemas.jobs import JobEvent, TrainingJob, check_name
from joynexus.schemas.workloads import (
    ApiReply,
    CloseJob,
    CreateWorkload,
    NamedWorkload,
    OpenJob,
    WorkloadRecord,
    WorkloadSpec,
)

T = TypeVar("T")

SFT_FIELDS = ("obs_state", "actions")
RL_FIELDS = ("obs_state", "actions", "env_id", "step", "rewards", "dones")
IMAGE_PREFIX = "obs_image_"


@dataclass(frozen=True)
class Credentials:
    """How the tenant authenticates to NATS (user/password, token or a creds file)."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None

    def connect_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.user is not None:
            opts["user"], opts["password"] = self.user, self.password
        if self.token is not None:
            opts["token"] = self.token
        if self.creds_file is not None:
            opts["user_credentials"] = self.creds_file
        return opts


class Workload:
    """A handle on one of the tenant's workloads."""

    def __init__(self, client: Client, record: WorkloadRecord) -> None:
        self.client = client
        self.record = record

    @property
    def name(self) -> str:
        return self.record.spec.name

    def events(self, *, from_start: bool = True) -> AsyncIterator[JobEvent]:
        """This workload's job events (reserved, ready, leased, completed...) as they happen."""
        return self.client.events(self.name, from_start=from_start)

    def refresh(self) -> asyncio.Future[Workload]:
        return self.client.get_workload(self.name)

    def __repr__(self) -> str:
        spec = self.record.spec
        return (
            f"Workload({self.record.tenant_id}/{spec.name}: {spec.task_type}, {self.record.state})"
        )


class Client:
    """The async client of one tenant. Create it with :meth:`connect`."""

    def __init__(self, broker: Broker, tenant: str, *, timeout_s: float = 30.0) -> None:
        self._b = broker
        self.tenant = tenant
        self.timeout_s = timeout_s
        self._policies = PolicyStore(broker)
        self._tq = TrainingQueue(broker)
        self._infer = InferenceClient(broker)
        self._records: dict[str, WorkloadRecord] = {}

    @classmethod
    async def connect(
        cls,
        url: str | list[str],
        *,
        tenant: str,
        credentials: Credentials | None = None,
        namespace: str = "jnx",
        timeout_s: float = 30.0,
    ) -> Client:
        check_name("tenant", tenant)
        broker = await Broker.connect(
            url,
            name=f"sdk-{tenant}",
            namespace=namespace,
            **(credentials.connect_options() if credentials else {}),
        )
        return cls(broker, tenant, timeout_s=timeout_s)

    async def close(self) -> None:
        await self._b.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ plumbing
    @staticmethod
    def _future(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        return asyncio.ensure_future(coro)

    async def _api(self, verb: str, req: Any) -> ApiReply:
        subject = self._b.names.api(self.tenant, verb)
        try:
            msg = await self._b.nc.request(
                subject, encode(req), timeout=self.timeout_s, headers=tracing.inject()
            )
        except (NoRespondersError, NatsTimeout, TimeoutError) as e:
            raise Unavailable(
                f"the JoyNexus control plane did not answer {verb} ({type(e).__name__}); "
                "is the service running (`joynexus up`)?"
            ) from e
        reply = decode(msg.data, ApiReply, what=f"reply to {verb}")
        if reply.error is not None:
            raise error_from_code(reply.error.code, reply.error.message)
        return reply

    # ------------------------------------------------------------ workloads
    def create_workload(self, spec: WorkloadSpec) -> asyncio.Future[Workload]:
        """Declare a workload; the future fails with a clear error if the spec is refused."""

        async def go() -> Workload:
            reply = await self._api("create_workload", CreateWorkload(spec=spec))
            assert reply.workload is not None
            return Workload(self, reply.workload)

        return self._future(go())

    def get_workload(self, name: str) -> asyncio.Future[Workload]:
        async def go() -> Workload:
            reply = await self._api("get_workload", NamedWorkload(name=name))
            assert reply.workload is not None
            return Workload(self, reply.workload)

        return self._future(go())

    def list_workloads(self) -> asyncio.Future[list[Workload]]:
        async def go() -> list[Workload]:
            reply = await self._api("list_workloads", NamedWorkload())
            return [Workload(self, r) for r in reply.workloads]

        return self._future(go())

    def cancel_workload(self, name: str) -> asyncio.Future[Workload]:
        async def go() -> Workload:
            reply = await self._api("cancel_workload", NamedWorkload(name=name))
            assert reply.workload is not None
            return Workload(self, reply.workload)

        return self._future(go())

    # ------------------------------------------------------------ rollout as a service
    def act(
        self,
        workload: str,
        *,
        images: Mapping[str, Any],
        state: Any,
        instruction: str | Sequence[str] = "",
        version: int | None = None,
        session_id: str = "",
        timeout_s: float = 10.0,
    ) -> asyncio.Future[np.ndarray]:
        """Action chunks [B, horizon, A] for observations of an environment you run
        yourself, from the workload's policy (``version`` pinned, or the latest).

        ``images``: camera slot -> uint8 [B, 3, H, W] (or one [3, H, W]); ``state``
        [B, S] (or [S]). One shared backbone forward serves many tenants' requests."""

        async def go() -> np.ndarray:
            rec = await self._workload_cache(workload)
            return await self._infer.act(
                self.tenant,
                schema=rec.schema_signature,
                policy_key=workload,
                policy_version=version,
                images=images,
                instruction=instruction or rec.spec.instruction,
                state=state,
                session_id=session_id,
                timeout_s=timeout_s,
                base_model=rec.spec.base_model,
            )

        return self._future(go())

    async def _workload_cache(self, name: str) -> WorkloadRecord:
        rec = self._records.get(name)
        if rec is None:
            rec = self._records[name] = (await self.get_workload(name)).record
        return rec

    # ------------------------------------------------------------ your own data
    def submit_sft_batch(
        self, workload: str, batch: Mapping[str, Any]
    ) -> asyncio.Future[TrainingJob]:
        """Hand a batch of demonstrations to a ``source="tenant"`` SFT workload.

        ``batch``: ``obs_image_<camera>`` uint8 [B, 3, H, W] per camera slot,
        ``obs_state`` float32 [B, S], ``actions`` float32 [B, horizon, A]. Resolves once the job is
        ready for training (admission may make it wait: see ``max_in_flight``).
        """
        return self._future(self._submit(workload, batch, SFT_FIELDS, behavior_policy_version=0))

    def submit_rollout(
        self, workload: str, rollout: Mapping[str, Any], *, behavior_policy_version: int
    ) -> asyncio.Future[TrainingJob]:
        """Hand a rollout from an environment you run yourself to a ``source="tenant"``
        RL workload: the SFT fields plus ``env_id`` and ``step`` int64 [M], ``rewards``
        and ``dones`` float32 [M] (one row per env step). ``behavior_policy_version``
        is the version whose actions you executed (staleness is judged by it)."""
        return self._future(
            self._submit(
                workload, rollout, RL_FIELDS, behavior_policy_version=behavior_policy_version
            )
        )

    async def _submit(
        self,
        workload: str,
        data: Mapping[str, Any],
        required: tuple[str, ...],
        *,
        behavior_policy_version: int,
    ) -> TrainingJob:
        missing = [f for f in required if f not in data]
        if not any(k.startswith(IMAGE_PREFIX) for k in data):
            missing.append(f"{IMAGE_PREFIX}<camera>")
        if missing:
            raise InvalidSpec(
                f"batch lacks fields {missing}; it needs {IMAGE_PREFIX}<camera>, {', '.join(required)}"
            )
        rows = len(data["obs_state"])
        delay = 0.05
        while True:
            reply = await self._api(
                "open_job",
                OpenJob(
                    workload=workload,
                    sample_count=rows,
                    behavior_policy_version=behavior_policy_version,
                ),
            )
            if reply.job is not None:
                break
            await asyncio.sleep(delay)  # admission: this workload's jobs in flight are at the limit
            delay = min(delay * 2, 1.0)
        job = reply.job
        await self._tq.async_put(dict(data), tenant_id=self.tenant, partition_id=job.partition_id)
        closed = await self._api("close_job", CloseJob(job_id=job.job_id))
        assert closed.job is not None
        return closed.job

    # ------------------------------------------------------------ policies
    def latest_version(self, workload: str) -> asyncio.Future[int]:
        """The newest published version of a workload's policy."""

        async def go() -> int:
            return (await self._policies.latest(self.tenant, workload)).version

        return self._future(go())

    def evaluate(
        self,
        workload: str,
        *,
        version: int | None = None,
        episodes: int = 10,
        env: str | None = None,
        num_envs: int = 1,
        seed: int = 0,
        timeout_s: float = 900.0,
    ) -> asyncio.Future[dict[str, float]]:
        """Evaluate one version (default: the latest) of a workload's policy for
        ``episodes`` episodes in ``env`` (default: the workload's own task).
        The version is pinned for the whole run; nothing is trained."""

        async def go() -> dict[str, float]:
            src = (await self.get_workload(workload)).record.spec
            task_env = env or src.env
            if not task_env:
                raise InvalidSpec(f"workload {workload!r} has no env of its own; pass env=")
            pinned = version or (await self._policies.latest(self.tenant, workload)).version
            spec = WorkloadSpec(
                name=f"eval-{secrets.token_hex(4)}",
                task_type="eval",
                env=task_env,
                base_model=src.base_model,
                action_module=src.action_module,
                image_size=src.image_size,
                action_horizon=src.action_horizon,
                init_from_workload=workload,
                init_from=pinned,
                episodes=episodes,
                num_envs=num_envs,
                seed=seed,
            )
            wl = await self.create_workload(spec)
            deadline = asyncio.get_running_loop().time() + timeout_s
            while wl.record.state == "active":
                if asyncio.get_running_loop().time() > deadline:
                    raise Timeout(f"evaluation {spec.name} did not finish within {timeout_s:.0f}s")
                await asyncio.sleep(0.5)
                wl = await self.get_workload(spec.name)
            if wl.record.state != "done":
                raise JoyNexusError(f"evaluation {spec.name} failed; see the evaluator's log")
            return dict(wl.record.result)

        return self._future(go())

    def export(
        self, workload: str, path: str | Path, *, version: int | None = None
    ) -> asyncio.Future[Path]:
        """Write a version (default: latest) of the action module to ``path``:
        ``head.safetensors`` plus ``manifest.json`` (base model, schema, version, type)."""

        async def go() -> Path:
            rec = await self._policies.get(self.tenant, workload, version)
            data = await self._policies.load_weights(rec)
            manifest = {
                "tenant_id": rec.tenant_id,
                "workload": rec.policy_key,
                "version": rec.version,
                "action_module": rec.head_type,
                "head_config": rec.head_config,
                "base_model": rec.base_model,
                "schema_signature": rec.schema_signature,
                "feature_schema": msgspec.to_builtins(rec.feature_schema),
                "weights": "head.safetensors",
            }
            return await asyncio.to_thread(_write_export, Path(path), data, manifest)

        return self._future(go())

    # ------------------------------------------------------------ events
    async def events(
        self, workload: str | None = None, *, from_start: bool = True
    ) -> AsyncIterator[JobEvent]:
        """The tenant's job events in log order (optionally of one workload), live."""
        n = self._b.names
        sub = await self._b.js.subscribe(
            n.tenant_jobs(self.tenant),
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL if from_start else DeliverPolicy.NEW,
        )
        try:
            async for msg in sub.messages:
                event: JobEvent = decode(msg.data, JobEvent, what="job event")  # type: ignore[arg-type]
                if workload is None or event.job.policy_key == workload:
                    yield event
        finally:
            await sub.unsubscribe()


def _write_export(out: Path, weights: bytes, manifest: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "head.safetensors").write_bytes(weights)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out
