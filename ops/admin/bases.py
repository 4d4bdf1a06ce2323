"""The deployment's resident base as ``joynexus status`` shows it (``base.family``,
``base.params``), read from what its inference engines announce in their service metadata."""

from __future__ import annotations

from typing import Any

__all__ = ["base_line", "base_of"]


def base_of(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """The deployment's resident base as its inference engines announce it (family, params,
    base model); several bases (a mixed deployment) are listed by base model."""
    bases: dict[str, dict[str, Any]] = {}
    for r in replies:
        meta = r.get("metadata") or {}
        if not isinstance(meta, dict) or "base_model" not in meta:
            continue
        params = meta.get("base_params", "")
        bases[str(meta["base_model"])] = {
            "family": str(meta.get("base_family") or "qwen2_5_vl"),
            "params": int(params) if str(params).isdigit() else None,
            "base_model": str(meta["base_model"]),
        }
    if not bases:
        return {"error": "no inference engine answering"}
    if len(bases) == 1:
        return next(iter(bases.values()))
    return {"bases": sorted(bases.values(), key=lambda d: d["base_model"])}


def base_line(base: dict[str, Any]) -> str:
    """One line for the text status: each base model, its family and parameters."""
    named = base.get("bases") or ([base] if "family" in base else [])
    said = ", ".join(f"{d['base_model']} ({d['family']}, {d['params'] or '?'} params)" for d in named)
    return said or "unknown"
