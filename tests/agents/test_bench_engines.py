"""`joynexus bench engines`: two engine builds served at once, clients alternating.
The pure checks, and one short real run with this checkout on both sides (two
engine processes, the real server): every figure is there and the ratio's
interval holds its point."""

from __future__ import annotations

from pathlib import Path

import pytest

from joynexus.ops.bench.engines import HERE, bench_engines, check_build, parse_levels
from joynexus.ops.runtime.natsserver import EmbeddedNats


def test_levels_and_builds_are_checked(tmp_path: Path) -> None:
    assert parse_levels("32,1") == (32, 1)
    for bad in ("", "0", "a,b", "-3"):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_levels(bad)
    with pytest.raises(ValueError, match="holds no build"):
        check_build(str(tmp_path))
    assert check_build(HERE) == str(Path(HERE).resolve())


@pytest.mark.slow  # ~15 s: two builds of the engine, measured (a benchmark smoke run)
async def test_a_short_run_reports_both_builds_and_their_ratio(nats_server: EmbeddedNats) -> None:
    out = await bench_engines(nats_server.url, HERE, HERE, concurrency=(4, 1), rounds=2)
    assert out["builds"] == {"a": HERE, "b": HERE}
    for level, metric in (("4", "throughput_rps"), ("1", "p50_ms")):
        got = out["levels"][level]
        assert got["metric"] == metric and len(got["a"]) == len(got["b"]) == 2
        assert got["a_median"] > 0 and got["b_median"] > 0
        lo, hi = got["b_over_a_ci95"]
        assert lo <= got["b_over_a"] <= hi
    assert out["load"]["before"]["cpus"] >= 1
