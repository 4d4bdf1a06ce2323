"""What one tenant may take from a shared deployment: its quota and priority class.

An operator sets them (``joynexus tenant add/set acme --quota key=value``) in
the tenant's identity record, so one write changes its credentials and bounds
together. A tenant never sets its own priority (its class's replaces the
spec's), and every number it asks for is checked against its quota at the
door. The defaults are sized for a shared deployment of this size (2 cores,
one trainer): generous for one honest tenant, too small for one tenant to
fill what the others need; without authorization every tenant gets them.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

from typing import Any

import msgspec

from joynexus.schemas.base import Wire
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.jobs import MAX_WEIGHT

#: Operator-assigned priority classes -> the scheduler's priority (higher first).
PRIORITY_CLASSES: dict[str, int] = {"batch": 0, "standard": 10, "premium": 20}

MiB = 1024 * 1024


class Quota(Wire, kw_only=True, omit_defaults=True):
    """Bounds on one tenant (each field: the most it may hold or ask for at once)."""

    #: Operator-assigned: the scheduler priority of all the tenant's workloads.
    priority_class: str = "standard"
    #: Operator-assigned: the weight of the tenant's share of the trainer among
    #: tenants of its priority (2: twice a weight-1 tenant's; 1..MAX_WEIGHT).
    share_weight: int = 1
    #: Workloads in state ``active`` (all task types), and records kept in all.
    max_active_workloads: int = 6
    max_workloads: int = 64
    #: Jobs in flight per workload (scheduling.max_in_flight) and rollouts at once.
    max_in_flight: int = 16
    max_active_rollouts: int = 4
    #: Bytes of the tenant's rows in the Training Queue at once (all its partitions).
    tq_bytes: int = 256 * MiB
    #: Bytes a second into the Training Queue (put_data waits past it; a burst of one
    #: second's bytes goes at once). 0 turns the pacing off.
    tq_bytes_per_s: int = 16 * MiB
    #: Tenant-opened jobs (open_job) not yet closed.
    max_open_jobs: int = 16
    #: Evaluation: episodes of one evaluation, evaluations running at once.
    max_eval_episodes: int = 500
    max_concurrent_evals: int = 2
    #: Evaluation videos: episodes saved per evaluation, frames per video, pixels a side.
    max_eval_videos: int = 4
    max_video_frames: int = 200
    max_video_size: int = 128
    #: Action module size: the chunk length bounds a head's parameters (and the
    #: engine memory a resident version takes).
    max_action_horizon: int = 64
    #: Work per job: envs x horizon (RL) or batch size (SFT).
    max_rollout_steps: int = 4096
    max_batch_size: int = 512
    #: Inference Queue: rows and instruction bytes in one request.
    max_infer_rows: int = 64
    max_instruction_bytes: int = 1024
    #: Requests of this tenant being served at once by one control plane / engine;
    #: past it the request is refused with ``rate_limited`` (retry later).
    max_requests_in_flight: int = 32
    #: Of those, how many do their work at once on a control plane (the rest wait
    #: their turn, in order): the tenant's share of the control plane's time.
    max_requests_working: int = 2
    #: Messages to the control plane per second (counted at its door, answered or
    #: not): past it the tenant is paused, its user taken off the server for
    #: ``penalty_s`` seconds (doubling while it goes on, up to 16x), so the server,
    #: not the control plane's one connection, drops the flood (the penalty box,
    #: ops/runtime/penaltybox.py). 0 turns it off.
    max_requests_per_s: int = 5000
    penalty_s: int = 15
    #: Connections to the server at once (all the tenant's clients together): past
    #: it the newest are closed (ops/runtime/conncap.py).
    max_connections: int = 32
    #: The directory under which this tenant's SFT datasets must live
    #: (empty: ``<datasets root>/<tenant>``, the service's default).
    dataset_root: str = ""

    def __post_init__(self) -> None:
        if self.priority_class not in PRIORITY_CLASSES:
            raise InvalidSpec(
                f"priority_class {self.priority_class!r} is not one of {sorted(PRIORITY_CLASSES)}"
            )
        if not 1 <= self.share_weight <= MAX_WEIGHT:
            raise InvalidSpec(f"share_weight must be in 1..{MAX_WEIGHT}, got {self.share_weight}")
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 1 << 40:
                raise InvalidSpec(f"quota {name} must be an integer in 0..2^40, got {v!r}")

    @property
    def priority(self) -> int:
        return PRIORITY_CLASSES[self.priority_class]


_INT_FIELDS = tuple(
    f for f, t in zip(Quota.__struct_fields__, msgspec.structs.fields(Quota), strict=True)
    if t.type is int
)

DEFAULT_QUOTA = Quota()


def parse_quota_args(items: list[str], base: Quota | None = None) -> Quota:
    """``["tq_bytes=1000000", "priority_class=premium"]`` -> a Quota (for the CLI)."""
    values: dict[str, Any] = msgspec.structs.asdict(base or DEFAULT_QUOTA)
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in values:
            raise InvalidSpec(
                f"--quota {item!r}: use KEY=VALUE with KEY one of {sorted(values)}"
            )
        if key in ("priority_class", "dataset_root"):
            values[key] = raw
        else:
            try:
                values[key] = int(raw.replace("_", ""))
            except ValueError as e:
                raise InvalidSpec(f"--quota {item!r}: {key} takes an integer") from e
    return Quota(**values)
