"""The monitor agent: every metric of the deployment, in one place.

A durable pull consumer (``monitor``) on the metrics stream, so a restarted
monitor resumes where it stopped; every metric goes, as received, to
``<out_dir>/metrics.jsonl`` (replayed on restart to rebuild the aggregates),
into the pure ``MetricAggregates`` fold and to the ClearML sink; queue depths
are polled every ``control_poll_s``. See docs/ARCHITECTURE.md, "Traces and monitoring".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, TextIO

import orjson
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from joynexus.agents.monitor.aggregates import MetricAggregates, Scalar
from joynexus.agents.monitor.clearml_sink import ClearMLSink
from joynexus.agents.monitor.depths import poll_queue_depths
from joynexus.agents.monitor.metric import decode_metric
from joynexus.broker.connection import Broker
from joynexus.broker.tasks import cancel_and_wait
from joynexus.schemas.errors import InvalidMessage

log = logging.getLogger(__name__)

#: Durable consumer of the metrics stream (to move into broker/subjects.Names).
MONITOR_CONSUMER = "monitor"
METRICS_FILE = "metrics.jsonl"


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
                await cancel_and_wait(poller)
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
        return await poll_queue_depths(self.b, self.instance)
