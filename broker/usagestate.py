"""The usage meter's state, pure: per tenant and hour, the figures folded from busy
intervals (split by rows), Training Queue index records and terminal job events;
the checkpoint's encoding, and the reports read from it.

broker/usage.py runs it (the :class:`joynexus.broker.usage.Meter` reads the
streams in sequence order and checkpoints this state with compare-and-set). See
docs/ARCHITECTURE.md, "Usage metering" (what is split how, what is lost).
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from datetime import UTC, datetime
from typing import Any

import orjson

from joynexus.schemas.errors import InvalidSpec

STATE_VERSION = 1
#: Hourly buckets kept for ``since`` queries (the metrics stream keeps a day).
KEEP_HOURS = 48
#: Terminal jobs remembered (their time) for index records folded after them.
KEEP_CLOSED = 50_000
#: The figures per tenant.
FIELDS = ("train_s", "infer_s", "env_s", "tq_byte_s", "rows_trained", "rows_inferred",
          "infer_requests", "env_steps", "train_steps", "infer_batches", "rollouts",
          "jobs_completed", "jobs_dropped", "jobs_failed")
_TERMINAL = {"completed": "jobs_completed", "dropped": "jobs_dropped", "failed": "jobs_failed"}
SOURCES = ("metrics", "tq", "jobs")


def empty_state() -> dict[str, Any]:
    return {
        "v": STATE_VERSION,
        "seq": dict.fromkeys(SOURCES, 0),
        "tenants": {},
        "hours": {},
        "services": {"train": 0.0, "infer": 0.0, "env": 0.0},
        "unattributed": {"train": 0.0, "infer": 0.0, "env": 0.0},
        "open_tq": {},
        "closed": {},
        "events": 0,
        "events_missed": 0,
        "first_at": None,
        "last_at": None,
    }


def _add(state: dict[str, Any], tenant: str, at: float, field: str, value: float) -> None:
    t = state["tenants"].setdefault(tenant, {})
    t[field] = t.get(field, 0) + value
    hour = str(int(at // 3600 * 3600))
    h = state["hours"].setdefault(hour, {}).setdefault(tenant, {})
    h[field] = h.get(field, 0) + value


def split(total: float, weights: dict[str, float]) -> dict[str, float]:
    """``total`` split in proportion to ``weights`` (tenant -> rows), in sorted
    tenant order, the last part the remainder: the parts add up to ``total``."""
    items = sorted((t, float(w)) for t, w in weights.items() if w > 0)
    if not items:
        return {}
    w_sum = sum(w for _, w in items)
    out: dict[str, float] = {}
    left = total
    for i, (t, w) in enumerate(items):
        part = left if i == len(items) - 1 else total * w / w_sum
        out[t] = part
        left -= part
    return out


def _weights(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    out: dict[str, float] = {}
    for k, v in value.items():
        if isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
            out[k] = float(v)
    return out


def _stamp(state: dict[str, Any], at: float) -> None:
    if state["first_at"] is None or at < state["first_at"]:
        state["first_at"] = at
    if state["last_at"] is None or at > state["last_at"]:
        state["last_at"] = at


def fold_metric(state: dict[str, Any], m: dict[str, Any]) -> None:
    """Fold one metric event (only busy intervals count)."""
    service = m.get("service")
    if m.get("kind") != "system" or service not in ("train", "infer", "env"):
        return
    try:
        start, end = float(m["busy_start"]), float(m["busy_end"])
    except (KeyError, TypeError, ValueError):
        return
    if not (math.isfinite(start) and math.isfinite(end)) or end < start:
        return
    d = end - start
    state["services"][service] += d
    _stamp(state, start)
    if service == "env":
        tenant = m.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            state["unattributed"]["env"] += d
            return
        _add(state, tenant, start, "env_s", d)
        _add(state, tenant, start, "rollouts", 1)
        steps = m.get("steps")
        if isinstance(steps, int) and steps > 0:
            _add(state, tenant, start, "env_steps", steps)
        return
    rows = _weights(m.get("tenant_rows"))
    if not rows and isinstance(m.get("tenants"), list):  # older events: equal split
        rows = {t: 1.0 for t in m["tenants"] if isinstance(t, str)}
    parts = split(d, rows)
    if not parts:
        state["unattributed"][service] += d
        return
    key, rows_key, count_key = (
        ("train_s", "rows_trained", "train_steps") if service == "train"
        else ("infer_s", "rows_inferred", "infer_batches")
    )
    for t, part in parts.items():
        _add(state, t, start, key, part)
        _add(state, t, start, count_key, 1)
        if isinstance(m.get("tenant_rows"), dict):
            _add(state, t, start, rows_key, rows[t])
    if service == "infer":
        for t, n in _weights(m.get("tenant_requests")).items():
            _add(state, t, start, "infer_requests", n)


def fold_tq_index(state: dict[str, Any], subject: str, data: bytes, at: float) -> None:
    """Fold one Training Queue index record (``<ns>.tq.<tenant>.<partition>.idx``)."""
    tokens = subject.split(".")
    if len(tokens) != 5 or tokens[4] != "idx":
        return
    tenant, partition = tokens[2], tokens[3]
    try:
        rec = orjson.loads(data)
        nbytes = sum(int(f.get("nbytes", 0)) for f in rec.get("fields", {}).values())
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return
    if nbytes <= 0:
        return
    key = f"{tenant}/{partition}"
    closed_at = state["closed"].get(key)
    if closed_at is not None:  # its job ended before this record was folded
        _add(state, tenant, at, "tq_byte_s", nbytes * max(0.0, closed_at - at))
        return
    state["open_tq"].setdefault(key, []).append([at, nbytes])


def fold_job(state: dict[str, Any], subject: str, data: bytes) -> None:
    """Fold one job event: a terminal one ends its partition's stay in the queue."""
    tokens = subject.split(".")
    if len(tokens) != 5 or tokens[4] not in _TERMINAL:
        return
    tenant, job_id = tokens[2], tokens[3]
    try:
        at = float(orjson.loads(data).get("at", 0.0))
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        at = 0.0
    _add(state, tenant, at, _TERMINAL[tokens[4]], 1)
    key = f"{tenant}/{job_id}"
    for put_at, nbytes in state["open_tq"].pop(key, []):
        _add(state, tenant, put_at, "tq_byte_s", nbytes * max(0.0, at - put_at))
    state["closed"][key] = at
    if len(state["closed"]) > KEEP_CLOSED:
        for k in list(state["closed"])[: len(state["closed"]) - KEEP_CLOSED]:
            del state["closed"][k]


