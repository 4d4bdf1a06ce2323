"""The tenant's client: declare workloads, watch their jobs, fetch policies.

Everything goes over NATS with the tenant's own identity (the credentials
file an operator issued with ``joynexus tenant add``): every call is a
request on ``<ns>.api.<tenant>.<verb>`` (the control plane takes the tenant
from the subject) or, for actions, on the tenant's own inference subject.
The broker lets a tenant publish nowhere else, and it has no JetStream
access: its job events, Training Queue rows and policy weights go through
the control plane. A refused attempt fails the call with
:class:`PermissionDenied`. Methods that talk to the service return futures:
``await`` them in async code, or use :class:`joynexus.sdk.SyncClient`, whose
futures have a blocking ``.result()``.

This module needs only the base install (no torch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
from nats.errors import ConnectionClosedError

from joynexus.broker import rpc, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials, from_env_or_file
from joynexus.broker.inference_client import InferenceClient
from joynexus.broker.subjects import Names
from joynexus.schemas.api import VERBS, UsageQuery
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import (
    InvalidSpec,
    JoyNexusError,
    PermissionDenied,
    Timeout,
    Unavailable,
)
from joynexus.schemas.inference import PolicyRecord, TensorBytes, encode_msgpack
from joynexus.schemas.jobs import JobEvent, LogEvent, TrainingJob, WorkloadEnded, check_name
from joynexus.schemas.samples import IMAGE_FIELD_PREFIX, REQUIRED, STATE_FIELD
from joynexus.schemas.workloads import (
    CONTENT_TYPE,
    MSGPACK,
    ApiReply,
    CloseJob,
    CreateWorkload,
    NamedWorkload,
    OpenJob,
    PolicyQuery,
    PutData,
    ReadEvents,
    VideoQuery,
    WorkloadRecord,
    WorkloadSpec,
)

T = TypeVar("T")

#: The fields each task type's batch needs besides the images (the table:
#: schemas/samples.py's FIELDS and REQUIRED).
SFT_FIELDS = REQUIRED["sft"]
RL_FIELDS = REQUIRED["rl"]
IMAGE_PREFIX = IMAGE_FIELD_PREFIX
#: Raw bytes per put_data request at most (msgpack, under 3/4 of max_payload).
PUT_CHUNK_BYTES = 6 * 1024 * 1024
#: How long one read_events request waits for new events.
EVENTS_WAIT_S = 5.0
#: Each verb's reply decoder (an error reply raises its typed error).
_REPLIES = {verb: rpc.checked(ApiReply, f"reply to {verb}") for verb in VERBS}
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"')

__all__ = ["Client", "Credentials", "Workload"]


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
        return self.client.events(
            self.name, from_start=from_start, generation=self.record.generation
        )

    def refresh(self) -> asyncio.Future[Workload]:
        return self.client.get_workload(self.name)

    def eval_history(self) -> asyncio.Future[list[dict[str, Any]]]:
        """Its periodic evaluations (``eval_every``), by version: see ``Client.eval_history``."""
        return self.client.eval_history(self.name)

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
        self._infer = InferenceClient(broker, service=False)
        self._records: dict[str, WorkloadRecord] = {}
        # Refusals the server reports asynchronously, matched to the calls waiting on them.
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}
        self._revoked: PermissionDenied | None = None
        self._closing: asyncio.Future[None] | None = None
        self._closed = False
        broker.error_listeners.append(self._on_server_error)

    @classmethod
    async def connect(
        cls,
        url: str | list[str] | None = None,
        *,
        tenant: str | None = None,
        credentials: Credentials | str | Path | None = None,
        namespace: str | None = None,
        timeout_s: float = 30.0,
    ) -> Client:
        """Connect as ``tenant``. ``credentials``: the file (or its loaded
        :class:`Credentials`) an operator issued with ``joynexus tenant add``;
        it names the tenant, the namespace and the server, so
        ``Client.connect(credentials="acme.json")`` is enough."""
        creds = Credentials.load(credentials) if isinstance(credentials, str | Path) else credentials
        if creds is None:  # $JOYNEXUS_CREDS, if it names a tenant's file
            env = from_env_or_file(None)
            creds = env if env is not None and env.kind == "tenant" else None
        if creds is not None and creds.tenant and tenant and creds.tenant != tenant:
            raise InvalidSpec(
                f"the credentials are tenant {creds.tenant!r}'s, not {tenant!r}'s"
            )
        tenant = tenant or (creds.tenant if creds else None)
        if tenant is None:
            raise InvalidSpec("connect needs tenant= (or credentials that name the tenant)")
        check_name("tenant", tenant)
        url = url or (creds.url if creds else None)
        if not url:
            raise InvalidSpec("connect needs the server's url (or credentials that name it)")
        namespace = namespace or (creds.namespace if creds and creds.namespace else "jnx")
        broker = await Broker.connect(
            url,
            name=f"sdk-{tenant}",
            namespace=namespace,
            credentials=creds,
            inbox_prefix=Names(namespace).inbox_prefix(tenant),
        )
        return cls(broker, tenant, timeout_s=timeout_s)

    async def close(self) -> None:
        """Close the connection; calls in flight (an ``events()`` long-poll...) end at once."""
        self._closed = True
        err = Unavailable("the client was closed")
        for futs in self._waiting.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(err)
        self._waiting.clear()
        await self._b.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ plumbing
    @staticmethod
    def _future(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        return asyncio.ensure_future(coro)

    def _on_server_error(self, e: Exception) -> None:
        text = str(e)
        m = _VIOLATION.search(text.lower())
        if m:
            subject = m.group(2)
            err = PermissionDenied(
                f"the server refused this connection's {m.group(1)} to {subject!r}: the "
                "credentials of a tenant cover only its own API and inference subjects"
            )
            for fut in self._waiting.pop(subject, set()):
                if not fut.done():
                    fut.set_exception(err)
        elif "authorization violation" in text.lower():
            self._revoked = PermissionDenied(
                f"the server refused tenant {self.tenant!r}'s credentials (revoked or "
                "rotated: ask the operator for new ones)"
            )
            for futs in self._waiting.values():
                for fut in futs:
                    if not fut.done():
                        fut.set_exception(self._revoked)
            self._waiting.clear()
            # Reconnecting with refused credentials would retry forever.
            self._closing = asyncio.ensure_future(self._b.close())

    async def _guarded(self, subject: str, call: Coroutine[Any, Any, T]) -> T:
        """``call`` (which publishes on ``subject``), failed at once with
        PermissionDenied if the server refuses that publish."""
        if self._revoked is not None or self._closed:
            call.close()
            raise self._revoked or Unavailable("the client was closed")
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(subject.lower(), set()).add(refused)
        task = asyncio.ensure_future(call)
        try:
            pending: set[asyncio.Future[Any]] = {task, refused}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if refused.done() and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                refused.result()  # raises PermissionDenied
            return task.result()
        except ConnectionClosedError as e:
            raise self._revoked or Unavailable("the connection to NATS is closed") from e
        finally:
            if not task.done():
                task.cancel()
            futs = self._waiting.get(subject.lower())
            if futs is not None:
                futs.discard(refused)
                if not futs:
                    self._waiting.pop(subject.lower(), None)
            if refused.done() and not refused.cancelled():
                refused.exception()  # retrieved: no "never retrieved" warning

    async def _api(
        self, verb: str, req: Any, *, timeout_s: float | None = None, binary: bool = False
    ) -> ApiReply:
        """One control plane request; ``binary``: msgpack (tensors stay raw bytes).
        A ``rate_limited`` answer (too many of this tenant's requests in flight) is
        retried a few times with backoff before it reaches the caller
        (``broker.rpc.TENANT_API``)."""
        if not isinstance(req, VERBS[verb]):  # the one table of verbs the control plane serves
            raise TypeError(f"{verb} takes a {VERBS[verb].__name__}, not {type(req).__name__}")
        subject = self._b.names.api(self.tenant, verb)
        headers = tracing.inject()
        if binary:
            headers[CONTENT_TYPE] = MSGPACK

        def guarded(subject: str, payload: bytes, *, timeout: float, headers: Any) -> Any:
            return self._guarded(
                subject, self._b.nc.request(subject, payload, timeout=timeout, headers=headers)
            )

        def unanswered(e: Exception) -> Unavailable:
            return Unavailable(
                f"the JoyNexus control plane did not answer {verb} "
                f"({type(e.__cause__ or e).__name__}); is the service running (`joynexus up`)?"
            )

        return await rpc.call(
            self._b,
            subject,
            encode_msgpack(req) if binary else encode(req),
            _REPLIES[verb],
            timeout_s=timeout_s or self.timeout_s,
            headers=headers,
            retry=rpc.TENANT_API,
            request=guarded,
            unanswered=unanswered,
        )

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
            return await self._guarded(
                self._b.names.infer(rec.spec.base_model, self.tenant),
                self._infer.act(
                    self.tenant,
                    schema=rec.schema_signature,
                    workload=workload,
                    policy_version=version,
                    images=images,
                    instruction=instruction or rec.spec.instruction,
                    state=state,
                    session_id=session_id,
                    timeout_s=timeout_s,
                    base_model=rec.spec.base_model,
                ),
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
        and ``dones`` float32 [M] (one row per env step). ``actions`` is the chunk
        [M, horizon, A] as in an SFT batch, never the executed action [M, A] (send
        that, if at all, as ``action``); schemas/samples.py's FIELDS lists them all.
        ``behavior_policy_version`` is the version whose actions you executed
        (staleness is judged by it)."""
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
        rows = len(data[STATE_FIELD])
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
        arrays = {k: np.ascontiguousarray(v) for k, v in data.items()}
        row_bytes = sum(a[0].nbytes for a in arrays.values() if len(a)) or 1
        step = max(1, min(PUT_CHUNK_BYTES, self._b.max_payload * 3 // 4) // row_bytes)
        try:
            for start in range(0, rows, step):  # rows in requests under the payload limit
                fields = {
                    k: TensorBytes.from_array(a[start : start + step]) for k, a in arrays.items()
                }
                await self._api("put_data", PutData(job_id=job.job_id, fields=fields), binary=True)
            closed = await self._api("close_job", CloseJob(job_id=job.job_id))
        except BaseException as e:
            # Give the job up so it holds no admission slot (the control plane also
            # fails jobs left open too long, should this process die here).
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self._api("abort_job", CloseJob(job_id=job.job_id, reason=repr(e)[:200]))
                )
            raise
        assert closed.job is not None
        return closed.job

    # ------------------------------------------------------------ policies
    def latest_version(self, workload: str) -> asyncio.Future[int]:
        """The newest published version of a workload's policy."""

        async def go() -> int:
            return (await self._policy(workload)).version

        return self._future(go())

    def usage(self, since: float = 0.0) -> asyncio.Future[dict[str, Any]]:
        """This tenant's metered usage (the control plane's meter, ``broker.usage``):
        ``{"tenants": {<me>: {"train_s", "infer_s", "env_s", "tq_byte_s",
        "infer_requests", ...}}, "as_of", "since_effective"}``; ``since``: epoch
        seconds (counted from the hour holding it)."""

        async def go() -> dict[str, Any]:
            reply = await self._api("usage", UsageQuery(since=float(since)))
            out: dict[str, Any] = json.loads(reply.data or b"{}")
            return out

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
        videos: int = 0,
        name: str | None = None,
    ) -> asyncio.Future[dict[str, float]]:
        """Evaluate one version (default: the latest) of a workload's policy for
        ``episodes`` episodes in ``env`` (default: the workload's own task).
        The version is pinned for the whole run; nothing is trained. ``videos``:
        the first episodes saved as video (fetch them with ``fetch_video(name)``;
        ``name`` names the evaluation, default ``eval-<random>``)."""

        async def go() -> dict[str, float]:
            src = (await self.get_workload(workload)).record.spec
            task_env = env or src.env
            if not task_env:
                raise InvalidSpec(f"workload {workload!r} has no env of its own; pass env=")
            policy = await self._policy(workload, version)
            pinned = policy.version
            fs = policy.feature_schema
            spec = WorkloadSpec(
                name=name or f"eval-{secrets.token_hex(4)}",
                task_type="eval",
                env=task_env,
                base_model=src.base_model,
                action_module=src.action_module,
                # The observation the policy was trained on: its cameras, image size and state.
                image_size=int(fs.image_hw[0]),
                cameras=list(fs.camera_slots),
                state=list(fs.state_keys),
                action_horizon=src.action_horizon,
                init_from_workload=workload,
                init_from=pinned,
                episodes=episodes,
                num_envs=num_envs,
                seed=seed,
                eval_videos=videos,
            )
            wl = await self.create_workload(spec)
            deadline = asyncio.get_running_loop().time() + timeout_s
            while wl.record.state == "active":
                if asyncio.get_running_loop().time() > deadline:
                    raise Timeout(f"evaluation {spec.name} did not finish within {timeout_s:.0f}s")
                await asyncio.sleep(0.5)
                wl = await self.get_workload(spec.name)
            if wl.record.state != "done":
                why = wl.record.reason or "no reason recorded; see the evaluator's log"
                raise JoyNexusError(f"evaluation {spec.name} {wl.record.state}: {why}")
            return dict(wl.record.result)

        return self._future(go())

    def eval_history(self, workload: str) -> asyncio.Future[list[dict[str, Any]]]:
        """The periodic evaluations of a workload (its spec's ``eval_every``), oldest
        version first: ``{"version", "evaluation" (its name), "state", "success_rate",
        "mean_return", "episodes", "videos" (file names: ``fetch_video``)}`` each; the
        figures appear once the evaluation is done."""

        async def go() -> list[dict[str, Any]]:
            check_name("workload", workload)
            reply = await self._api("list_workloads", NamedWorkload())
            out = []
            for r in reply.workloads:
                if not (r.periodic and r.spec.init_from_workload == workload):
                    continue
                row: dict[str, Any] = {
                    "version": r.spec.init_from,
                    "evaluation": r.spec.name,
                    "state": r.state,
                    "videos": list(r.videos),
                }
                for k in ("success_rate", "mean_return", "episodes"):
                    if k in r.result:
                        row[k] = r.result[k]
                out.append(row)
            return sorted(out, key=lambda row: row["version"] or 0)

        return self._future(go())

    def fetch_video(
        self, evaluation: str, index: int = 0, path: str | Path | None = None
    ) -> asyncio.Future[bytes]:
        """Video ``index`` of one of your evaluations (MP4, or GIF where the service
        has no PyAV), through the control plane; also written to ``path`` if given."""

        async def go() -> bytes:
            out = bytearray()
            while True:
                reply = await self._api(
                    "get_video",
                    VideoQuery(workload=evaluation, index=index, offset=len(out),
                               limit=self._b.max_payload // 2),
                )
                out += reply.data
                if len(reply.data) < self._b.max_payload // 2:
                    break
            data = bytes(out)
            if path is not None:
                await asyncio.to_thread(Path(path).write_bytes, data)
            return data

        return self._future(go())

    def export(
        self, workload: str, path: str | Path, *, version: int | None = None
    ) -> asyncio.Future[Path]:
        """Write a version (default: latest) of the action module to ``path``:
        ``head.safetensors`` plus ``manifest.json`` (base model, schema, version, type)."""

        async def go() -> Path:
            rec = await self._policy(workload, version)
            data = await self._weights(rec)
            manifest = {
                "tenant_id": rec.tenant_id,
                "workload": rec.workload,
                "version": rec.version,
                "action_module": rec.head_type,
                "head_config": rec.head_config,
                "base_model": rec.base_model,
                "schema_signature": rec.schema_signature,
                "feature_schema": msgspec.to_builtins(rec.feature_schema),
                # The head applies these itself (buffers in head.safetensors); here for readers.
                "normalization": _normalization(data),
                "weights": "head.safetensors",
            }
            return await asyncio.to_thread(_write_export, Path(path), data, manifest)

        return self._future(go())

    # ------------------------------------------------------------ events
    async def _policy(self, workload: str, version: int | None = None) -> PolicyRecord:
        reply = await self._api("get_policy", PolicyQuery(workload=workload, version=version))
        assert reply.policy is not None
        return reply.policy

    async def _weights(self, rec: PolicyRecord) -> bytes:
        """The weights of one version, in slices under the payload limit."""
        out = bytearray()
        while True:
            reply = await self._api(
                "get_policy",
                PolicyQuery(
                    workload=rec.workload,
                    version=rec.version,
                    offset=len(out),
                    limit=self._b.max_payload // 2,
                ),
            )
            out += reply.data
            if not reply.data or (rec.size_bytes and len(out) >= rec.size_bytes):
                return bytes(out)

    # ------------------------------------------------------------ events
    async def events(
        self,
        workload: str | None = None,
        *,
        from_start: bool = True,
        generation: int | None = None,
    ) -> AsyncIterator[JobEvent]:
        """The tenant's job events in log order (optionally of one workload), live.

        With ``workload``: the events of its current generation (or of ``generation``;
        a name created again after its workload ended starts over), and the iterator
        ends once that
        generation has ended (done, failed or cancelled: ``refresh()`` says how).
        Pages through the control plane by stream sequence (no server-side
        consumer to leak), so a reconnect or a control plane restart neither
        skips nor repeats an event."""
        if workload is not None and generation is None:
            generation = (await self.get_workload(workload)).record.generation
        after = 0 if from_start else -1
        if after < 0:
            after = (await self._api("read_events", ReadEvents(after_seq=-1))).last_seq
        while True:
            try:
                reply = await self._api(
                    "read_events",
                    ReadEvents(after_seq=after, wait_s=EVENTS_WAIT_S),
                    timeout_s=max(self.timeout_s, EVENTS_WAIT_S + 10),
                )
            except Unavailable:
                if self._closed or self._b.nc.is_closed:  # this client was closed: the end
                    return
                await asyncio.sleep(0.5)  # control plane restarting: resume from `after`
                continue
            for entry in reply.events:
                event: LogEvent = decode(bytes(entry.event), LogEvent, what="job event")  # type: ignore[arg-type]
                after = entry.seq
                if isinstance(event, WorkloadEnded):
                    if event.workload == workload and event.generation == generation:
                        return
                    continue
                if workload is None or (
                    event.job.workload == workload and event.job.generation == generation
                ):
                    yield event
            after = max(after, reply.last_seq)


def _normalization(weights: bytes) -> dict[str, dict[str, list[float]]]:
    """The normalisation statistics a head's safetensors carry (state and action
    mean/std), read from its header with numpy (the SDK imports no torch)."""
    n = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8 : 8 + n])
    body = memoryview(weights)[8 + n :]

    def tensor(name: str) -> list[float] | None:
        t = header.get(name)
        if not isinstance(t, dict) or t.get("dtype") not in ("F32", "F64"):
            return None
        a, b = t["data_offsets"]
        dtype = np.float32 if t["dtype"] == "F32" else np.float64
        return [float(x) for x in np.frombuffer(body[a:b], dtype=dtype)]

    out: dict[str, dict[str, list[float]]] = {}
    for key, prefix in (("observation.state", "state"), ("action", "action")):
        mean, std = tensor(f"{prefix}_mean"), tensor(f"{prefix}_std")
        if mean is not None and std is not None:
            out[key] = {"mean": mean, "std": std}
    return out


def _write_export(out: Path, weights: bytes, manifest: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "head.safetensors").write_bytes(weights)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out
