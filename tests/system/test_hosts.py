"""A host lost without losing a job: two hosts share a deployment on a 3-node
cluster; one host's supervisor, roles and nats node are killed at once (-9)."""

from __future__ import annotations

from pathlib import Path

import pytest

from joynexus.ops.bench.faults import host_lost_fault

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


async def test_host_lost_the_other_host_takes_over_and_nothing_is_lost(tmp_path: Path) -> None:
    """Each host runs a scheduler and a real actor (tiny base) for two SFT tenants;
    host a holds the scheduler lease and is killed whole."""
    r = await host_lost_fault(tmp_path, real_trainer=True)
    # host a held the scheduler lease; host b's scheduler holds it after the kill
    assert r["lease_before"].startswith("a/") and r["lease_after"].startswith("b/"), r
    # detected by the lease's TTL (3 s) plus polling, not by a timeout of minutes
    assert r["detect_s"] <= r["lease_ttl_s"] + 10, r
    # both tenants went on training after the takeover
    assert all(v > 0 for v in r["progress"].values()), r
    # the audit of the job log after draining: nothing lost, nothing twice, nothing leaked
    assert r["jobs_lost"] == 0 and r["jobs_doubled"] == 0 and r["partitions_leaked"] == 0, r
    assert r["jobs"] > 0 and set(r["final_states"]) <= {"completed", "dropped", "failed"}, r
    # the trainers' state lived in JetStream: every update made one version, in order,
    # none twice, and the optimizer's step count is the number of updates (no reset)
    for tenant, t in r["trainers"].items():
        assert t["updates"] > 0 and t["versions_unique"] and t["versions_contiguous"], (tenant, t)
        assert t["optimizer_continued"], (tenant, t)
