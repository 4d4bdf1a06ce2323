"""Benchmark: shared-forward speedup of grouped vs serial execution.

For each T x B (T tenants, B samples each): serial = T backbone forwards of
B rows, grouped = one forward of T*B rows, each plus T head decodes. Inputs
are prepared beforehand in both (as the engine does on arrival; reported
apart as ``prepare_ms_per_request``). Torch threads = 2; the arms alternate
in one loop (``ops.measure.stats``) and each speedup is a ratio of medians with
a paired bootstrap 95% interval (``group_speedup_ci95``). ``measure_rss``
gives the process RSS with the base plus 1 vs 8 tenant modules.

    .venv/bin/python -m joynexus.ops.mainjob.group [--quick]

See docs/ARCHITECTURE.md, "The Inference Queue" (the grid's figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from joynexus.ops.measure import stats

__all__ = ["bench_group", "main", "measure_rss"]

INSTRUCTIONS = ("pick up the red cube", "open the drawer", "push the block left", "stack the cups")


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def bench_group(
    tenants: Sequence[int] = (2, 4, 6, 8),
    batches: Sequence[int] = (1, 2, 4, 8),
    size: str = "bench",
    repeats: int = 15,
    quick: bool = False,
    threads: int = 2,
    rss: bool = True,
) -> dict[str, Any]:
    """Grouped vs serial timings over the T x B grid; keys are ``"TxB"``."""
    from joynexus.agents.models.backbone import Backbone
    from joynexus.agents.models.backbone_config import BackboneConfig
    from joynexus.agents.models.features import FeatureSchema, canonicalize_request, split_rows
    if quick:
        tenants, batches, repeats = (2, 8), (1, 4), 9
    torch.set_num_threads(threads)
    bb = Backbone.build(BackboneConfig(size=size, threads=threads))  # type: ignore[arg-type]
    schema = FeatureSchema(("front", "wrist"), (56, 56), 8, 7, 8, base_model=bb.config.base_model)
    t_max = max(tenants)
    rss_info, mods = measure_rss(bb, max(t_max, 8))
    g = torch.Generator().manual_seed(0)
    prepared: dict[tuple[int, int], Any] = {}
    states: dict[tuple[int, int], torch.Tensor] = {}
    prep_ts = []
    for b in batches:
        for i in range(t_max):
            fb = canonicalize_request(
                schema,
                {s: torch.randint(0, 256, (b, 3, 56, 56), dtype=torch.uint8, generator=g) for s in schema.camera_slots},
                [INSTRUCTIONS[(i + j) % len(INSTRUCTIONS)] for j in range(b)],
                torch.randn(b, 8, generator=g),
            )
            t0 = time.perf_counter()
            prepared[(i, b)] = bb.prepare(fb)
            prep_ts.append(time.perf_counter() - t0)
            states[(i, b)] = fb.state_B_S

    def serial(t: int, b: int) -> None:
        for i in range(t):
            mods[i].act(bb.forward(prepared[(i, b)]), states[(i, b)])

    def grouped(t: int, b: int) -> None:
        inp = bb.concat_inputs([prepared[(i, b)] for i in range(t)])
        feats = bb.forward(inp)
        slices = [slice(i * b, (i + 1) * b) for i in range(t)]
        for i, f in enumerate(split_rows(feats, slices)):
            mods[i].act(f, states[(i, b)])

    b4 = prepared[(0, 4)] if 4 in batches else bb.prepare(
        canonicalize_request(schema, {s: torch.zeros(4, 3, 56, 56, dtype=torch.uint8) for s in schema.camera_slots},
                             INSTRUCTIONS[0], torch.zeros(4, 8)))
    bb.forward(b4)
    batch4_ms = _median_ms(lambda: bb.forward(b4), max(repeats, 5))

    serial_ms: dict[str, float] = {}
    grouped_ms: dict[str, float] = {}
    speedup: dict[str, float] = {}
    speedup_ci: dict[str, list[float]] = {}
    load_before = stats.load()
    with torch.inference_mode():
        for t in tenants:
            for b in batches:
                # Serial and grouped alternate in one loop (ABBA), the first round
                # (which also fills the position cache for this length) thrown away.
                ts = stats.interleaved(
                    {"serial": partial(serial, t, b), "grouped": partial(grouped, t, b)},
                    repeats=repeats,
                    warmup=1,
                )
                key = f"{t}x{b}"
                ratio, lo, hi = stats.ratio_ci(ts["serial"], ts["grouped"])
                serial_ms[key] = round(statistics.median(ts["serial"]), 2)
                grouped_ms[key] = round(statistics.median(ts["grouped"]), 2)
                speedup[key] = round(ratio, 2)
                speedup_ci[key] = [round(lo, 2), round(hi, 2)]

    head_params = {m.head_type: m.num_params() for m in mods[:2]}
    out: dict[str, Any] = {
        "group_speedup": speedup,
        "group_speedup_ci95": speedup_ci,
        "serial_ms": serial_ms,
        "grouped_ms": grouped_ms,
        "backbone": {
            "size": size,
            "params": bb.num_params(),
            "hidden": bb.hidden_size,
            "layers": bb.num_layers,
            "vision_params": sum(p.numel() for p in bb.model.visual.parameters()),
            "tokens_per_sample": int(prepared[(0, batches[0])].input_ids_B_L.shape[1]),
            "batch4_forward_ms": round(batch4_ms, 2),
        },
        "head_params": head_params,
        "prepare_ms_per_request": round(statistics.median(prep_ts) * 1e3, 2),
        "threads": threads,
        "repeats": repeats,
        "load": {"before": load_before, "after": stats.load()},
    }
    if rss:
        out["rss"] = rss_info
    return out


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def measure_rss(backbone: Any, n: int = 8) -> tuple[dict[str, float], list[Any]]:
    """Process RSS (MB) with the base model held once, then 1 and ``n`` tenant modules.

    Each module gets one AdamW step so its optimizer moments exist. Call it
    right after building the backbone, before other allocations, for a clean
    reading. Returns the figures and the modules (reuse them).
    """
    from joynexus.agents.models.heads.base import HeadConfig
    from joynexus.agents.models.heads.tenant import TenantModule

    base = _rss_mb()
    mods: list[Any] = []
    at: dict[int, float] = {}
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        m = TenantModule(f"t{i}", ("oft_mlp", "flow_matching")[i % 2], HeadConfig(backbone.feature_dim, 8, seed=i))
        m.train_step(torch.randn(4, backbone.feature_dim, generator=g), torch.randn(4, 8, generator=g),
                     torch.randn(4, 8, 7, generator=g))
        mods.append(m)
        at[i + 1] = _rss_mb()
    weights_mb = sum(p.numel() * p.element_size() for p in backbone.model.parameters()) / 2**20
    return {
        "backbone_only_mb": round(base, 1),
        "with_1_tenant_mb": round(at[1], 1),
        f"with_{n}_tenants_mb": round(at[n], 1),
        "per_extra_tenant_mb": round((at[n] - at[1]) / max(n - 1, 1), 3),
        "backbone_weights_mb": round(weights_mb, 1),
        "head_state_mb_each": round(
            sum(p.numel() * p.element_size() * 3 for p in mods[-1].head.parameters()) / 2**20, 3
        ),  # weights + two AdamW moments
    }, mods


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 and 8 tenants x batch 1 and 4, 9 rounds")
    ap.add_argument("--size", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds per cell")
    ap.add_argument("--no-rss", action="store_true")
    a = ap.parse_args(argv)
    print(json.dumps(bench_group(size=a.size, repeats=a.repeats, quick=a.quick, rss=not a.no_rss), indent=2))


if __name__ == "__main__":
    main()
