"""The request plumbing under :class:`joynexus.sdk.Client`: one control plane call
(``_api``: typed request, rate-limit retries, the tenant's errors raised typed),
a publish the server refuses failed at once with :class:`PermissionDenied`
(``_guarded``), revoked credentials closing the connection, and the records the
verbs share (a workload's, a policy's and its weights).

The verbs live in sdk/client.py (workloads, events), sdk/data.py (your own data,
actions) and sdk/policies.py (versions, evaluation, export, usage).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Coroutine
from typing import Any, TypeVar

from nats.errors import ConnectionClosedError

from joynexus.broker import rpc, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.inference_client import InferenceClient
from joynexus.schemas.api import VERBS
from joynexus.schemas.base import encode
from joynexus.schemas.errors import PermissionDenied, Unavailable
from joynexus.schemas.inference import PolicyRecord, encode_msgpack
from joynexus.schemas.workloads import (
    CONTENT_TYPE,
    MSGPACK,
    ApiReply,
    NamedWorkload,
    PolicyQuery,
    WorkloadRecord,
)

T = TypeVar("T")

#: Each verb's reply decoder (an error reply raises its typed error).
_REPLIES = {verb: rpc.checked(ApiReply, f"reply to {verb}") for verb in VERBS}
#: Submissions of one client that wait for admission at once (the others wait in
#: the client): the control plane lets half a tenant's requests in flight wait.
OPEN_WAITS = 8
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"')


class ClientBase:
    """One tenant's connection and its request plumbing (see the module)."""

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
        #: Submissions of this client waiting for admission at once (sdk/data.py).
        self._open_slots = asyncio.Semaphore(OPEN_WAITS)
        broker.error_listeners.append(self._on_server_error)

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
                f"the server refused tenant {self.tenant!r}'s credentials: revoked or rotated "
                "(ask the operator for new ones), or paused for a while for sending the control "
                "plane more than its max_requests_per_s quota (connect again after the pause)"
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

    async def _record(self, verb: str, req: Any) -> WorkloadRecord:
        """The workload record a workload verb answers."""
        reply = await self._api(verb, req)
        assert reply.workload is not None
        return reply.workload

    async def _workload_cache(self, name: str) -> WorkloadRecord:
        rec = self._records.get(name)
        if rec is None:
            rec = self._records[name] = await self._record("get_workload", NamedWorkload(name=name))
        return rec

    # ------------------------------------------------------------ policies
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
