"""Reading an offline ClearML session back: the scalars a monitor run reported.

Not part of the agent: the tests check what the sink reported with it, and an
operator can look at a run recorded without a server before (or instead of)
``clearml.Task.import_offline_session``. It lives beside the sink, in
``agents/`` rather than ``ops/``, so ``joynexus.agents.monitor`` re-exports it.
See docs/ARCHITECTURE.md, "Traces and monitoring".
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any


def read_offline_scalars(session: Path) -> list[dict[str, Any]]:
    """The scalars of an offline ClearML session (its folder or its zip)."""
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
