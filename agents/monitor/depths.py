"""Queue depths as metrics: what JetStream and the scheduler say is waiting.

Polled by the monitor and emitted as ``control`` metrics on the metrics
stream, so queue depths are recorded, replayed and reported like any other
signal. See docs/ARCHITECTURE.md, "Traces and monitoring".
"""

from __future__ import annotations

import contextlib
from typing import Any

from nats.js.errors import NotFoundError

from joynexus.agents.monitor.metric import GLOBAL_TENANT
from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.schemas.errors import JoyNexusError


async def poll_queue_depths(b: Broker, instance: str) -> dict[str, Any]:
    """Queue depths from JetStream (and the scheduler, when it answers), emitted
    as ``control`` metrics; returns what was emitted for the global tenant."""
    n = b.names
    fields: dict[str, Any] = {"source": instance}
    with contextlib.suppress(NotFoundError):
        info = await b.js.stream_info(n.tq_stream)
        fields["tq_bytes"] = info.state.bytes
        fields["tq_messages"] = info.state.messages
    with contextlib.suppress(NotFoundError):
        info = await b.js.stream_info(n.jobs_stream)
        fields["job_events"] = info.state.messages
        pending, ack_pending = {}, {}
        for c in await b.js.consumers_info(n.jobs_stream):
            pending[c.name] = c.num_pending
            ack_pending[c.name] = c.num_ack_pending
        fields["pending"] = pending
        fields["ack_pending"] = ack_pending
    await metrics.emit(b, "control", GLOBAL_TENANT, **fields)
    try:
        from joynexus.agents.scheduler_client import SchedulerClient

        snap = await SchedulerClient(b, by=instance, call_timeout_s=1.0, deadline_s=1.5).snapshot()
    except JoyNexusError:
        return fields  # no scheduler: JetStream's view is still recorded
    for tenant, states in snap.jobs_by_tenant_state.items():
        await metrics.emit(b, "control", tenant, source=instance, jobs=dict(states))
    return fields
