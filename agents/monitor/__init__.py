"""The monitor: every metric of the deployment, in one place (role ``monitor``).

One module per job; this package re-exports every name, so ``from
joynexus.agents.monitor import MonitorAgent`` keeps working. See
docs/ARCHITECTURE.md, "Layout and import root" (the modules) and "Traces and
monitoring" (what the monitor does with each metric kind).

    metric        Metric, decode_metric, numeric_fields (pure)
    aggregates    MetricAggregates, TenantAggregates, Scalar: the fold (pure)
    clearml_sink  ClearMLSink, clearml_server_configured
    offline       read_offline_scalars: an offline ClearML session read back
    depths        poll_queue_depths: JetStream's and the scheduler's queues as metrics
    agent         MonitorAgent: the consumer loop around them
"""

from __future__ import annotations

from joynexus.agents.monitor.agent import METRICS_FILE, MONITOR_CONSUMER, MonitorAgent
from joynexus.agents.monitor.aggregates import MetricAggregates, Scalar, TenantAggregates
from joynexus.agents.monitor.clearml_sink import ClearMLSink, clearml_server_configured
from joynexus.agents.monitor.depths import poll_queue_depths
from joynexus.agents.monitor.metric import GLOBAL_TENANT, Metric, decode_metric, numeric_fields
from joynexus.agents.monitor.offline import read_offline_scalars

__all__ = [
    "GLOBAL_TENANT",
    "METRICS_FILE",
    "MONITOR_CONSUMER",
    "ClearMLSink",
    "Metric",
    "MetricAggregates",
    "MonitorAgent",
    "Scalar",
    "TenantAggregates",
    "clearml_server_configured",
    "decode_metric",
    "numeric_fields",
    "poll_queue_depths",
    "read_offline_scalars",
]
