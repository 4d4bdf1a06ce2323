"""A valid :class:`WorkloadSpec` of any task type in one call, for the tests that vary
one field of it (tests/unit/test_control_checks.py, tests/system/test_spec_bounds.py).

Importable from any test as ``workload_specs``: pytest puts ``tests/`` (the
directory of the root conftest.py) on ``sys.path``.
"""

from __future__ import annotations

from typing import Any

from joynexus.schemas.workloads import Scheduling, WorkloadSpec


def spec(name: str = "w", task_type: str = "rl", **kw: Any) -> WorkloadSpec:
    """A spec named ``name`` with what ``task_type`` needs (an env, a dataset, the
    workload an evaluation starts from) unless ``kw`` sets it; ``scheduling`` may be
    a dict of :class:`Scheduling` fields."""
    if task_type in ("rl", "eval"):
        kw.setdefault("env", "PickCube-v1")
    if task_type == "sft":
        kw.setdefault("dataset", "demo")
    if task_type == "eval":
        kw.setdefault("init_from_workload", "base")
    if isinstance(kw.get("scheduling"), dict):
        kw["scheduling"] = Scheduling(**kw["scheduling"])
    return WorkloadSpec(name=name, task_type=task_type, **kw)  # type: ignore[arg-type]
