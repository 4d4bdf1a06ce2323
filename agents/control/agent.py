"""The control plane's agent: serves the micro service ``<ns>-control`` on
``<ns>.api.<tenant>.<verb>`` (the tenant from the subject, never the payload)
and ``<ns>.admin.<verb>``, and dispatches each verb to its part: workloads,
submissions, data gateway, operator API. The door's decisions (whose request,
how large, which verb) are pure (:mod:`joynexus.agents.control.checks`).

See docs/ARCHITECTURE.md ("Layout and import root",
"Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from nats.js.errors import BucketNotFoundError
from nats.micro import add_service
from nats.micro.request import Request

from joynexus.agents.control.apikeys import ApiKeysAPI
from joynexus.agents.control.base import InitPolicy
from joynexus.agents.control.checks import (
    check_admin_verb,
    oversized,
    request_type,
    tenant_of_subject,
)
from joynexus.agents.control.data import DataGateway
from joynexus.agents.control.door import DoorCount, FairIngress, IngressPace
from joynexus.agents.control.operator import OperatorAPI
from joynexus.agents.control.submissions import SubmissionsAPI
from joynexus.agents.control.training import TrainingAPI
from joynexus.agents.control.workloads import WorkloadsAPI
from joynexus.agents.datasets import default_root
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.eventlog import JobEventLog
from joynexus.broker.fastpath import sync_server
from joynexus.broker.kvmirror import KVMirror
from joynexus.broker.policy import PolicyRecords, WeightsCache
from joynexus.broker.quotas import QuotaBook
from joynexus.broker.responder import Server
from joynexus.broker.subjects import CURSOR_KEYS
from joynexus.broker.tq import TrainingQueue
from joynexus.broker.usage import Meter
from joynexus.schemas.api import VERB_COST
from joynexus.schemas.apikeys import KEY_VERBS, KeyReply, KeyRequest
from joynexus.schemas.base import decode, encode
from joynexus.schemas.identities import AdminReply, Penalty, TenantRequest, penalty_key
from joynexus.schemas.inference import decode_msgpack
from joynexus.schemas.jobs import check_name
from joynexus.schemas.scheduler import ErrorBody
from joynexus.schemas.workloads import CONTENT_TYPE, MSGPACK, ApiReply, WorkloadRecord

log = logging.getLogger(__name__)

def _admin_error(code: str, message: str) -> AdminReply:
    return AdminReply(error=ErrorBody(code=code, message=message))


def _key_error(code: str, message: str) -> KeyReply:
    return KeyReply(error=ErrorBody(code=code, message=message))


#: Keys of the workloads bucket that are not workload records.
_NOT_RECORDS = (CURSOR_KEYS,)


class ControlPlane(WorkloadsAPI, SubmissionsAPI, DataGateway, OperatorAPI, ApiKeysAPI, TrainingAPI):
    def __init__(
        self,
        broker: Broker,
        *,
        init_policy: InitPolicy,
        instance: str = "control-0",
        open_job_ttl_s: float = 600.0,
        datasets_root: str | Path | None = None,
    ) -> None:
        self.b = broker
        self.n = broker.names
        self.sched = SchedulerClient(broker, by=instance)
        self.init_policy = init_policy
        self.instance = instance
        self._service: Any = None
        self._kv = None
        self._lock = asyncio.Lock()
        self._ids = None
        self._keys = None
        self._policies = PolicyRecords(broker)
        self._weights = WeightsCache()
        self._tq = TrainingQueue(broker)
        self._ticks = {}
        self._tick = asyncio.Condition()
        self._job_sub: Any = None
        # A job still open after open_job_ttl_s (its client died) is failed: it holds a slot.
        self.open_job_ttl_s = open_job_ttl_s
        self._opened = {}
        self._opened_by = {}
        self._open_waits = Counter()
        self.datasets_root = Path(datasets_root) if datasets_root else default_root()
        self.quotas = QuotaBook(broker)
        # Each tenant's messages a second at the door, and who is paused (agents/control/door.py).
        self.door = DoorCount()
        # Each tenant's requests in a line of its own, served in turn (agents/control/door.py).
        self.ingress = FairIngress(self._serve_api)
        self.rpc = Server(
            broker,
            "control",
            error_reply=lambda code, message: ApiReply(error=ErrorBody(code=code, message=message)),
            internal="internal error (reference {ref} in the control plane's log)",
            limit=lambda t: self.quotas.get(t).max_requests_in_flight,
            slots=lambda t: self.quotas.get(t).max_requests_working,
        )
        # Workload records, from one watcher over the bucket: key -> record.
        self._records_mirror = KVMirror(
            broker, self.n.workloads_bucket, WorkloadRecord,
            skip=lambda key: key.startswith(_NOT_RECORDS),
            belongs=lambda key, rec: self.n.workload_key(rec.tenant_id, rec.spec.name) == key,
        )
        self._records_by_key = self._records_mirror.values
        self._tq_bytes = {}
        self._tq_pace = IngressPace()
        self._log = JobEventLog(broker)
        # Usage metering (broker.usage): folds busy intervals, queue puts and job ends
        # into a checkpoint; answers the usage verb (the tenant's own figures only).
        self.meter = Meter(broker, instance=f"{instance}-meter")

    async def start(self, wait_layout_s: float = 30.0) -> None:
        # The deployment's layout may still be being made (the server owner's auth
        # sync runs ensure_layout as the server starts): wait for it a while.
        deadline = asyncio.get_running_loop().time() + wait_layout_s
        while True:
            try:
                self._kv = await self.b.js.key_value(self.n.workloads_bucket)
                self._ids = await self.b.js.key_value(self.n.identities_bucket)
                self._keys = await self.b.js.key_value(self.n.apikeys_bucket)
                break
            except BucketNotFoundError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        self._job_sub = await self.b.nc.subscribe(self.n.all_jobs, cb=self._on_job_event)
        await self.quotas.start()
        await self._records_mirror.start(10.0)
        nc = await self.rpc.connection()
        self._service = await add_service(
            nc,
            name=self.n.control_service,
            version="0.1.0",
            description="JoyNexus control plane: tenants' workload specs and slots",
        )
        await self._service.add_endpoint(name="api", subject=self.n.all_api, handler=self._handle)
        await self._service.add_endpoint(
            name="admin", subject=self.n.all_admin, handler=self._handle_admin
        )
        # Subscribed on the server before start() returns (one flush() does not promise it).
        await sync_server(self.b.nc)
        if nc is not self.b.nc:
            await sync_server(nc)
        self.rpc.spawn(self.ingress.run())
        self.rpc.spawn(self._apply_logged_ends())
        self.rpc.spawn(self._adopt_open_jobs())
        self.rpc.spawn(self._expire_open_jobs())
        self.rpc.spawn(self.meter.run())

    async def stop(self) -> None:
        if self._job_sub is not None:
            with contextlib.suppress(Exception):
                await self._job_sub.unsubscribe()
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        await self.rpc.stop()
        await self.quotas.stop()
        await self._records_mirror.stop()

    async def _handle(self, request: Request) -> None:
        """The door: count the tenant's messages (a paused tenant's are dropped) and
        file the request in its tenant's line (:class:`FairIngress`); never wait here
        (nats-py runs one callback at a time per subscription, in arrival order)."""
        token = request.subject.split(".")[2] if request.subject.count(".") == 3 else ""
        if token:
            now = time.time()
            if self.door.paused(token, now):
                return  # dropped unanswered (a paused tenant's flood)
            q = self.quotas.get(token)
            pause = self.door.hit(token, now, q.max_requests_per_s, q.penalty_s)
            if pause is not None:
                self.rpc.spawn(self._pause(token, *pause, limit=q.max_requests_per_s))
                return
            # A tenant at its bound (in flight + filed) is refused before any other
            # check: a flood's cheapest path, and its line never holds more than that.
            if self.rpc.busy(token, self.ingress.waiting(token)):
                self.rpc.defer_refusal(token, request)
                return
        self.ingress.put(token, request)  # a full line (a backstop): dropped, as the door's

    def _serve_api(self, request: Request) -> None:
        """One request in its tenant's turn (:class:`FairIngress`): the reply subject,
        the body's size; then its verb's work in a task of its own (counted against the
        tenant's in-flight bound: past the total of all tenants', refused)."""
        tenant = tenant_of_subject(request.subject)
        if not self.rpc.allowed(request, tenant):
            return
        verb = request.subject.split(".")[-1]
        if tenant is not None:
            # Refused before any decoding: a flood of big bodies costs a length check.
            error = oversized(verb, len(request.data or b""), self.b.max_payload)
            if error is not None:
                self.rpc.spawn(self.rpc.answer_error(request, error))
                return

        who = tenant or "_"

        async def call() -> Any:
            check_name("tenant", who)  # a token, never a wildcard
            kind = request_type(verb)
            if (request.headers or {}).get(CONTENT_TYPE) == MSGPACK:
                req = decode_msgpack(request.data, kind, what=f"{verb} request")
            else:
                req = decode(request.data or b"{}", kind, what=f"{verb} request")
            return await getattr(self, f"_{verb}")(who, req)

        self.rpc.serve(request, call, span=f"control.{verb}", tenant=tenant,
                       cost=VERB_COST.get(verb, 1))

    async def _pause(self, tenant: str, until: float, rate: int, strikes: int, *, limit: int) -> None:
        """Pause a flooding tenant: the ``Penalty`` record the auth syncs apply (its user
        off the server until ``until``), and a security event for the operator."""
        seconds = until - time.time()
        log.warning("tenant %s sent over %d messages/s to the control plane (max_requests_per_s %d): "
                    "paused %.0f s (strike %d)", metrics.clip(tenant, 64), rate, limit, seconds, strikes)
        with contextlib.suppress(Exception):
            check_name("tenant", tenant)
            await self._ids.put(penalty_key(tenant), encode(
                Penalty(tenant_id=tenant, until=until, rate=rate, strikes=strikes)))
        with contextlib.suppress(Exception):
            await metrics.security(self.b, tenant, action="flood", subject=self.n.api(tenant, "*"),
                                   reason=f"over {limit} messages/s to the control plane: paused "
                                          f"{seconds:.0f} s (strike {strikes})", source="control")

    async def _handle_admin(self, request: Request) -> None:
        if not self.rpc.allowed(request, None):
            return
        verb = request.subject.split(".")[-1]

        keys = verb in KEY_VERBS

        async def call() -> Any:
            check_admin_verb(verb)
            kind = KeyRequest if keys else TenantRequest
            req = decode(request.data or b"{}", kind, what=f"{verb} request")
            return await getattr(self, f"_{verb}")(req)

        self.rpc.serve(request, call, span=f"control.{verb}",
                       error_reply=_key_error if keys else _admin_error)
