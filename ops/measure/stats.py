"""Measurements that hold still on a noisy machine: interleaved arms, ratios with intervals.

Two arms of one comparison are measured in the same loop, alternating their
order each round (ABBA...), so a burst of load from elsewhere lands on both
alike; warm-up rounds are dropped. A ratio carries a 95% interval from a
bootstrap over rounds that resamples each round's pair together, and the
load average is recorded before and after.

See docs/ARCHITECTURE.md, "Measured".
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "Samples",
    "difference_ci",
    "interleaved",
    "interleaved_async",
    "load",
    "median_ci",
    "newcombe",
    "percentile",
    "ratio_ci",
    "round_order",
    "summarize",
    "wilson",
]

#: One arm's per-round wall times, in milliseconds.
Samples = list[float]


def load() -> dict[str, float]:
    """The machine's 1/5/15-minute load averages and its CPU count."""
    one, five, fifteen = os.getloadavg()
    return {
        "load1": round(one, 2),
        "load5": round(five, 2),
        "load15": round(fifteen, 2),
        "cpus": float(os.cpu_count() or 1),
    }


def percentile(
    xs: Sequence[float], q: float, *, scale: float = 1.0, digits: int | None = None
) -> float | None:
    """The ``q``-th percentile (0-100, linear between ranks, as ``numpy.percentile``)
    of ``xs`` times ``scale`` (1000: seconds to milliseconds), rounded to ``digits``;
    None when there is nothing to take it of (JSON null, not NaN). The benchmarks' one
    percentile."""
    if len(xs) == 0:
        return None
    v = float(np.percentile(np.asarray(xs, dtype=np.float64), q)) * scale
    return v if digits is None else round(v, digits)


def round_order(arms: Sequence[str], round_i: int) -> Sequence[str]:
    """The arms in round ``round_i``'s order (reversed every other round)."""
    return arms if round_i % 2 == 0 else tuple(reversed(arms))


def schedule(names: Sequence[str], *, repeats: int, warmup: int) -> Iterator[tuple[str, bool]]:
    """The interleaved runs' order: ``(arm, kept)``, every arm once per round, the order
    flipped each round (:func:`round_order`); the first ``warmup`` rounds not kept."""
    for r in range(warmup + repeats):
        for n in round_order(names, r):
            yield n, r >= warmup


def kept_samples(names: Sequence[str], runs: Iterable[tuple[str, float, bool]]) -> dict[str, Samples]:
    """Each arm's ms, from ``(arm, ms, kept)`` runs in order, the runs not kept dropped."""
    out: dict[str, Samples] = {n: [] for n in names}
    for n, ms, kept in runs:
        if kept:
            out[n].append(ms)
    return out


def interleaved(
    arms: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 1,
) -> dict[str, Samples]:
    """Run every arm once per round, order flipped each round; ms per call, warm-up dropped."""

    def ms(n: str) -> float:
        t0 = time.perf_counter()
        arms[n]()
        return (time.perf_counter() - t0) * 1e3

    names = tuple(arms)
    return kept_samples(names, ((n, ms(n), kept) for n, kept in
                                schedule(names, repeats=repeats, warmup=warmup)))


async def interleaved_async(
    arms: Mapping[str, Callable[[], Awaitable[Any]]],
    *,
    repeats: int,
    warmup: int = 1,
) -> dict[str, Samples]:
    """``interleaved`` for coroutines (an arm that awaits a reply, for instance)."""

    async def ms(n: str) -> float:
        t0 = time.perf_counter()
        await arms[n]()
        return (time.perf_counter() - t0) * 1e3

    names = tuple(arms)
    return kept_samples(names, [(n, await ms(n), kept) for n, kept in
                                schedule(names, repeats=repeats, warmup=warmup)])


def _boot_idx(n: int, n_boot: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def median_ci(xs: Sequence[float], *, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median and its bootstrap 95% interval."""
    a = np.asarray(xs, dtype=np.float64)
    if a.size == 0:
        return (float("nan"),) * 3
    meds = np.median(a[_boot_idx(a.size, n_boot, seed)], axis=1)
    return float(np.median(a)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def ratio_ci(
    num: Sequence[float], den: Sequence[float], *, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(ratio, low, high) of median(num) / median(den), rounds resampled as pairs."""
    a = np.asarray(num, dtype=np.float64)
    b = np.asarray(den, dtype=np.float64)
    if a.size != b.size:
        raise ValueError(f"paired samples differ in length: {a.size} vs {b.size}")
    if a.size == 0:
        return (float("nan"),) * 3
    idx = _boot_idx(a.size, n_boot, seed)
    boot = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    point = float(np.median(a) / np.median(b))
    return point, float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def difference_ci(
    a_ms: Sequence[float], b_ms: Sequence[float], *, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(median(a) - median(b), low, high), rounds resampled as pairs."""
    a = np.asarray(a_ms, dtype=np.float64)
    b = np.asarray(b_ms, dtype=np.float64)
    if a.size != b.size or a.size == 0:
        raise ValueError(f"need paired, non-empty samples: {a.size} vs {b.size}")
    idx = _boot_idx(a.size, n_boot, seed)
    boot = np.median(a[idx], axis=1) - np.median(b[idx], axis=1)
    point = float(np.median(a) - np.median(b))
    return point, float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def summarize(xs: Sequence[float]) -> dict[str, Any]:
    """p50 with its interval, p99, mean, n: one arm's figures for the JSON."""
    med, lo, hi = median_ci(xs)
    return {
        "p50_ms": round(med, 3),
        "p50_ci95": [round(lo, 3), round(hi, 3)],
        "p99_ms": round(float(np.percentile(xs, 99)), 3) if xs else float("nan"),
        "mean_ms": round(statistics.fmean(xs), 3) if xs else float("nan"),
        "n": len(xs),
    }


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% with z = 1.96)."""
    lo, hi = _wilson(successes, n, z)
    return (round(lo, 4), round(hi, 4))


def _wilson(successes: int, n: int, z: float) -> tuple[float, float]:
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def newcombe(k1: int, n1: int, k0: int, n0: int, z: float = 1.96) -> tuple[float, float, float]:
    """(p1 - p0, low, high): Newcombe's hybrid score interval (his method 10, from the
    two Wilson intervals) of a difference of two proportions, k1/n1 minus k0/n0
    (95% with z = 1.96). It treats the two samples as independent, which for the
    same seeds evaluated twice is conservative when their outcomes correlate."""
    if n1 <= 0 or n0 <= 0:
        raise ValueError(f"need episodes on both sides: n1={n1}, n0={n0}")
    p1, p0 = k1 / n1, k0 / n0
    l1, u1 = _wilson(k1, n1, z)
    l0, u0 = _wilson(k0, n0, z)
    d = p1 - p0
    lo = d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2)
    return (round(d, 4), round(max(-1.0, lo), 4), round(min(1.0, hi), 4))
