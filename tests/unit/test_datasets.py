"""Tenants' dataset spaces: a workload's dataset resolves only inside its tenant's space,
and every refusal reads the same."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from joynexus.agents.datasets import (
    DATASETS_ENV,
    default_root,
    no_dataset,
    resolve_dataset,
    tenant_root,
)
from joynexus.agents.producers import workload_schema
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import WorkloadSpec


def fake_dataset(path: Path, features: dict | None = None) -> Path:
    (path / "meta").mkdir(parents=True)
    feats = features if features is not None else {
        "observation.images.base_camera": {"dtype": "image", "shape": [64, 64, 3]},
        "observation.state": {"dtype": "float32", "shape": [9]},
        "action": {"dtype": "float32", "shape": [4]},
    }
    (path / "meta" / "info.json").write_text(json.dumps({"fps": 20, "features": feats}))
    (path / "data").mkdir()
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "datasets"
    fake_dataset(r / "acme" / "pick")
    fake_dataset(r / "bolt" / "pick")
    (r / "acme" / "notes.txt").write_text("secret_key: 1\n")
    (r / "acme" / "plain").mkdir()
    (r / "acme" / "plain" / "keys.json").write_text(json.dumps({"secret_feature": 1}))
    return r


def message(root: Path, requested: str, tenant: str = "acme", override: str = "") -> str:
    with pytest.raises(InvalidSpec) as e:
        resolve_dataset(root, tenant, requested, override)
    return str(e.value)


def test_own_dataset_resolves_to_its_absolute_real_path(root: Path) -> None:
    want = os.path.realpath(root / "acme" / "pick")
    assert resolve_dataset(root, "acme", "pick") == want
    assert resolve_dataset(str(root), "acme", "./pick/") == want
    assert resolve_dataset(root, "acme", str(root / "acme" / "pick")) == want
    # a symlink that stays inside the space is fine
    (root / "acme" / "alias").symlink_to(root / "acme" / "pick")
    assert resolve_dataset(root, "acme", "alias") == want


def test_every_refusal_reads_the_same(root: Path, tmp_path: Path) -> None:
    (root / "acme" / "stolen").symlink_to(root / "bolt" / "pick")
    fake_dataset(root / "acme" / "half")
    (root / "acme" / "half" / "data").rmdir()
    (root / "acme" / "half" / "data").symlink_to(root / "bolt" / "pick" / "data")
    outside = fake_dataset(tmp_path / "elsewhere" / "x")
    (root / "acme" / "metaout").mkdir()
    (root / "acme" / "metaout" / "meta").symlink_to(outside / "meta")
    cases = {
        "traversal": "../bolt/pick",
        "deep traversal": "pick/../../bolt/pick",
        "absolute into bolt": str(root / "bolt" / "pick"),
        "absolute outside": str(outside),
        "symlink to bolt": "stolen",
        "data symlinked out": "half",
        "meta symlinked out": "metaout",
        "a file": "notes.txt",
        "not a dataset": "plain",
        "missing": "nothing/here",
        "absolute missing": "/etc/passwd",
        "empty": "",
        "nul": "pick\x00",
    }
    msgs = {}
    for what, requested in cases.items():
        msgs[what] = message(root, requested)
        # the same text as a request for a name that surely does not exist
        assert msgs[what] == str(no_dataset("acme", requested)), what
        assert "secret" not in msgs[what]
        assert "info.json" not in msgs[what]
    # the sentence differs only in the echoed request
    for what, requested in cases.items():
        assert msgs[what].replace(repr(requested), "X") == msgs["missing"].replace(
            repr("nothing/here"), "X"
        ), what


def test_bolt_is_confined_too_and_tenant_names_are_checked(root: Path) -> None:
    assert resolve_dataset(root, "bolt", "pick") == os.path.realpath(root / "bolt" / "pick")
    assert message(root, "../acme/pick", tenant="bolt") == str(no_dataset("bolt", "../acme/pick"))
    assert message(root, "pick", tenant="..") == str(no_dataset("..", "pick"))
    assert message(root, "pick", tenant="acme/../bolt") == str(no_dataset("acme/../bolt", "pick"))


def test_operator_override_is_the_space(root: Path, tmp_path: Path) -> None:
    special = tmp_path / "special"
    fake_dataset(special / "demo")
    assert tenant_root(root, "acme", str(special)) == special
    assert tenant_root(root, "acme") == root / "acme"
    assert resolve_dataset(root, "acme", "demo", str(special)) == os.path.realpath(special / "demo")
    assert message(root, "pick", override=str(special)) == str(no_dataset("acme", "pick"))


def test_default_root_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(DATASETS_ENV, raising=False)
    assert default_root() == Path(".jnx/datasets")
    monkeypatch.setenv(DATASETS_ENV, str(tmp_path))
    assert default_root() == tmp_path


def test_workload_schema_errors_do_not_echo_contents(root: Path, tmp_path: Path) -> None:
    bad = fake_dataset(root / "acme" / "bad", features={"secret_feature": {"shape": [1]}})
    spec = WorkloadSpec(name="s", task_type="sft", dataset=str(bad))
    with pytest.raises(InvalidSpec) as e:
        workload_schema(spec)
    assert "not a usable LeRobot dataset" in str(e.value)
    assert "secret" not in str(e.value)
    (bad / "meta" / "info.json").write_text("{not json")
    with pytest.raises(InvalidSpec) as e2:
        workload_schema(spec)
    assert str(e2.value) == str(e.value)
    # a path that is not there reads the same as one that is not a dataset; no path is shown
    gone = WorkloadSpec(name="s", task_type="sft", dataset=str(tmp_path / "nope"))
    with pytest.raises(InvalidSpec) as e3:
        workload_schema(gone)
    assert str(e3.value) == str(e.value)
    assert str(tmp_path) not in str(e.value)
    good = WorkloadSpec(name="s", task_type="sft", dataset=resolve_dataset(root, "acme", "pick"))
    schema, _ = workload_schema(good)
    assert schema.camera_slots == ("base_camera",)
    assert (schema.state_dim, schema.action_dim) == (9, 4)
