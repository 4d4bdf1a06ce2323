"""``joynexus bench families``: a resident base family's shared forward, grouped vs serial.

For T tenants of B rows each (8x1 and 8x4 by default), ONE forward of the base over every
row (``grouped``: for π0.5 the per-layer prefix cache every tenant's expert reads) against
one forward per tenant (``serial``), as interleaved arms (order flipped each round, warm-up
dropped); the speedup is serial / grouped with its paired bootstrap 95% interval. Also the
resident base's RSS after its build and the machine's load. Random weights built from the
family's config (nothing downloaded); real sizes are slow on a CPU: measure what fits.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

from joynexus.ops.measure.stats import interleaved, load, median_ci, ratio_ci

__all__ = ["bench_families"]


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) / 1024
    return float("nan")


def bench_families(family: str = "pi05", size: str = "tiny", tenants: int = 8, rows: tuple[int, ...] = (1, 4),
                   repeats: int = 10) -> dict[str, Any]:
    import torch

    from joynexus.agents.models.families import build_base
    from joynexus.agents.models.features import FeatureSchema, canonicalize_request, concat_batches
    from joynexus.agents.models.grouped import for_base
    from joynexus.agents.models.heads.base import HeadConfig, build_head

    before = _rss_mb()
    t0 = time.perf_counter()
    base = build_base(family, size)
    build_s = time.perf_counter() - t0
    side = int(getattr(base.config, "image_size", 56))
    model = base.config.base_model
    head = build_head("flow_matching", HeadConfig(base.feature_dim, 8))  # prompt state from its normaliser
    out: dict[str, Any] = {
        "family": family, "size": size, "base_model": model, "params": base.num_params(),
        "build_s": round(build_s, 2), "base_rss_mb": round(_rss_mb() - before, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "threads": torch.get_num_threads(), "grid": {},
    }
    g = torch.Generator().manual_seed(0)
    for b in rows:
        schema = FeatureSchema(("front",), (side, side), 8, 7, 8, base_model=model)
        batches = [
            for_base(base, canonicalize_request(
                schema, {"front": torch.randint(0, 256, (b, 3, side, side), generator=g, dtype=torch.uint8)},
                f"push the cube {i}", torch.randn(b, 8, generator=g)), head)
            for i in range(tenants)
        ]
        shared = concat_batches(batches)

        def grouped(shared: Any = shared) -> Any:
            return base.encode_tokens(shared)

        def serial(batches: list[Any] = batches) -> Any:
            return [base.encode_tokens(x) for x in batches]

        with torch.inference_mode():
            s = interleaved({"grouped": grouped, "serial": serial}, repeats=repeats, warmup=1)
        ratio, lo, hi = ratio_ci(s["serial"], s["grouped"])
        out["grid"][f"{tenants}x{b}"] = {
            "grouped_ms": round(median_ci(s["grouped"])[0], 2), "serial_ms": round(median_ci(s["serial"])[0], 2),
            "speedup": round(ratio, 2), "speedup_ci95": [round(lo, 2), round(hi, 2)], "rounds": len(s["grouped"]),
        }
    out["load"] = load()
    return out
