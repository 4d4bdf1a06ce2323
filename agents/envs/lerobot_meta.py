"""What a LeRobot dataset's ``meta/`` files say, read without LeRobot or torch: the
observation choice a dataset was generated with and its normalisation statistics.

``lerobot_data`` (which imports torch and lerobot) writes these files and
re-exports the readers; the control plane and the producers' supervisors, light
roles, read them from here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from joynexus.schemas.samples import ACTION, OBS_STATE

#: The observation choice a dataset was generated with (ours, beside LeRobot's files).
OBSERVATION_FILE = "joynexus_observation.json"


def read_observation_meta(root: Path) -> dict[str, Any] | None:
    """The observation choice a dataset was generated with, or None (a dataset made elsewhere)."""
    p = Path(root) / "meta" / OBSERVATION_FILE
    try:
        if not p.is_file() or p.stat().st_size > 1 << 16:
            return None
        meta = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def dataset_stats(
    root: Path, keys: Sequence[str] = (OBS_STATE, ACTION)
) -> dict[str, dict[str, list[float]]]:
    """LeRobot's normalisation statistics (meta/stats.json: mean, std, min, max per
    dimension) of ``keys``; an empty dict for a key the file lacks."""
    p = Path(root) / "meta" / "stats.json"
    out: dict[str, dict[str, list[float]]] = {}
    try:
        raw = json.loads(p.read_text()) if p.is_file() and p.stat().st_size < 64 << 20 else {}
    except (OSError, ValueError):
        raw = {}
    for k in keys:
        entry = raw.get(k) if isinstance(raw, dict) else None
        if isinstance(entry, dict):
            out[k] = {
                s: [float(x) for x in np.asarray(entry[s], dtype=np.float64).reshape(-1)]
                for s in ("mean", "std", "min", "max")
                if s in entry
            }
    return out
