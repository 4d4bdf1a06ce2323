"""OpenTelemetry context in NATS headers (W3C ``traceparent``).

Every message the broker layer publishes carries the caller's current trace
context; every consumer restores it, so one training job or one inference
request is one trace across agents.

See docs/ARCHITECTURE.md, "Traces and monitoring".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def start_job_trace(name: str, **attributes: Any) -> tuple[trace.Span, str]:
    """Start the root span of one training job's trace and return it with its
    ``traceparent``, which the job carries in ``metadata.extra`` so every agent
    that works on the job (producer, stage workers, actor) joins the same trace.
    End the span when the producer's part is done; a span never ended (the
    reserve was refused) is simply not exported."""
    span = tracer.start_span(name, attributes=attributes)
    headers: dict[str, str] = {}
    _propagator.inject(headers, context=trace.set_span_in_context(span))
    return span, headers.get("traceparent", "")


def job_context(extra: Mapping[str, str]) -> otel_context.Context:
    """The trace context of a job, from its metadata (empty if it has none)."""
    return extract({"traceparent": extra["traceparent"]} if "traceparent" in extra else {})
