"""The nats-server of a benchmark run without ``--nats``: a fresh embedded one in
a temporary directory, stopped (and its store removed) when the run ends."""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from joynexus.ops.runtime.natsserver import EmbeddedNats

__all__ = ["on_server"]


async def on_server(
    url: str | None, bench: Callable[..., Awaitable[dict[str, Any]]], **kw: Any
) -> dict[str, Any]:
    """``bench(url, **kw)``, or against a fresh embedded nats-server when ``url`` is empty."""
    if url:
        return await bench(url, **kw)
    with tempfile.TemporaryDirectory() as d, EmbeddedNats(d) as server:
        return await bench(server.url, **kw)
