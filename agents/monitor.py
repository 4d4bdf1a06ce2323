"""The monitor agent: every metric of the deployment, in one place.

Agents publish fire-and-forget metric events on ``<ns>.metrics.<kind>.<tenant>``
(``broker/metrics.py``); stream ``<NS>_METRICS`` captures them. The monitor
reads that stream through a durable pull consumer (``monitor``), so a
restarted monitor resumes where it stopped, and

* appends every metric, as received, to ``<out_dir>/metrics.jsonl`` (a
  restarted monitor replays that file to rebuild its aggregates);
* keeps per-tenant aggregates (:class:`MetricAggregates`, a pure fold with
  no I/O): loss per policy version, rollout and eval success, queue depths,
  utilization and health events, the latest value of every numeric field;
* reports scalars to ClearML, one task per monitor run: title = the metric
  (``loss``, ``eval_success``, ``control/tq_bytes``...), series = the tenant.
  Without a configured server (``CLEARML_API_HOST`` or a clearml.conf) the
  task runs offline and its session lands in
  ``<out_dir>/clearml/offline/<task_id>/`` plus ``<task_id>.zip`` on close
  (``clearml.Task.import_offline_session(<zip>)`` uploads it later);
* polls JetStream every ``control_poll_s`` for queue depths (pending and
  ack-pending of every consumer of the job log, Training Queue bytes and
  messages, the scheduler's jobs per tenant and state) and emits them as
  ``control`` metrics, so they are in the stream like any other signal.

Metric kinds it understands (any other kind is kept generically):
``learning`` (``loss`` + ``version``; ``rollout_success``/``mean_reward`` +
``behavior_version``; ``eval_success``, ``eval_return`` + ``version``: ClearML
scalars against the version evaluated), ``control`` (numeric
fields, one level of nested dicts flattened as ``a.b``), ``system``
(``service`` + ``busy_start``/``busy_end``: a busy interval of the training or
inference service, ``broker.metrics.busy``; other numeric fields as series;
``event`` marks a health event), ``health`` (every message is a health event),
``security`` (refused attempts: an event stands for ``count`` of them, 1 when
absent, as ``broker.metrics.security`` counts repeats; summed per tenant as
``refusals``, the last events kept with action, subject, reason and source;
failed logins are tenant ``_``'s, with the ``claimed_user``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import orjson
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from joynexus.broker import metrics, usage
from joynexus.broker.connection import Broker
from joynexus.schemas.errors import InvalidMessage, JoyNexusError

log = logging.getLogger(__name__)

#: Durable consumer of the metrics stream (to move into broker/subjects.Names).
MONITOR_CONSUMER = "monitor"
METRICS_FILE = "metrics.jsonl"
GLOBAL_TENANT = "_"

#: Fields that identify a metric rather than measure something.
_ID_FIELDS = frozenset(
    {"kind", "tenant_id", "at", "version", "behavior_version", "job_id", "seq", "subject", "source"}
)


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class Metric:
    kind: str
    tenant_id: str
    at: float
    fields: dict[str, Any]
    subject: str = ""
    seq: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "tenant_id": self.tenant_id,
            "at": self.at,
            **self.fields,
            "subject": self.subject,
            "seq": self.seq,
        }


def decode_metric(subject: str, data: bytes, seq: int = 0) -> Metric:
    """A metric message -> :class:`Metric`; kind and tenant default to the subject's tokens.

    Raises :class:`InvalidMessage` for anything that is not a JSON object.
    """
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise InvalidMessage(f"metric on {subject}: not JSON ({e})") from e
    if not isinstance(obj, dict):
        raise InvalidMessage(f"metric on {subject}: a JSON {type(obj).__name__}, not an object")
    parts = subject.split(".")
    kind = obj.pop("kind", None) or (parts[2] if len(parts) > 3 else "unknown")
    tenant = obj.pop("tenant_id", None) or (parts[3] if len(parts) > 3 else GLOBAL_TENANT)
    at = obj.pop("at", None)
    if not isinstance(at, int | float) or isinstance(at, bool):
        at = time.time()
    obj.pop("subject", None)
    obj.pop("seq", None)
    return Metric(str(kind), str(tenant), float(at), obj, subject, seq)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def numeric_fields(fields: dict[str, Any]) -> dict[str, float]:
    """Numeric fields, nested dicts flattened one level (``pending.stage-advantages``)."""
    out: dict[str, float] = {}
    for k, v in fields.items():
        if k in _ID_FIELDS:
            continue
        if isinstance(v, dict):
            for k2, v2 in v.items():
                n = _number(v2)
                if n is not None:
                    out[f"{k}.{k2}"] = n
        else:
            n = _number(v)
            if n is not None:
                out[k] = n
    return out


# --------------------------------------------------------------------------- the pure fold


@dataclass(frozen=True)
class Scalar:
    """One point for ClearML: ``report_scalar(title, series, value, iteration)``."""

    title: str
    series: str
    value: float
    iteration: int


@dataclass
class TenantAggregates:
    updates: int = 0
    last_version: int | None = None
    losses: list[dict[str, Any]] = field(default_factory=list)
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    #: "<kind>/<field>" -> [(at, value)]: queue depths, utilization, anything numeric.
    series: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    latest: dict[str, float] = field(default_factory=dict)
    health: list[dict[str, Any]] = field(default_factory=list)
    #: Refused attempts (security events), the newest last.
    refusals: list[dict[str, Any]] = field(default_factory=list)
    #: Refused attempts: the sum of the security events' ``count``.
    refused: int = 0
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: service ("train", "infer") -> busy (start, end) intervals in epoch seconds.
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))

    def busy_summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for service, iv in self.busy.items():
            t0, t1 = min(s for s, _ in iv), max(e for _, e in iv)
            total = sum(e - s for s, e in iv)
            out[service] = {
                "intervals": len(iv),
                "busy_s": total,
                "span_s": t1 - t0,
                "utilization": total / (t1 - t0) if t1 > t0 else 0.0,
            }
        return out

    def summary(self) -> dict[str, Any]:
        successes = [
            r["rollout_success"] for r in self.rollouts if r.get("rollout_success") is not None
        ]
        return {
            "updates": self.updates,
            "last_version": self.last_version,
            "losses": [{"version": x["version"], "loss": x["loss"]} for x in self.losses],
            "last_loss": self.losses[-1]["loss"] if self.losses else None,
            "rollouts": len(self.rollouts),
            "last_rollout_success": successes[-1] if successes else None,
            "mean_rollout_success": sum(successes) / len(successes) if successes else None,
            "evals": list(self.evals),
            "last_eval": self.evals[-1] if self.evals else None,
            "series": {k: list(v) for k, v in self.series.items()},
            "latest": dict(self.latest),
            "health_events": list(self.health),
            "refusals": self.refused,
            "last_refusals": list(self.refusals),
            "counts": dict(self.counts),
            "busy": self.busy_summary(),
        }


class MetricAggregates:
    """Per-tenant aggregates of the metric stream: a fold with no I/O.

    ``apply(metric)`` updates the aggregates and returns the scalars to report.
    Every time series keeps its newest ``max_points`` points.
    """

    def __init__(self, max_points: int = 100_000) -> None:
        self.max_points = max_points
        self.tenants: dict[str, TenantAggregates] = defaultdict(TenantAggregates)
        self.total = 0
        self.malformed = 0
        self._counters: dict[tuple[str, str], int] = defaultdict(int)
        #: Usage per tenant folded from the busy intervals (broker.usage): ClearML
        #: scalars "usage <figure>", one series per tenant.
        self.usage = usage.empty_state()

    def _tick(self, title: str, tenant: str) -> int:
        self._counters[title, tenant] += 1
        return self._counters[title, tenant] - 1

    def _keep(self, xs: list[Any]) -> None:
        if len(xs) > self.max_points:
            del xs[: len(xs) - self.max_points]

    def apply(self, m: Metric) -> list[Scalar]:
        self.total += 1
        t = self.tenants[m.tenant_id]
        t.counts[m.kind] += 1
        f = m.fields
        out: list[Scalar] = []
        nums = numeric_fields(f)
        t.latest.update(nums)
        tenant = m.tenant_id

        version = _number(f.get("version"))
        handled: set[str] = set()
        if m.kind == "learning":
            if (loss := _number(f.get("loss"))) is not None:
                t.updates += 1
                it = int(version) if version is not None else t.updates
                t.last_version = it if version is not None else t.last_version
                t.losses.append(
                    {
                        "version": it,
                        "loss": loss,
                        "at": m.at,
                        **{
                            k: f[k]
                            for k in ("task_type", "workload", "job_id", "group_size", "samples")
                            if k in f
                        },
                    }
                )
                self._keep(t.losses)
                out.append(Scalar("loss", tenant, loss, it))
                handled.add("loss")
            if (succ := _number(f.get("eval_success"))) is not None:
                v = int(version) if version is not None else len(t.evals)
                ret = _number(f.get("eval_return"))
                t.evals.append({
                    "version": v, "eval_success": succ, "eval_return": ret, "at": m.at,
                    **{k: f[k] for k in ("workload", "evaluation") if isinstance(f.get(k), str)},
                })
                self._keep(t.evals)
                # Success and return against the version evaluated, one series per tenant.
                out.append(Scalar("eval_success", tenant, succ, v))
                if ret is not None:
                    out.append(Scalar("eval_return", tenant, ret, v))
                handled.update(("eval_success", "eval_return"))
            rs, rw = _number(f.get("rollout_success")), _number(f.get("mean_reward"))
            if rs is not None or rw is not None:
                n = len(t.rollouts)
                bv = _number(f.get("behavior_version"))
                t.rollouts.append(
                    {
                        "at": m.at,
                        "rollout_success": rs,
                        "mean_reward": rw,
                        "behavior_version": int(bv) if bv is not None else None,
                    }
                )
                self._keep(t.rollouts)
                if rs is not None:
                    out.append(Scalar("rollout_success", tenant, rs, n))
                if rw is not None:
                    out.append(Scalar("mean_reward", tenant, rw, n))
                handled.update(("rollout_success", "mean_reward"))
        start, end = _number(f.get("busy_start")), _number(f.get("busy_end"))
        if start is not None and end is not None and end >= start:
            service = str(f.get("service") or "service")
            t.busy[service].append((start, end))
            self._keep(t.busy[service])
            n = len(t.busy[service]) - 1
            out.append(Scalar("busy_ms", service, (end - start) * 1e3, n))
            handled.update(("busy_start", "busy_end"))
            out.extend(self._usage_scalars({**f, "kind": m.kind}))
        if m.kind == "security":
            t.refusals.append({"at": m.at, **f})
            self._keep(t.refusals)
            count = _number(f.get("count"))
            t.refused += max(1, int(count)) if count is not None else 1
            n = t.counts["security"]
            out.append(Scalar("refusals", tenant, float(t.refused), n - 1))
            handled.update(("count", "first_at", "revision"))
        if m.kind == "health" or isinstance(f.get("event"), str):
            t.health.append({"at": m.at, "kind": m.kind, **f})
            self._keep(t.health)
            out.append(Scalar("health_events", tenant, float(len(t.health)), len(t.health) - 1))
        for name, value in nums.items():
            if name in handled:
                continue
            key = f"{m.kind}/{name}"
            s = t.series[key]
            s.append((m.at, value))
            self._keep(s)
            out.append(Scalar(key, tenant, value, self._tick(key, tenant)))
        return out

    def _usage_scalars(self, fields: dict[str, Any]) -> list[Scalar]:
        """The running usage totals of the tenants a busy interval touched."""
        before = {t: dict(v) for t, v in self.usage["tenants"].items()}
        usage.fold_metric(self.usage, fields)
        out = []
        for t, now in self.usage["tenants"].items():
            for k in ("train_s", "infer_s", "env_s", "infer_requests"):
                if k in now and now[k] != before.get(t, {}).get(k):
                    out.append(Scalar(f"usage {k}", t, float(now[k]), self._tick(f"usage {k}", t)))
        return out

    def timelines(self) -> dict[str, list[tuple[float, float]]]:
        """Busy intervals per service, every tenant merged: what
        ``report.plot_utilization_timeline`` draws for one run."""
        out: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for t in self.tenants.values():
            for service, iv in t.busy.items():
                out[service].extend(iv)
        return {k: sorted(v) for k, v in out.items()}

    def summary(self) -> dict[str, Any]:
        return {
            "metrics": self.total,
            "malformed": self.malformed,
            "tenants": {k: v.summary() for k, v in sorted(self.tenants.items())},
        }


# --------------------------------------------------------------------------- ClearML


def clearml_server_configured() -> bool:
    """A ClearML server is configured: ``CLEARML_API_HOST``, or a clearml.conf file
    (``CLEARML_CONFIG_FILE``, ``~/clearml.conf``); ``CLEARML_OFFLINE_MODE=1`` forces offline."""
    if os.environ.get("CLEARML_OFFLINE_MODE", "").lower() in ("1", "true", "yes", "on"):
        return False
    if os.environ.get("CLEARML_API_HOST") or os.environ.get("TRAINS_API_HOST"):
        return True
    conf = os.environ.get("CLEARML_CONFIG_FILE")
    candidates = [Path(conf)] if conf else [Path("~/clearml.conf"), Path("~/.clearml.conf")]
    return any(p.expanduser().is_file() for p in candidates)


class ClearMLSink:
    """One ClearML task: created by ``start`` and closed by ``close`` (both block:
    call them in a worker thread); ``report`` only queues."""

    def __init__(
        self,
        *,
        project: str,
        task_name: str,
        cache_dir: Path,
        offline: bool | None = None,
    ) -> None:
        self.project = project
        self.task_name = task_name
        self.cache_dir = Path(cache_dir)
        self.offline = (not clearml_server_configured()) if offline is None else offline
        self.task: Any = None
        self.task_id: str | None = None
        self.session_dir: Path | None = None
        self.reported = 0

    @property
    def session_zip(self) -> Path | None:
        return self.session_dir.with_suffix(".zip") if self.session_dir else None

    def start(self) -> None:
        try:
            from clearml import Task
        except ImportError:
            log.warning("clearml is not installed (`pip install clearml`); metrics stay local")
            return
        # A forked reporter subprocess would inherit the NATS socket and make close wait
        # ~10 s; a reporter thread is enough for a few scalars per second.
        Task._report_subprocess_enabled = False  # type: ignore[assignment]
        prev_cache = os.environ.get("CLEARML_CACHE_DIR")
        if self.offline:
            # Before Task.init: the task then never contacts a server.
            Task.set_offline(offline_mode=True)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            os.environ["CLEARML_CACHE_DIR"] = str(self.cache_dir)
        try:
            # Called from a worker thread, Task.init cannot take over the process's
            # signal handlers (it would replace the agent's graceful SIGTERM stop).
            self.task = Task.init(
                project_name=self.project,
                task_name=self.task_name,
                task_type=Task.TaskTypes.monitor,
                reuse_last_task_id=False,
                auto_connect_frameworks=False,
                auto_connect_arg_parser=False,
                auto_resource_monitoring=False,
                auto_connect_streams=False,
            )
            self.task_id = self.task.id
            if self.offline:
                folder = self.task.get_offline_mode_folder()
                self.session_dir = Path(folder) if folder else None
        finally:
            if self.offline:
                if prev_cache is None:
                    os.environ.pop("CLEARML_CACHE_DIR", None)
                else:
                    os.environ["CLEARML_CACHE_DIR"] = prev_cache

    def report(self, scalars: list[Scalar]) -> None:
        if self.task is None:
            return
        logger = self.task.get_logger()
        for s in scalars:
            logger.report_scalar(s.title, s.series, value=s.value, iteration=s.iteration)
        self.reported += len(scalars)

    def close(self) -> None:
        if self.task is None:
            return
        task, self.task = self.task, None
        try:
            task.flush(wait_for_uploads=True)
        finally:
            task.close()
        if self.offline:
            with contextlib.suppress(Exception):
                from clearml import Task

                Task.set_offline(offline_mode=False)
        if self.session_zip:
            log.info("ClearML offline session: %s", self.session_zip)

    def info(self) -> dict[str, Any]:
        return {
            "offline": self.offline,
            "task_id": self.task_id,
            "session_dir": str(self.session_dir) if self.session_dir else None,
            "session_zip": str(self.session_zip) if self.session_zip else None,
            "reported": self.reported,
        }


def read_offline_scalars(session: Path) -> list[dict[str, Any]]:
    """The scalars of an offline ClearML session (its folder or its zip)."""
    import json
    import zipfile

    session = Path(session)
    chunks: list[bytes] = []
    if session.suffix == ".zip":
        with zipfile.ZipFile(session) as zf:
            if "metrics.jsonl" in zf.namelist():
                chunks = zf.read("metrics.jsonl").splitlines()
    elif (session / "metrics.jsonl").exists():
        chunks = (session / "metrics.jsonl").read_bytes().splitlines()
    out: list[dict[str, Any]] = []
    for line in chunks:
        if not line.strip():
            continue
        # Each line is a JSON list of events (one flush of the reporter).
        events = json.loads(line)
        for ev in events if isinstance(events, list) else [events]:
            if ev.get("type") == "training_stats_scalar":
                out.append(
                    {
                        "title": ev["metric"],
                        "series": ev["variant"],
                        "value": ev["value"],
                        "iteration": ev["iter"],
                    }
                )
    return out


# --------------------------------------------------------------------------- the agent


class MonitorAgent:
    def __init__(
        self,
        broker: Broker,
        *,
        out_dir: Path,
        clearml: bool = True,
        clearml_offline: bool | None = None,
        project: str = "JoyNexus",
        task_name: str | None = None,
        control_poll_s: float | None = 5.0,
        batch: int = 256,
        instance: str = "monitor",
    ) -> None:
        self.b = broker
        self.out_dir = Path(out_dir)
        self.aggregates = MetricAggregates()
        self.control_poll_s = control_poll_s
        self.batch = batch
        self.instance = instance
        self.clearml: ClearMLSink | None = None
        if clearml:
            self.clearml = ClearMLSink(
                project=project,
                task_name=task_name
                or f"monitor {broker.names.namespace} {time.strftime('%Y-%m-%d %H:%M:%S')}",
                cache_dir=self.out_dir / "clearml",
                offline=clearml_offline,
            )
        self._seen: set[tuple[int, float]] = set()
        self._file: TextIO | None = None
        self.started = asyncio.Event()

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / METRICS_FILE

    def summary(self) -> dict[str, Any]:
        s = self.aggregates.summary()
        if self.clearml is not None:
            s["clearml"] = self.clearml.info()
        return s

    # -- lifecycle

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Consume metrics until ``stop`` is set; then close the ClearML task."""
        stop = stop or asyncio.Event()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        replayed = self._replay()
        if self.clearml is not None:
            try:
                await asyncio.to_thread(self.clearml.start)
            except Exception as e:  # monitoring must not stop on a reporting backend
                log.warning("ClearML task could not start (%s); metrics stay local", e)
            else:
                self.clearml.report(replayed)
        self._file = self.metrics_path.open("a", encoding="utf-8")
        poller: asyncio.Task[None] | None = None
        try:
            sub = await self._subscribe()
            if self.control_poll_s:
                poller = asyncio.create_task(self._poll_control_loop(stop))
            self.started.set()
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.batch, timeout=1.0)
                except TimeoutError:
                    continue
                await self._handle(msgs)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        finally:
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await poller
            self._file.close()
            self._file = None
            if self.clearml is not None:
                try:
                    await asyncio.to_thread(self.clearml.close)
                except Exception as e:
                    log.warning("ClearML task did not close cleanly: %s", e)

    async def _subscribe(self) -> Any:
        n = self.b.names
        return await self.b.js.pull_subscribe(
            n.all_metrics,
            durable=MONITOR_CONSUMER,
            stream=n.metrics_stream,
            config=ConsumerConfig(
                description="monitor: every metric to metrics.jsonl, aggregates and ClearML",
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30,
                max_ack_pending=10_000,
            ),
        )

    def _replay(self) -> list[Scalar]:
        """Rebuild the aggregates from metrics.jsonl (a restarted monitor)."""
        scalars: list[Scalar] = []
        if not self.metrics_path.exists():
            return scalars
        with self.metrics_path.open("rb") as f:
            for line in f:
                try:
                    obj = orjson.loads(line)
                    m = decode_metric(obj.get("subject", ""), line, int(obj.get("seq", 0)))
                except (
                    orjson.JSONDecodeError,
                    InvalidMessage,
                    AttributeError,
                    ValueError,
                    TypeError,
                ):
                    continue  # a torn last line after a crash
                self._seen.add((m.seq, m.at))
                scalars.extend(self.aggregates.apply(m))
        log.info("monitor: replayed %d metrics from %s", self.aggregates.total, self.metrics_path)
        return scalars

    async def _handle(self, msgs: list[Msg]) -> None:
        assert self._file is not None
        scalars: list[Scalar] = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            try:
                m = decode_metric(msg.subject, msg.data, seq)
            except InvalidMessage as e:
                self.aggregates.malformed += 1
                log.warning("monitor: skipped metric seq %s: %s", seq, e)
                continue
            if (m.seq, m.at) in self._seen:
                continue  # redelivered after a crash between write and ack
            self._file.write(
                orjson.dumps(m.to_json(), option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
            )
            scalars.extend(self.aggregates.apply(m))
        self._file.flush()
        if self.clearml is not None:
            try:
                self.clearml.report(scalars)
            except Exception as e:
                log.warning("ClearML report failed: %s", e)
        for msg in msgs:
            with contextlib.suppress(Exception):
                await msg.ack()

    # -- control-plane signals

    async def _poll_control_loop(self, stop: asyncio.Event) -> None:
        assert self.control_poll_s
        while not stop.is_set():
            try:
                await self.poll_control()
            except Exception as e:
                log.debug("monitor: control poll failed: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.control_poll_s)

    async def poll_control(self) -> dict[str, Any]:
        """Queue depths from JetStream (and the scheduler, when it answers), emitted
        as ``control`` metrics; returns what was emitted for the global tenant."""
        n = self.b.names
        fields: dict[str, Any] = {"source": self.instance}
        with contextlib.suppress(NotFoundError):
            info = await self.b.js.stream_info(n.tq_stream)
            fields["tq_bytes"] = info.state.bytes
            fields["tq_messages"] = info.state.messages
        with contextlib.suppress(NotFoundError):
            info = await self.b.js.stream_info(n.jobs_stream)
            fields["job_events"] = info.state.messages
            pending, ack_pending = {}, {}
            for c in await self.b.js.consumers_info(n.jobs_stream):
                pending[c.name] = c.num_pending
                ack_pending[c.name] = c.num_ack_pending
            fields["pending"] = pending
            fields["ack_pending"] = ack_pending
        await metrics.emit(self.b, "control", GLOBAL_TENANT, **fields)
        try:
            from joynexus.agents.scheduler_client import SchedulerClient

            snap = await SchedulerClient(
                self.b, by=self.instance, call_timeout_s=1.0, deadline_s=1.5
            ).snapshot()
        except JoyNexusError:
            return fields  # no scheduler: JetStream's view is still recorded
        for tenant, states in snap.jobs_by_tenant_state.items():
            await metrics.emit(self.b, "control", tenant, source=self.instance, jobs=dict(states))
        return fields
