"""The victim's probe statistics in `bench isolation` (ops/isolation/victim.py): the
percentiles, the training rate, and the slowest probes named with their call and
when they ran, so a p99 miss says which call and which moment of an attack."""

from __future__ import annotations

from joynexus.ops.isolation.victim import Stats, rate


def test_stats_name_the_slowest_probes_with_their_call_and_time() -> None:
    xs = [0.01] * 97 + [0.2, 0.05, 0.3]
    calls = [("get_workload", i * 0.02) for i in range(97)] + [
        ("act", 1.94), ("list_workloads", 1.96), ("latest_version", 1.98)]
    s = Stats.of(xs, [], 2.5, calls)
    assert (s.n, s.p50, s.max) == (100, 0.01, 0.3)
    assert s.p99 == 0.2  # the 99th of 100 sorted
    assert s.slowest == [("latest_version", 0.3, 1.98), ("act", 0.2, 1.94),
                         ("list_workloads", 0.05, 1.96)]
    assert s.train_rate == 2.5
    assert Stats.of(xs, []).slowest == []  # no calls recorded: none named
    assert Stats.of([], ["x"]).n == 0


def test_rate_is_unknown_when_a_read_failed() -> None:
    assert rate(3, 9, 2.0) == 3.0
    assert rate(-1, 9, 2.0) is None and rate(3, 9, 0.0) is None
