"""The README's main command at its smallest: the paper's mixed workload and
its isolated baseline, one process per role, report written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_main_job_runs_both_phases_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "joynexus.ops.cli",
            "demo",
            "--minutes",
            "0.4",
            "--out",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=880,
        # The demo's namespaces reserve 1.5 GiB each (a 1 GiB Training Queue, 512 MiB
        # of metrics): the embedded server's own and one per phase. A 4 GiB store holds
        # the server's and one phase's, not both phases': each phase frees its
        # namespace's reservations before the next makes its own.
        env={
            **{k: v for k, v in os.environ.items() if not k.endswith("_MAX_BYTES")},
            "JOYNEXUS_NATS_MAX_FILE_STORE": str(4 * 1024**3),
            # A first run: the RL tenants' starting heads are made, then cached here.
            "JOYNEXUS_CACHE": str(tmp_path / "cache"),
        },
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out / "report.json").read_text())
    for key in ("device_time_ratio", "train_util_ratio", "infer_util_ratio"):
        assert isinstance(results[key], float) and results[key] > 0, key
    assert results["shared"]["busy_s"]["train"] > 0 and results["shared"]["busy_s"]["infer"] > 0
    assert (
        results["shared"]["peak_rss_mb"]["train"] > 100
        and results["isolated"]["peak_rss_mb"]["infer"] > 100
    )
    tenants = results["tenants"]
    assert set(tenants) == {"acme", "bolt", "cora", "dana"}
    # Each phase warmed up on tenants of its own, outside the windows and the figures.
    assert results["warmup"] == {"updates_per_tenant": 1,
                                 "tenants": ["acme1", "bolt1", "cora1", "dana1"]}
    for t, v in tenants.items():
        assert v["updates"] >= 1 and v["final_version"] == 1 + v["updates"], (t, v)
        assert v["failed"] == 0 and v["dropped_stale"] >= 0
        assert (v["eval_success"] is None) == (v["task_type"] == "sft")
        if v["task_type"] == "rl":  # the learning curve: its start and its last version
            assert [h["version"] for h in v["eval_history"]] == [1, v["final_version"]], v
    # The ManiSkill tenants started from SFT heads made before the windows, now cached.
    assert tenants["acme"]["starts_from"] == tenants["bolt"]["starts_from"] == "sft head"
    assert tenants["cora"]["starts_from"] == "fresh head"
    heads = results["starting_heads"]
    assert set(heads) == {"PickCube-v1", "PushCube-v1"} and not any(h["cached"] for h in heads.values())
    for h in heads.values():
        assert (Path(h["path"]) / "head.safetensors").is_file() and h["train_s"] > 0
        assert v["isolated"]["updates"] == v["updates"]
    assert set(results["group_speedup"]) and all(x > 0 for x in results["group_speedup"].values())
    # Every process's memory and start, the bound the cores set, the planner's word.
    assert results["peak_rss_mb_total"] > results["shared"]["peak_rss_mb"]["train"]
    roles = results["roles"]
    assert {"scheduler", "control", "actor", "inference", "env-worker"} <= set(roles)
    assert all(v["rss_mb"] > 10 for v in roles.values()), roles
    assert roles["scheduler"]["ready_s"] is not None and roles["scheduler"]["ready_s"] > 0
    bound = results["cores_bound"]
    assert bound["cores"] >= 1 and bound["isolated_cpu_s"] > 0 and bound["shared_cpu_s"] > 0
    assert bound["max_device_time_ratio"] > 0
    assert "device_time_ratio" in results["planner"], results["planner"]
    report = (out / "report.md").read_text()
    assert "device_time_ratio" in report and "1.39x" in report
    assert "What limits the ratio here" in report and "cores cannot run" in report
    for png in out.glob("plots/*.png"):
        assert png.stat().st_size > 10_000
    assert {p.name for p in out.glob("plots/*.png")} == {
        "utilization.png",
        "loss_curves.png",
        "group_speedup.png",
        "eval_curves.png",  # success against version, per RL tenant
    }
    assert (out / "traces" / "traces.jsonl").stat().st_size > 0
    assert any((out / "monitor" / "clearml").rglob("*")), "ClearML offline session missing"
