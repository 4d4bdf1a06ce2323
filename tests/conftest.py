"""Test fixtures: one real nats-server per test session, a namespace per test.

The server runs on a random port with a temporary file store; readiness comes
from its log. Tests that share it get their own namespace, hence their own
streams and subjects.

The tests live by layer: ``unit/`` (pure functions and models, no server),
``broker/`` (the NATS layer on a real server), ``agents/`` (one role or a few on a
real server) and ``system/`` (whole deployments, simulators, subprocesses, faults:
minutes). Every test under ``system/`` is marked ``slow``, so
``pytest -q -m "not slow"`` is the fast lane.
"""

from __future__ import annotations

import os

os.environ.setdefault("JOYNEXUS_STRICT_DECODE", "1")
# Every test namespace makes a Training Queue and a metrics stream, and each stream
# reserves its cap on the server's JetStream store when made (8 GiB + 1 GiB by
# default); the server gets 75% of the free disk, so on a disk with under ~25 GB
# free the second namespace's layout was refused (err 10047) and ~90 tests errored.
# Test data is kilobytes: cap the streams (an operator's own values win).
os.environ.setdefault("JOYNEXUS_TQ_MAX_BYTES", "1G")
os.environ.setdefault("JOYNEXUS_METRICS_MAX_BYTES", "256M")

import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from joynexus.broker.connection import Broker
from joynexus.broker.layout import LayoutOptions, delete_layout, ensure_layout
from joynexus.broker.subjects import Names
from joynexus.ops.runtime.natsserver import EmbeddedNats

_ns_counter = itertools.count()
_SYSTEM = Path(__file__).resolve().parent / "system"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/system/ ``slow`` (the fast lane leaves them out)."""
    for item in items:
        if _SYSTEM in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    return f"t{next(_ns_counter)}{uuid.uuid4().hex[:6]}"


@pytest.fixture
async def broker(nats_server: EmbeddedNats, namespace: str) -> AsyncIterator[Broker]:
    b = await Broker.connect(nats_server.url, name="test", namespace=namespace)
    await ensure_layout(b, LayoutOptions(tq_ttl_s=600))
    yield b
    await delete_layout(b)  # leave the shared server clean for the next test
    await b.close()


@pytest.fixture
async def as_tenant(
    nats_server: EmbeddedNats, namespace: str
) -> AsyncIterator[Callable[[str], Awaitable[Broker]]]:
    """``await as_tenant("acme")``: a connection whose replies arrive in acme's
    inboxes, as an SDK client's do (a request on a tenant's subject is answered
    only there)."""
    opened: list[Broker] = []

    async def connect(tenant: str) -> Broker:
        b = await Broker.connect(nats_server.url, name=f"test-{tenant}", namespace=namespace,
                                 inbox_prefix=Names(namespace).inbox_prefix(tenant))
        opened.append(b)
        return b

    yield connect
    for b in opened:
        await b.close()


@pytest.fixture
def tmp_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(autouse=True)
def _clearml_env_stays_in_its_test() -> Iterator[None]:
    """ClearML's Task.init, run in-process by a monitor test, sets CLEARML_PROC_MASTER_ID,
    CLEARML_OFFLINE_MODE (and their TRAINS_ twins) in os.environ; every process a later
    test starts inherits them, and its monitor's ClearML task then fails to start (it
    takes itself for a subprocess of the first). Each test gets the environment's
    ClearML variables as they were before it."""
    before = {k: v for k, v in os.environ.items() if k.startswith(("CLEARML_", "TRAINS_"))}
    yield
    for k in [k for k in os.environ if k.startswith(("CLEARML_", "TRAINS_"))]:
        if k not in before:
            del os.environ[k]
    os.environ.update(before)


@pytest.fixture(autouse=True)
async def _dump_tasks_before_timeout(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """If a test is about to hit its time limit, print where every asyncio task waits."""
    import asyncio
    import sys

    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 120)

    def dump() -> None:
        print(f"\n--- asyncio tasks {limit - 5:.0f}s into {request.node.nodeid} ---", file=sys.stderr)
        for task in asyncio.all_tasks():
            task.print_stack(limit=8, file=sys.stderr)

    handle = asyncio.get_running_loop().call_later(max(1.0, limit - 5), dump)
    yield
    handle.cancel()


@pytest.fixture(scope="session")
def _span_exporter():  # type: ignore[no-untyped-def]
    """One SDK tracer provider for the session (OpenTelemetry sets the global one once)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # a test installed the product's provider first
        current.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    return exporter


@pytest.fixture
def spans(_span_exporter):  # type: ignore[no-untyped-def]
    """Finished spans of this test (the exporter is emptied before it)."""
    _span_exporter.clear()
    return _span_exporter


@pytest.fixture
def early_kv_marker(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every nats-py KV watch gives its end-of-current-values marker (``None``) first,
    ahead of the values: what nats.py#842 does when the consumer's deliveries are
    still on their way as it reads the consumer's info (seen here about 1 watch in
    200 on a loaded 2-core machine). The list counts the watches it moved a marker in."""
    from nats.js.kv import KeyValue

    original = KeyValue.watch
    moved: list[int] = []

    async def watch(self, keys, **kwargs):  # type: ignore[no-untyped-def]
        watcher = await original(self, keys, **kwargs)
        queued = []
        while not watcher._updates.empty():
            queued.append(watcher._updates.get_nowait())
        values = [e for e in queued if e is not None]
        watcher._updates.put_nowait(None)
        watcher._init_done = True  # the marker is sent: nats-py sends no other
        for e in values:
            watcher._updates.put_nowait(e)
        moved.append(len(values))
        return watcher

    monkeypatch.setattr(KeyValue, "watch", watch)
    return moved


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network: any connection attempt fails the test (LeRobot must not reach a hub)."""
    import socket

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*a: object, **kw: object) -> None:
        raise AssertionError(f"network access attempted: {a}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
