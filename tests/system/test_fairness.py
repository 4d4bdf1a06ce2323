"""Fair shares of one scarce trainer on a real deployment's scheduler (issue 29):
``joynexus bench fairness`` in short, its figures held to the issue's targets."""

from __future__ import annotations

import pytest

from joynexus.ops.bench.fairness import bench_fairness, tenant_names
from joynexus.ops.runtime.natsserver import EmbeddedNats


async def test_unequal_producers_get_their_weighted_share_of_one_actor(
    nats_server: EmbeddedNats,
) -> None:
    """12 tenants whose production rates differ 10x, weights 1 and 2, one actor: the
    equal-weight tenants get equal updates (Jain >= 0.9) and the weight-2 class twice
    the weight-1 class's (+-15%), and the scheduler's own shares say the same."""
    r = await bench_fairness(nats_server.url, 10.0, progress=False)
    assert r["jain_equal_weight"] >= 0.9, r["updates_per_tenant"]
    assert r["class_share_ratio"] == pytest.approx(2.0, rel=0.15), r["updates_per_tenant"]
    assert set(r["updates_per_tenant"]) == set(tenant_names())
    assert all(n > 0 for n in r["updates_per_tenant"].values())
    # Everyone produced more than it was served: the trainer was the scarce part.
    assert all(r["produced_per_tenant"][t] > n for t, n in r["updates_per_tenant"].items())
    shares = r["scheduler_shares"]
    assert sum(s["fair_share"] for s in shares.values()) == pytest.approx(1.0, abs=0.01)
    for t, (_rate, w) in tenant_names().items():
        assert shares[t]["fair_share"] == pytest.approx(w / 18, abs=0.01)
        assert shares[t]["share"] == pytest.approx(shares[t]["fair_share"], rel=0.25)
