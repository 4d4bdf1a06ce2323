"""OpenTelemetry context in NATS headers (W3C ``traceparent``).

Every message the broker layer publishes carries the caller's current trace
context; every consumer restores it, so one training job or one inference
request is one trace across agents.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
tracer = trace.get_tracer("joynexus")


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Add the current trace context to ``headers`` (a new dict if None)."""
    headers = {} if headers is None else headers
    _propagator.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context a message carried (an empty context if none)."""
    return _propagator.extract(dict(headers or {}))


def traceparent(headers: Mapping[str, str] | None) -> str:
    return (headers or {}).get("traceparent", "")
