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

The verbs are grouped by family: workloads and their events here, your own
data and actions in sdk/data.py, policies and evaluations in sdk/policies.py,
the training client of a custom workload in sdk/training.py,
on the request plumbing of sdk/base.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials, from_env_or_file
from joynexus.broker.subjects import Names
from joynexus.schemas.base import decode
from joynexus.schemas.errors import InvalidSpec, Unavailable
from joynexus.schemas.jobs import JobEvent, LogEvent, WorkloadEnded, check_name
from joynexus.schemas.workloads import (
    CreateWorkload,
    NamedWorkload,
    ReadEvents,
    WorkloadRecord,
    WorkloadSpec,
)
from joynexus.sdk.data import DataCalls
from joynexus.sdk.policies import PolicyCalls
from joynexus.sdk.training import TrainingCalls

#: How long one read_events request waits for new events.
EVENTS_WAIT_S = 5.0

__all__ = ["Client", "Credentials", "Workload"]


class Workload:
    """A handle on one of the tenant's workloads."""

    def __init__(self, client: Client, record: WorkloadRecord) -> None:
        self.client = client
        self.record = record

    @property
    def name(self) -> str:
        return self.record.spec.name

    @property
    def instruction(self) -> str:
        """The instruction its policy is conditioned on (``act`` sends it by default)."""
        return self.record.policy_instruction()

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


class Client(DataCalls, PolicyCalls, TrainingCalls):
    """The async client of one tenant. Create it with :meth:`connect`."""

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
