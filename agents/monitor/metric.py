"""A metric message decoded: ``decode_metric`` and the numbers in it (pure, no I/O).

Agents publish metrics fire-and-forget (``broker/metrics.py``), so anything
may arrive: a message that is not a JSON object is refused here, kind and
tenant fall back to the subject's tokens, and only finite numbers count as
measurements. See docs/ARCHITECTURE.md, "Traces and monitoring".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import orjson

from joynexus.schemas.errors import InvalidMessage

#: The tenant of deployment-wide metrics (queue depths, failed logins).
GLOBAL_TENANT = "_"

#: Fields that identify a metric rather than measure something.
_ID_FIELDS = frozenset(
    {"kind", "tenant_id", "at", "version", "behavior_version", "job_id", "seq", "subject", "source"}
)



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


def number(v: Any) -> float | None:
    """``v`` as a finite float; None for anything else (bools included)."""
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
                n = number(v2)
                if n is not None:
                    out[f"{k}.{k2}"] = n
        else:
            n = number(v)
            if n is not None:
                out[k] = n
    return out
