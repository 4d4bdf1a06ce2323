"""Metric events on ``<ns>.metrics.<kind>.<tenant>`` (captured by the metrics stream).

Kinds: ``learning`` (losses, eval scores), ``control`` (queue depths, policy
freshness), ``system`` (health, weight-sync time, utilization), ``security``.
Fire-and-forget: a lost metric never blocks training.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from joynexus.broker import tracing
from joynexus.broker.connection import Broker

log = logging.getLogger(__name__)


async def emit(b: Broker, kind: str, tenant_id: str = "_", **fields: Any) -> None:
    payload = orjson.dumps({"kind": kind, "tenant_id": tenant_id, "at": time.time(), **fields})
    try:
        await b.nc.publish(b.names.metrics(kind, tenant_id), payload, headers=tracing.inject())
    except Exception as e:  # disconnected: drop the metric, keep working
        log.debug("metric %s dropped: %s", kind, e)


async def busy(b: Broker, service: str, start: float, end: float, **fields: Any) -> None:
    """A busy interval (wall-clock seconds) of a service: ``train`` or ``infer``.
    Utilization timelines and device-time accounting are built from these; pass
    ``cpu_s`` (the process's CPU seconds in the interval) where the "device" is a
    CPU shared with other services, whose wall-clock intervals stretch under
    contention."""
    await emit(b, "system", "_", service=service, busy_start=start, busy_end=end, **fields)


async def security(
    b: Broker, tenant_id: str, *, action: str, subject: str, reason: str, source: str
) -> None:
    """A refused attempt (kind ``security``): who (``tenant_id``, ``_`` when
    unknown), what they tried (``action``: publish, subscribe, connect,
    claim_tenant, ...), on which subject (field ``target``), why it was refused
    and who saw it (``source``: nats-server, control, inference)."""
    log.warning("security: %s refused %s %s of tenant %s: %s", source, action, subject,
                tenant_id, reason)
    await emit(b, "security", tenant_id, action=action, target=subject, reason=reason,
               source=source)
