"""Where the traces go: OpenTelemetry setup for every JoyNexus process.

``broker/tracing.py`` only creates spans and carries their context; this
decides where finished spans go: OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT``
(or ``..._TRACES_ENDPOINT``) is set (the exporter imported lazily, its
absence a clear error), and ``<out_dir>/traces.jsonl`` when ``out_dir`` is
given. Several processes may append to one file: each batch is one ``write``
on an ``O_APPEND`` descriptor, so lines do not interleave on a local file
system. ``load_traces`` / ``traces_by_id`` read it back.

See docs/ARCHITECTURE.md, "Traces and monitoring".
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from joynexus.schemas.errors import InvalidSpec

log = logging.getLogger(__name__)

TRACES_FILE = "traces.jsonl"
OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
OTLP_PACKAGES = {
    "http/protobuf": "opentelemetry-exporter-otlp-proto-http",
    "grpc": "opentelemetry-exporter-otlp-proto-grpc",
}

# One lock per file for every exporter of this process (two providers may share a file).
_file_locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
_file_locks_guard = threading.Lock()


def _lock_for(path: Path) -> threading.Lock:
    with _file_locks_guard:
        return _file_locks[str(path.resolve())]


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as plain JSON data (ids as lowercase hex, times in epoch seconds)."""
    ctx = span.get_span_context()
    parent = span.parent
    start = (span.start_time or 0) / 1e9
    end = (span.end_time or 0) / 1e9
    return {
        "trace_id": format(ctx.trace_id, "032x") if ctx else "",
        "span_id": format(ctx.span_id, "016x") if ctx else "",
        "parent_span_id": format(parent.span_id, "016x") if parent else None,
        "parent_remote": bool(parent.is_remote) if parent else False,
        "name": span.name,
        "service": str(span.resource.attributes.get("service.name", "")),
        "scope": span.instrumentation_scope.name if span.instrumentation_scope else "",
        "kind": span.kind.name,
        "start": start,
        "end": end,
        "duration_ms": (end - start) * 1e3,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
        "events": [
            {
                "name": e.name,
                "at": e.timestamp / 1e9,
                "attributes": {k: _jsonable(v) for k, v in (e.attributes or {}).items()},
            }
            for e in span.events
        ],
        "links": [
            {
                "trace_id": format(li.context.trace_id, "032x"),
                "span_id": format(li.context.span_id, "016x"),
            }
            for li in span.links
        ],
    }


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (thread-safe)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = _lock_for(self.path)
        self._closed = False
        self.exported = 0

    def retarget(self, path: Path) -> None:
        """Write further spans to ``path`` (a repeated ``setup_tracing`` with another out_dir)."""
        path = Path(path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path, self._lock = path, _lock_for(path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        if not spans:
            return SpanExportResult.SUCCESS
        data = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans).encode()
        try:
            with self._lock:
                # Owner-only: spans carry tenants' ids, workload names and errors.
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
        except OSError as e:
            log.warning("cannot write spans to %s: %s", self.path, e)
            return SpanExportResult.FAILURE
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is written through

    def shutdown(self) -> None:
        self._closed = True


def otlp_endpoint() -> str | None:
    for var in OTLP_ENDPOINT_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def _otlp_exporter() -> SpanExporter:
    """The OTLP span exporter for the configured protocol, imported only when asked for."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol not in OTLP_PACKAGES:
        raise InvalidSpec(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use one of {sorted(OTLP_PACKAGES)}"
        )
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
    except ImportError as e:
        raise InvalidSpec(
            f"traces go to OTLP endpoint {otlp_endpoint()!r} ({protocol}), but the exporter "
            f"package is not installed: `pip install {OTLP_PACKAGES[protocol]}`, or unset "
            f"{' / '.join(OTLP_ENDPOINT_VARS)} to write traces to a local file"
        ) from e
    exporter: SpanExporter = OTLPSpanExporter()  # reads endpoint, headers, timeout from the env
    return exporter


@dataclass
class _Installed:
    provider: TracerProvider
    service_name: str
    file_exporter: JsonlSpanExporter | None
    otlp: bool


_installed: _Installed | None = None
_install_lock = threading.Lock()


def build_provider(service_name: str, *, out_dir: Path | None = None) -> TracerProvider:
    """A provider with this module's exporters, not installed globally (tests, embedding)."""
    provider, _, _ = _build(service_name, out_dir)
    return provider


def _build(
    service_name: str, out_dir: Path | None
) -> tuple[TracerProvider, JsonlSpanExporter | None, bool]:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    otlp = otlp_endpoint() is not None
    if otlp:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    file_exporter = None
    if out_dir is not None:
        file_exporter = JsonlSpanExporter(Path(out_dir) / TRACES_FILE)
        provider.add_span_processor(BatchSpanProcessor(file_exporter, schedule_delay_millis=1000))
    if not otlp and out_dir is None:
        log.info("tracing: no OTLP endpoint and no out_dir; spans are not exported")
    return provider, file_exporter, otlp


def setup_tracing(service_name: str, *, out_dir: Path | None = None) -> TracerProvider:
    """Install the process's tracer provider (once) and return it.

    OTLP when an endpoint is configured; ``<out_dir>/traces.jsonl`` when
    ``out_dir`` is given. OpenTelemetry allows one global provider per
    process, so a second call returns the installed provider: a new
    ``out_dir`` moves its file exporter there (adding one if it had none);
    a different ``service_name`` is logged and ignored (the resource is
    fixed). Spans are flushed by ``provider.shutdown()``, which the provider
    also registers at exit.
    """
    global _installed
    with _install_lock:
        if _installed is not None:
            inst = _installed
            if service_name != inst.service_name:
                log.warning(
                    "tracing already set up for service %r; %r shares that provider",
                    inst.service_name,
                    service_name,
                )
            if out_dir is not None:
                path = Path(out_dir) / TRACES_FILE
                if inst.file_exporter is None:
                    inst.file_exporter = JsonlSpanExporter(path)
                    inst.provider.add_span_processor(
                        BatchSpanProcessor(inst.file_exporter, schedule_delay_millis=1000)
                    )
                elif inst.file_exporter.path != path:
                    inst.provider.force_flush()
                    inst.file_exporter.retarget(path)
            return inst.provider

        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            # Someone else installed an SDK provider: add our exporters to it.
            log.warning("a tracer provider is already installed; adding JoyNexus exporters to it")
            file_exporter = None
            otlp = otlp_endpoint() is not None
            if otlp:
                current.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
            if out_dir is not None:
                file_exporter = JsonlSpanExporter(Path(out_dir) / TRACES_FILE)
                current.add_span_processor(
                    BatchSpanProcessor(file_exporter, schedule_delay_millis=1000)
                )
            _installed = _Installed(current, service_name, file_exporter, otlp)
            return current

        provider, file_exporter, otlp = _build(service_name, out_dir)
        trace.set_tracer_provider(provider)
        if trace.get_tracer_provider() is not provider:
            # A non-SDK provider was set first; ours still works when passed explicitly.
            log.warning("could not install the tracer provider globally (one was set already)")
        _installed = _Installed(provider, service_name, file_exporter, otlp)
        return provider


def traces_path(out_dir: Path) -> Path:
    return Path(out_dir) / TRACES_FILE


def load_traces(path: Path) -> list[dict[str, Any]]:
    """Every span in a traces.jsonl file (a torn last line is skipped), in start order."""
    path = Path(path)
    if path.is_dir():
        path = path / TRACES_FILE
    spans: list[dict[str, Any]] = []
    if not path.exists():
        return spans
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                span = json.loads(line)
            except ValueError:
                log.warning("%s:%d: not a JSON span, skipped", path, n)
                continue
            if isinstance(span, dict) and "trace_id" in span:
                spans.append(span)
    spans.sort(key=lambda s: s.get("start", 0.0))
    return spans


def traces_by_id(spans: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Spans grouped by trace id, each trace in start order."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in sorted(spans, key=lambda s: s.get("start", 0.0)):
        out[s["trace_id"]].append(s)
    return dict(out)


def busy_intervals(
    spans: Sequence[dict[str, Any]], *, name_prefix: str = "", service: str | None = None
) -> list[tuple[float, float]]:
    """(start, end) of the spans whose name starts with ``name_prefix`` (and of ``service``):
    the busy intervals that ``plots.plot_utilization_timeline`` draws."""
    return [
        (float(s["start"]), float(s["end"]))
        for s in spans
        if s.get("name", "").startswith(name_prefix)
        and (service is None or s.get("service") == service)
    ]
