"""Test fixtures: one real nats-server per test session, a namespace per test.

The server runs on a random port with a temporary file store; readiness comes
from its log. Tests that share it get their own namespace, hence their own
streams and subjects.
"""

from __future__ import annotations

import os

os.environ.setdefault("JOYNEXUS_STRICT_DECODE", "1")

import itertools
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from joynexus.broker.connection import Broker
from joynexus.broker.layout import LayoutOptions, delete_layout, ensure_layout
from joynexus.ops.natsserver import EmbeddedNats

_ns_counter = itertools.count()


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
def tmp_dir(tmp_path: Path) -> Path:
    return tmp_path


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