def prune(state: dict[str, Any]) -> None:
    hours = sorted(state["hours"], key=int)
    for h in hours[:-KEEP_HOURS]:
        del state["hours"][h]


def encode_state(state: dict[str, Any]) -> bytes:
    return zlib.compress(orjson.dumps(state), 6)


def decode_state(data: bytes) -> dict[str, Any]:
    state = orjson.loads(zlib.decompress(data))
    if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
        raise InvalidSpec("the usage checkpoint has an unknown format")
    return state


# ---------------------------------------------------------------- reports


def report(state: dict[str, Any], *, tenant: str | None = None, since: float = 0.0,
           now: float | None = None) -> dict[str, Any]:
    """Figures per tenant (only ``tenant``'s when given). With ``since``: the sum
    of the hourly buckets from the hour holding ``since`` on (``since_effective``
    says where that starts; buckets older than :data:`KEEP_HOURS` are gone, so
    figures older than that are totals since metering began)."""
    now = time.time() if now is None else now
    if since > 0:
        start = int(since // 3600 * 3600)
        kept = [int(h) for h in state["hours"]]
        if kept and start < min(kept) and state["first_at"] is not None and \
                state["first_at"] < min(kept):
            start = min(kept)
        rows: dict[str, dict[str, float]] = {}
        for h, per in state["hours"].items():
            if int(h) >= start:
                for t, f in per.items():
                    acc = rows.setdefault(t, {})
                    for k, v in f.items():
                        acc[k] = acc.get(k, 0) + v
        since_effective: float | None = float(start)
    else:
        rows = {t: dict(f) for t, f in state["tenants"].items()}
        since_effective = None
    held: dict[str, int] = {}
    for key, puts in state["open_tq"].items():
        t = key.split("/", 1)[0]
        acc = rows.setdefault(t, {})
        for put_at, nbytes in puts:
            lo = max(put_at, since_effective or 0.0)
            acc["tq_byte_s"] = acc.get("tq_byte_s", 0) + nbytes * max(0.0, now - lo)
            held[t] = held.get(t, 0) + nbytes
    tenants = {
        t: {**{k: round(float(f.get(k, 0)), 6) for k in FIELDS}, "tq_bytes_held": held.get(t, 0)}
        for t, f in sorted(rows.items())
        if tenant is None or t == tenant
    }
    out: dict[str, Any] = {
        "as_of": now,
        "since": since or None,
        "since_effective": since_effective,
        "tenants": tenants,
    }
    if tenant is None:
        out.update(
            services={k: round(v, 6) for k, v in state["services"].items()},
            unattributed={k: round(v, 6) for k, v in state["unattributed"].items()},
            events=state["events"],
            events_missed=state["events_missed"],
            seq=state["seq"],
            first_at=state["first_at"],
            last_at=state["last_at"],
        )
    return out


def fold_message(state: dict[str, Any], source: str, subject: str, data: bytes,
                 seq: int, at: float) -> None:
    """Fold one stream message of ``source`` (its sequence must be past the state's)."""
    last = state["seq"][source]
    if seq <= last:
        return  # already counted (a redelivery after a reconnect)
    state["seq"][source] = seq
    state["events"] += 1
    if source == "metrics":
        with contextlib.suppress(orjson.JSONDecodeError):
            m = orjson.loads(data)
            if isinstance(m, dict):
                fold_metric(state, m)
    elif source == "tq":
        fold_tq_index(state, subject, data, at)
    else:
        fold_job(state, subject, data)


def parse_since(value: str | None) -> float:
    """An ISO 8601 time (``2026-12-01T13:00:00Z``; no zone: UTC) as epoch seconds."""
    if not value:
        return 0.0
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise InvalidSpec(f"--since {value!r} is not an ISO 8601 time: {e}") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()
