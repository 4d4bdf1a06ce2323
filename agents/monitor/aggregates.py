"""Per-tenant aggregates of the metric stream: ``MetricAggregates``, a fold with no I/O.

Pure so that a restarted monitor rebuilds the same state by replaying its
``metrics.jsonl`` and the tests table it without a server; each ``apply``
also says which ClearML scalars the metric gives (title = the metric,
series = the tenant). The metric kinds and what each becomes:
docs/ARCHITECTURE.md, "Traces and monitoring".
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from joynexus.agents.monitor.metric import Metric, number, numeric_fields
from joynexus.broker import usagestate


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
        self.usage = usagestate.empty_state()

    def _tick(self, title: str, tenant: str) -> int:
        self._counters[title, tenant] += 1
        return self._counters[title, tenant] - 1

    def _keep(self, xs: list[Any]) -> None:
        if len(xs) > self.max_points:
            del xs[: len(xs) - self.max_points]

    def apply(self, m: Metric) -> list[Scalar]:
        """Fold one metric in; the scalars it gives ClearML, in order: learning,
        busy and usage, security, health, then every other numeric field as a series."""
        self.total += 1
        t = self.tenants[m.tenant_id]
        t.counts[m.kind] += 1
        nums = numeric_fields(m.fields)
        t.latest.update(nums)
        out: list[Scalar] = []
        handled: set[str] = set()
        if m.kind == "learning":
            self._learning(t, m, out, handled)
        self._busy(t, m, out, handled)
        if m.kind == "security":
            self._security(t, m, out, handled)
        if m.kind == "health" or isinstance(m.fields.get("event"), str):
            t.health.append({"at": m.at, "kind": m.kind, **m.fields})
            self._keep(t.health)
            out.append(
                Scalar("health_events", m.tenant_id, float(len(t.health)), len(t.health) - 1)
            )
        for name, value in nums.items():
            if name in handled:
                continue
            key = f"{m.kind}/{name}"
            s = t.series[key]
            s.append((m.at, value))
            self._keep(s)
            out.append(Scalar(key, m.tenant_id, value, self._tick(key, m.tenant_id)))
        return out

    def _learning(
        self, t: TenantAggregates, m: Metric, out: list[Scalar], handled: set[str]
    ) -> None:
        """Loss per version, eval success and return per version evaluated, rollouts."""
        f, tenant = m.fields, m.tenant_id
        version = number(f.get("version"))
        if (loss := number(f.get("loss"))) is not None:
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
        if (succ := number(f.get("eval_success"))) is not None:
            v = int(version) if version is not None else len(t.evals)
            ret = number(f.get("eval_return"))
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
        rs, rw = number(f.get("rollout_success")), number(f.get("mean_reward"))
        if rs is not None or rw is not None:
            n = len(t.rollouts)
            bv = number(f.get("behavior_version"))
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

    def _busy(self, t: TenantAggregates, m: Metric, out: list[Scalar], handled: set[str]) -> None:
        """A busy interval of a service, and the usage it adds to its tenants."""
        f = m.fields
        start, end = number(f.get("busy_start")), number(f.get("busy_end"))
        if start is not None and end is not None and end >= start:
            service = str(f.get("service") or "service")
            t.busy[service].append((start, end))
            self._keep(t.busy[service])
            n = len(t.busy[service]) - 1
            out.append(Scalar("busy_ms", service, (end - start) * 1e3, n))
            handled.update(("busy_start", "busy_end"))
            out.extend(self._usage_scalars({**f, "kind": m.kind}))

    def _security(
        self, t: TenantAggregates, m: Metric, out: list[Scalar], handled: set[str]
    ) -> None:
        """A refused attempt: an event stands for ``count`` of them (1 when absent)."""
        f = m.fields
        t.refusals.append({"at": m.at, **f})
        self._keep(t.refusals)
        count = number(f.get("count"))
        t.refused += max(1, int(count)) if count is not None else 1
        n = t.counts["security"]
        out.append(Scalar("refusals", m.tenant_id, float(t.refused), n - 1))
        handled.update(("count", "first_at", "revision"))

    def _usage_scalars(self, fields: dict[str, Any]) -> list[Scalar]:
        """The running usage totals of the tenants a busy interval touched."""
        before = {t: dict(v) for t, v in self.usage["tenants"].items()}
        usagestate.fold_metric(self.usage, fields)
        out = []
        for t, now in self.usage["tenants"].items():
            for k in ("train_s", "infer_s", "env_s", "infer_requests"):
                if k in now and now[k] != before.get(t, {}).get(k):
                    out.append(Scalar(f"usage {k}", t, float(now[k]), self._tick(f"usage {k}", t)))
        return out

    def timelines(self) -> dict[str, list[tuple[float, float]]]:
        """Busy intervals per service, every tenant merged: what
        ``plots.plot_utilization_timeline`` draws for one run."""
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

