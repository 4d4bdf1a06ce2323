"""Health records: one agent's beat, a health manager's decision, and the
manager's view that ``joynexus status`` reads.

Structs only, in the bottom layer: the agents write them
(``joynexus.agents.health``, which re-exports them), and whatever decodes them
(``ops/bench/faults.py``, the tests) needs only this module. Where they live (KV
``<NS>_HEALTH``: ``hb.<role>.<instance>``, ``mgr.<instance>``; ``health`` metric
events) is in docs/ARCHITECTURE.md ("Health: heartbeats and in-place restarts").
"""

from __future__ import annotations

from typing import Literal

import msgspec

Action = Literal[
    "started", "restart", "global_restart", "give_up", "suspect", "lost", "recovered", "stopped"
]


class Heartbeat(msgspec.Struct, kw_only=True):
    """One beat of one agent process (value of ``hb.<role>.<instance>``)."""

    role: str
    instance: str
    pid: int
    host: str
    started_at: float
    at: float
    beats: int
    interval_s: float
    state: Literal["running", "stopped", "crashed"] = "running"
    errors: int = 0
    last_error: str = ""
    #: How long the agent's event loop has not run (0: responsive).
    loop_lag_s: float = 0.0
    #: The process's resident memory at this beat (MiB; 0: unknown).
    rss_mb: float = 0.0
    #: Seconds from the process's start to its role serving (None: not yet ready).
    ready_s: float | None = None
    #: Where the role serves clients outside NATS (the policy gateway's ws:// URL).
    address: str = ""


class HealthDecision(msgspec.Struct, kw_only=True):
    """What the health manager decided, and why (published as a ``health`` metric)."""

    action: Action
    role: str = ""
    instance: str = ""
    reason: str = ""
    at: float = 0.0
    by: str = ""
    pid: int | None = None
    exit_code: int | None = None
    #: Seconds from the last sign of life to the decision (missing beats).
    detect_s: float | None = None
    restarts_in_window: int = 0


class SlotState(msgspec.Struct, kw_only=True):
    role: str
    instance: str
    state: Literal["starting", "running", "restarting", "failed", "stopped", "watched"]
    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    last_reason: str = ""
    beat_age_s: float | None = None
    beats: int = 0
    errors: int = 0
    last_error: str = ""
    #: What the slot runs for, when its supervisor says (an environment worker: its workload).
    detail: str = ""


class SupervisorState(msgspec.Struct, kw_only=True):
    """Value of ``mgr.<instance>``: what ``joynexus status`` shows."""

    instance: str
    mode: Literal["supervise", "watch"]
    host: str
    pid: int
    at: float
    connected: bool
    global_restarts: int
    slots: list[SlotState]
    decisions: list[HealthDecision]
