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


async def test_a_store_too_small_for_the_layout_says_what_to_do(
    tmp_path, monkeypatch  # type: ignore[no-untyped-def]
) -> None:
    """A server whose JetStream store cannot reserve the Training Queue's cap refuses
    the stream with 10047; the layout says which stream, how much, and which setting
    to lower. With the cap lowered by the environment the same server takes the layout,
    and a second deployment's layout fits beside it once the first is deleted."""
    import pytest

    from joynexus.broker.layout import METRICS_MAX_BYTES_ENV, TQ_MAX_BYTES_ENV, delete_layout
    from joynexus.ops.runtime.natsconfig import ServerLimits
    from joynexus.ops.runtime.natsserver import EmbeddedNats
    from joynexus.schemas.errors import InvalidSpec

    # The defaults, not the test session's caps (tests/conftest.py).
    monkeypatch.delenv(TQ_MAX_BYTES_ENV, raising=False)
    monkeypatch.delenv(METRICS_MAX_BYTES_ENV, raising=False)

    server = EmbeddedNats(
        tmp_path / "nats", limits=ServerLimits(max_file_store=3 * 1024**3)
    )
    server.start()
    try:
        assert "Max Storage:     3.00 GB" in server.log_tail()
        a = await Broker.connect(server.url, name="test", namespace="small")
        try:
            with pytest.raises(InvalidSpec) as err:
                await ensure_layout(a)  # the TQ reserves 8 GiB by default
            text = str(err.value)
            assert a.names.tq_stream in text and "8.00 GiB" in text
            assert f"${TQ_MAX_BYTES_ENV}" in text and "JOYNEXUS_NATS_MAX_FILE_STORE" in text

            monkeypatch.setenv(TQ_MAX_BYTES_ENV, "1G")
            await ensure_layout(a)  # TQ 1 GiB + metrics 1 GiB = 2 of the 3 GiB
            info = await a.js.stream_info(a.names.tq_stream)
            assert info.config.max_bytes == 1024**3
            b = await Broker.connect(server.url, name="test", namespace="other")
            try:
                with pytest.raises(InvalidSpec):
                    await ensure_layout(b)  # 2 more GiB do not fit beside the first
                await delete_layout(a)
                await ensure_layout(b)  # freed: it fits now
                assert (await b.js.stream_info(b.names.tq_stream)).config.max_bytes == 1024**3
                await delete_layout(b)
            finally:
                await b.close()
        finally:
            await a.close()
    finally:
        server.stop()


def test_stream_caps_from_the_environment_are_checked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from joynexus.broker.layout import METRICS_MAX_BYTES_ENV, TQ_MAX_BYTES_ENV, LayoutOptions
    from joynexus.schemas.errors import InvalidSpec

    monkeypatch.delenv(TQ_MAX_BYTES_ENV, raising=False)
    monkeypatch.delenv(METRICS_MAX_BYTES_ENV, raising=False)
    assert LayoutOptions().tq_max_bytes == 8 * 1024**3
    assert LayoutOptions().metrics_max_bytes == 1024**3
    for raw, want in (("512M", 512 * 1024**2), ("2GiB", 2 * 1024**3), ("33554432", 32 * 1024**2)):
        monkeypatch.setenv(TQ_MAX_BYTES_ENV, raw)
        assert LayoutOptions().tq_max_bytes == want
    monkeypatch.setenv(METRICS_MAX_BYTES_ENV, "256m")
    assert LayoutOptions().metrics_max_bytes == 256 * 1024**2
    for bad in ("-1G", "1.5G", "lots", "1M", "0"):
        monkeypatch.setenv(TQ_MAX_BYTES_ENV, bad)
        with pytest.raises(InvalidSpec, match=TQ_MAX_BYTES_ENV):
            LayoutOptions()
