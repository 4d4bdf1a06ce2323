"""The benchmarks' statistics: interleaving order, warm-up dropped, intervals that cover."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from joynexus.ops.measure import stats


def test_interleaved_flips_the_order_each_round_and_drops_the_warmup() -> None:
    calls: list[str] = []
    out = stats.interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1
    )
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3}


def test_interleaved_async_times_each_arm() -> None:
    async def slow() -> None:
        await asyncio.sleep(0.02)

    async def fast() -> None:
        await asyncio.sleep(0)

    out = asyncio.run(stats.interleaved_async({"slow": slow, "fast": fast}, repeats=4))
    assert min(out["slow"]) >= 19.0 and max(out["fast"]) < min(out["slow"])


def test_ratio_interval_covers_the_true_ratio_and_excludes_a_wrong_one() -> None:
    g = np.random.default_rng(0)
    den = g.lognormal(np.log(10.0), 0.2, 60)
    num = den * 2.0 * g.lognormal(0.0, 0.05, 60)  # paired: the same noise hits both
    ratio, lo, hi = stats.ratio_ci(num.tolist(), den.tolist())
    assert lo <= 2.0 <= hi and lo <= ratio <= hi
    assert not lo <= 1.3 <= hi
    assert hi - lo < 0.3


def test_difference_and_median_intervals() -> None:
    g = np.random.default_rng(1)
    a = (10.0 + g.normal(0, 0.5, 80)).tolist()
    b = (9.0 + g.normal(0, 0.5, 80)).tolist()
    d, lo, hi = stats.difference_ci(a, b)
    assert lo < 1.0 < hi and lo < d < hi
    m, mlo, mhi = stats.median_ci(a)
    assert mlo <= m <= mhi and mlo < 10.0 < mhi
    s = stats.summarize(a)
    assert s["n"] == 80 and s["p50_ci95"][0] <= s["p50_ms"] <= s["p50_ci95"][1]


def test_unpaired_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="paired"):
        stats.ratio_ci([1.0, 2.0], [1.0])


def test_load_records_the_machine() -> None:
    got = stats.load()
    assert set(got) == {"load1", "load5", "load15", "cpus"} and got["cpus"] >= 1


def test_newcombe_matches_the_published_example_and_mirrors() -> None:
    # Newcombe (1998), Statistics in Medicine 17:873, example (a): 56/70 vs 48/80,
    # method 10 (hybrid score): 0.0524 to 0.3339.
    d, lo, hi = stats.newcombe(56, 70, 48, 80)
    assert d == 0.2 and (lo, hi) == pytest.approx((0.0524, 0.3339), abs=1e-4)
    # swapping the arms negates the difference and mirrors the interval
    assert stats.newcombe(48, 80, 56, 70) == (-0.2, -hi, -lo)
    # both from the two Wilson intervals: the interval holds the point, within [-1, 1]
    for k1, k0 in ((0, 0), (100, 0), (49, 30), (100, 100)):
        d, lo, hi = stats.newcombe(k1, 100, k0, 100)
        assert -1.0 <= lo <= d <= hi <= 1.0
    with pytest.raises(ValueError):
        stats.newcombe(1, 0, 1, 10)
