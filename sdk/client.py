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
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DeliverPolicy

from joynexus.broker import tracing
from joynexus.broker.connection import Broker
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import Unavailable, error_from_code
from joynexus.schemas.jobs import JobEvent, check_name
from joynexus.schemas.workloads import (
    ApiReply,
    CreateWorkload,
    NamedWorkload,
    WorkloadRecord,
    WorkloadSpec,
)

T = TypeVar("T")


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
