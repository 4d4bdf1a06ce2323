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


async def test_buckets_and_object_store_exist(broker: Broker) -> None:
    n = broker.names
    for bucket in (n.tenants_bucket, n.policy_bucket):
        kv = await broker.js.key_value(bucket)
        assert (await kv.status()).bucket == bucket
    store = await broker.js.object_store(n.weights_store)
    assert (await store.status()).bucket == n.weights_store


def test_names_are_tokens() -> None:
    from joynexus.broker.subjects import Names

    n = Names()
    assert n.infer("qwen2.5-vl-tiny") == "jnx.infer.qwen2_5-vl-tiny.*"
    assert n.infer("qwen2.5-vl-tiny", "acme") == "jnx.infer.qwen2_5-vl-tiny.acme"
    assert n.job_subject("acme", "j1", "ready") == "jnx.job.acme.j1.ready"
    assert n.jobs_in_state("needs_advantages") == "jnx.job.*.*.needs_advantages"
