from __future__ import annotations

from joynexus.broker.connection import Broker
from joynexus.broker.layout import ensure_layout


async def test_layout_is_idempotent_and_reads_well(broker: Broker) -> None:
    await ensure_layout(broker)  # second time: finds and updates, no error
    names = [s.config.name for s in await broker.js.streams_info()]
    ns = broker.names.namespace.upper()
    for s in ("JOBS", "TQ", "METRICS", "ADVISORIES"):
        assert f"{ns}_{s}" in names
    info = await broker.js.stream_info(broker.names.jobs_stream)
    assert "job event log" in (info.config.description or "")
    assert info.config.allow_direct
