"""Monitor agent, tracing export and report plots, on the real test nats-server.

ClearML runs offline (no server, no network): the test reads the scalars back
from the offline session the task leaves in the monitor's out_dir.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.trace import SpanKind

from joynexus.agents.monitor import (
    MetricAggregates,
    MonitorAgent,
    clearml_server_configured,
    decode_metric,
    read_offline_scalars,
)
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.ops.mainjob import report
from joynexus.ops.measure import plots as report_plots
from joynexus.ops.runtime import telemetry
from joynexus.schemas.errors import InvalidMessage


async def until(cond: Callable[[], bool], within_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def start(mon: MonitorAgent) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(mon.run(stop))
    done, _ = await asyncio.wait(
        [task, asyncio.create_task(mon.started.wait())],
        timeout=30,
        return_when=asyncio.FIRST_COMPLETED,
    )
    if task in done:
        task.result()  # raises what stopped it
    assert mon.started.is_set()
    return stop, task


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- monitor


def test_decode_is_lenient_but_rejects_non_objects() -> None:
    m = decode_metric("jnx.metrics.system.acme", b'{"utilization": 0.5}', 7)
    assert (m.kind, m.tenant_id, m.seq, m.fields) == ("system", "acme", 7, {"utilization": 0.5})
    for bad in (b"not json{", b"[1, 2]", b'"x"'):
        with pytest.raises(InvalidMessage):
            decode_metric("jnx.metrics.learning.acme", bad)


def test_aggregates_fold() -> None:
    agg = MetricAggregates()
    s = agg.apply(decode_metric("n.metrics.learning.a", b'{"loss": 1.5, "version": 3}'))
    assert [(x.title, x.series, x.value, x.iteration) for x in s] == [("loss", "a", 1.5, 3)]
    s = agg.apply(
        decode_metric("n.metrics.control._", b'{"tq_bytes": 10, "pending": {"actor": 2, "x": "y"}}')
    )
    assert {(x.title, x.value) for x in s} == {
        ("control/tq_bytes", 10.0),
        ("control/pending.actor", 2.0),
    }
    agg.apply(decode_metric("n.metrics.system.a", b'{"event": "restart", "role": "actor"}'))
    s = agg.apply(
        decode_metric(
            "n.metrics.system._", b'{"service": "train", "busy_start": 10, "busy_end": 10.5}'
        )
    )
    assert [(x.title, x.series, x.value) for x in s] == [("busy_ms", "train", 500.0)]
    agg.apply(
        decode_metric(
            "n.metrics.system._", b'{"service": "train", "busy_start": 11, "busy_end": 12}'
        )
    )
    assert agg.timelines() == {"train": [(10.0, 10.5), (11.0, 12.0)]}
    assert agg.summary()["tenants"]["_"]["busy"]["train"]["utilization"] == pytest.approx(0.75)
    out = agg.summary()["tenants"]
    assert out["a"]["updates"] == 1 and out["a"]["last_version"] == 3
    assert out["a"]["health_events"][0]["role"] == "actor"
    assert out["_"]["latest"]["pending.actor"] == 2.0
    for _ in range(2):
        s = agg.apply(
            decode_metric(
                "n.metrics.security.a",
                b'{"action": "publish", "target": "n.api.b.x", "reason": "r", "source": "nats-server"}',
            )
        )
    assert [(x.title, x.series, x.value) for x in s] == [("refusals", "a", 2.0)]
    a = agg.summary()["tenants"]["a"]
    assert a["refusals"] == 2 and a["last_refusals"][-1]["target"] == "n.api.b.x"


@pytest.mark.timeout(60)
async def test_monitor_summary_file_malformed_and_restart(broker: Broker, tmp_path: Path) -> None:
    mon = MonitorAgent(broker, out_dir=tmp_path, clearml=False, control_poll_s=None)
    stop, task = await start(mon)
    n = broker.names
    await metrics.emit(
        broker, "learning", "acme", loss=0.5, version=2, task_type="rl", workload="w"
    )
    await broker.nc.publish(n.metrics("learning", "acme"), b"not json{")
    await broker.nc.publish(n.metrics("learning", "acme"), b"[1, 2]")
    await metrics.emit(
        broker, "learning", "acme", loss=0.25, version=3, task_type="rl", workload="w"
    )
    await metrics.emit(broker, "learning", "beta", eval_success=0.8, version=5)
    await metrics.emit(
        broker, "learning", "beta", rollout_success=0.5, mean_reward=0.1, behavior_version=1
    )
    await metrics.emit(broker, "system", "_", event="restart", role="actor", instance="actor-0")
    await until(lambda: mon.aggregates.total >= 5, what="5 metrics")

    s = mon.summary()
    assert s["malformed"] == 2  # skipped, and the monitor went on
    acme, beta = s["tenants"]["acme"], s["tenants"]["beta"]
    assert acme["updates"] == 2 and acme["last_version"] == 3
    assert acme["losses"] == [{"version": 2, "loss": 0.5}, {"version": 3, "loss": 0.25}]
    assert beta["last_eval"]["eval_success"] == 0.8 and beta["last_eval"]["version"] == 5
    assert beta["rollouts"] == 1 and beta["last_rollout_success"] == 0.5
    assert s["tenants"]["_"]["health_events"][0]["event"] == "restart"

    stop.set()
    await asyncio.wait_for(task, 10)
    lines = read_jsonl(mon.metrics_path)
    assert [x.get("loss") for x in lines if x["tenant_id"] == "acme"] == [0.5, 0.25]
    assert {x["kind"] for x in lines} == {"learning", "system"} and len(lines) == 5

    # A restarted monitor rebuilds from the file and resumes from its durable consumer:
    # nothing is counted twice, new metrics still arrive.
    mon2 = MonitorAgent(broker, out_dir=tmp_path, clearml=False, control_poll_s=None)
    assert mon2.summary()["metrics"] == 0
    stop2, task2 = await start(mon2)
    await metrics.emit(broker, "learning", "acme", loss=0.125, version=4)
    await until(lambda: mon2.aggregates.total >= 6, what="the 6th metric")
    await asyncio.sleep(0.2)
    assert mon2.aggregates.total == 6
    assert mon2.summary()["tenants"]["acme"]["updates"] == 3
    stop2.set()
    await asyncio.wait_for(task2, 10)
    assert len(read_jsonl(mon2.metrics_path)) == 6


@pytest.mark.timeout(60)
async def test_monitor_polls_queue_depths(broker: Broker, tmp_path: Path) -> None:
    mon = MonitorAgent(broker, out_dir=tmp_path, clearml=False, control_poll_s=None)
    emitted = await mon.poll_control()  # no scheduler runs here: JetStream's view only
    assert emitted["tq_bytes"] == 0 and "pending" in emitted
    stop, task = await start(mon)
    await until(lambda: "tq_bytes" in mon.summary()["tenants"].get("_", {}).get("latest", {}))
    assert mon.summary()["tenants"]["_"]["series"]["control/tq_messages"][0][1] == 0.0
    stop.set()
    await asyncio.wait_for(task, 10)


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # clearml's bundled pyhocon
async def test_monitor_clearml_offline(
    broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CLEARML_API_HOST", raising=False)
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(tmp_path / "no-clearml.conf"))
    assert not clearml_server_configured()
    mon = MonitorAgent(broker, out_dir=tmp_path, task_name="test-monitor", control_poll_s=None)
    stop, task = await start(mon)
    await metrics.emit(broker, "learning", "acme", loss=0.5, version=1)
    await metrics.emit(broker, "learning", "acme", loss=0.25, version=2)
    await metrics.emit(broker, "learning", "beta", eval_success=0.75, version=4)
    await until(lambda: mon.aggregates.total >= 3)
    stop.set()
    await asyncio.wait_for(task, 60)

    info = mon.summary()["clearml"]
    assert info["offline"] and info["task_id"].startswith("offline-")
    session_zip = Path(info["session_zip"])
    assert session_zip.is_relative_to(tmp_path / "clearml")
    assert session_zip.with_suffix("").joinpath("task.json").exists()  # the session folder
    got = {
        (s["title"], s["series"], s["iteration"], s["value"])
        for s in read_offline_scalars(session_zip)
    }
    assert {
        ("loss", "acme", 1, 0.5),
        ("loss", "acme", 2, 0.25),
        ("eval_success", "beta", 4, 0.75),
    } <= got


# --------------------------------------------------------------------------- telemetry


@pytest.mark.timeout(30)
async def test_traces_cross_nats_under_one_trace_id(broker: Broker, tmp_path: Path) -> None:
    # The global provider is installed once per process (and maybe by another test
    # first): setup_tracing returns the same one each time; the two "agents" here
    # get providers of their own, as two processes would.
    assert telemetry.setup_tracing("agent-a", out_dir=tmp_path / "g") is telemetry.setup_tracing(
        "agent-a", out_dir=tmp_path / "g"
    )
    provider_a = telemetry.build_provider("agent-a", out_dir=tmp_path)
    provider_b = telemetry.build_provider("agent-b", out_dir=tmp_path)
    tracer_a, tracer_b = provider_a.get_tracer("test.a"), provider_b.get_tracer("test.b")
    subject = f"{broker.names.namespace}.test.echo"

    async def handle(msg: Any) -> None:
        with tracer_b.start_as_current_span(
            "b.handle", context=tracing.extract(msg.headers), kind=SpanKind.SERVER
        ):
            with tracer_b.start_as_current_span("b.work"):
                pass
            await msg.respond(b"pong")

    sub = await broker.nc.subscribe(subject, cb=handle)
    with tracer_a.start_as_current_span("a.request", kind=SpanKind.CLIENT) as root:
        headers = tracing.inject()
        assert tracing.traceparent(headers)
        reply = await broker.nc.request(subject, b"ping", timeout=5, headers=headers)
    assert reply.data == b"pong"
    await sub.unsubscribe()
    assert provider_a.force_flush() and provider_b.force_flush()

    spans = telemetry.load_traces(tmp_path / "traces.jsonl")
    assert (tmp_path / "traces.jsonl").stat().st_mode & 0o077 == 0  # owner-only: tenants' data
    trace_id = format(root.get_span_context().trace_id, "032x")
    ours = telemetry.traces_by_id(spans)[trace_id]
    by_name = {s["name"]: s for s in ours}
    assert set(by_name) == {"a.request", "b.handle", "b.work"}
    a, h, w = by_name["a.request"], by_name["b.handle"], by_name["b.work"]
    assert a["parent_span_id"] is None and a["service"] == "agent-a"
    assert h["parent_span_id"] == a["span_id"] and h["parent_remote"] and h["service"] == "agent-b"
    assert w["parent_span_id"] == h["span_id"] and not w["parent_remote"]
    assert a["start"] <= h["start"] <= h["end"] <= a["end"]
    assert telemetry.busy_intervals(ours, name_prefix="b.", service="agent-b")


def test_otlp_without_exporter_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    # As on a base install without the exporter: its import fails.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    with pytest.raises(ValueError, match="opentelemetry-exporter-otlp-proto-http"):
        telemetry.build_provider("x")


# --------------------------------------------------------------------------- report


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    w, h = struct.unpack(">II", data[16:24])
    return w, h


def synthetic_results() -> dict[str, Any]:
    def busy(period: float, duty: float, n: int, offset: float = 0.0) -> list[list[float]]:
        return [[offset + i * period, offset + i * period + duty * period] for i in range(n)]

    tenants = {
        "rl-a": {
            "updates": 40,
            "final_version": 41,
            "dropped_stale": 2,
            "failed": 0,
            "eval_success": 0.6,
        },
        "sft-d": {
            "updates": 50,
            "final_version": 51,
            "dropped_stale": 0,
            "failed": 1,
            "eval_success": None,
        },
    }
    return {
        "title": "synthetic",
        "runs": {
            "shared": {
                "tenants": tenants,
                "device_time_s": 100.0,
                "train_util": 0.41,
                "infer_util": 0.37,
                "peak_memory_mb": {"training": 2048.0, "inference": 1500.0},
            },
            "isolated": {
                "tenants": tenants,
                "device_time_s": 140.0,
                "train_util": 0.21,
                "infer_util": 0.28,
                "peak_memory_mb": {"training": 1900.0, "inference": 1400.0},
            },
        },
        "timelines": {
            "shared": {"training": busy(2.0, 0.4, 25), "inference": busy(1.0, 0.37, 50, 0.3)},
            "isolated": {"training": busy(3.0, 0.2, 23), "inference": busy(1.5, 0.28, 46, 0.5)},
        },
        "loss_curves": {
            "rl-a": {
                "grouped": [[i, 1 / (i + 1)] for i in range(20)],
                "serial": [[i, 1.02 / (i + 1)] for i in range(20)],
            },
            "sft-d": {
                "grouped": [[i, 2 / (i + 2)] for i in range(20)],
                "serial": [[i, 2 / (i + 2)] for i in range(20)],
            },
        },
        "group_speedup": {
            "1x1": 1.0,
            "2x1": 1.3,
            "4x1": 1.7,
            "8x1": 2.0,
            "1x4": 1.0,
            "2x4": 1.5,
            "4x4": 2.6,
            "8x4": 3.24,
        },
    }


def test_report_plots_and_markdown(tmp_path: Path) -> None:
    res = synthetic_results()
    plots = {
        "utilization": report_plots.plot_utilization_timeline(res["timelines"], tmp_path / "util.png"),
        "loss_curves": report_plots.plot_loss_curves(res["loss_curves"], tmp_path / "loss.png"),
        "group_speedup": report_plots.plot_speedup_grid(res["group_speedup"], tmp_path / "speedup.png"),
    }
    for name, path in plots.items():
        assert path.stat().st_size > 5000, name
        assert png_size(path) == report_plots.figure_pixels(name), name

    md_path = report.write_report(tmp_path, res, plots)
    md = md_path.read_text()
    assert md_path == tmp_path / "report.md"
    for must in (
        "| rl-a |",
        "| sft-d |",
        "dropped_stale",
        "1.39x",
        "1.99x",
        "1.33x",
        "1.40x",
        "![utilization](util.png)",
        "2048",
    ):
        assert must in md, must
    assert json.loads((tmp_path / "report.json").read_text()) == res
    # The utilization fraction the timeline shows is the merged busy time over the span.
    assert report_plots.busy_fraction([(0, 1), (0.5, 2), (3, 4)], 0, 4) == pytest.approx(0.75)


def test_paper_results_shape(tmp_path: Path) -> None:
    """The shape ops/mainjob/run.py writes: phases at the top level, train/infer keys."""
    syn = synthetic_results()

    def phase(wall: float, tu: float, iu: float, rss: float) -> dict[str, Any]:
        return {
            "wall_s": wall,
            "device_time_s": 2 * wall,
            "utilization": {"train": tu, "infer": iu},
            "peak_rss_mb": {"train": rss, "infer": rss / 2},
        }

    row = {"task_type": "rl", "updates": 7, "final_version": 8, "dropped_stale": 1, "failed": 0}
    res = {
        "device_time_ratio": 1.5,
        "device_busy_ratio": 1.1,
        "train_util_ratio": 2.0,
        "infer_util_ratio": 1.25,
        "shared": phase(50.0, 0.4, 0.3, 3000.0),
        "isolated": phase(75.0, 0.2, 0.24, 2900.0),
        "tenants": {"acme": {**row, "eval_success": 0.5, "isolated": {**row, "updates": 6}}},
        "loss_curves": {
            t: {"grouped (shared run)": c["grouped"], "serial (isolated run)": c["serial"]}
            for t, c in syn["loss_curves"].items()
        },
        "timelines": {
            run: {"train" if k == "training" else "infer": v for k, v in services.items()}
            for run, services in syn["timelines"].items()
        },
    }
    md = report.write_paper_report(tmp_path, res).read_text()
    for must in (
        "1.50x",
        "1.10x",
        "2.00x",
        "1.25x",
        "3000",
        "1450",
        "40.0%",
        "| acme | 7 | 8 | 1 | 0 | 0.5 |",
        "| acme | 6 |",
    ):
        assert must in md, must
    assert "![utilization](plots/utilization.png)" in md and "group_speedup" not in md
    assert png_size(tmp_path / "plots" / "loss_curves.png") == report_plots.figure_pixels("loss_curves")
    assert json.loads((tmp_path / "report.json").read_text()) == res


def test_otlp_endpoint_receives_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, spans go to that collector over OTLP/HTTP
    (a collector stand-in on loopback that records what it is sent)."""
    import http.server
    import threading

    received: list[tuple[str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        provider = telemetry.build_provider("otlp-test")
        with provider.get_tracer("t").start_as_current_span("job.step"):
            pass
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        server.shutdown()
    assert received and received[0][0] == "/v1/traces"
    assert b"job.step" in received[0][1] and b"otlp-test" in received[0][1]
