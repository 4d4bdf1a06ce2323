"""The compute threads of each role process (``ops/runtime/threads.py``): a table, no server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from joynexus.ops.runtime.roles import DEPLOYMENT_ROLES
from joynexus.ops.runtime.threads import (
    CORES_ENV,
    INFER_THREADS_ENV,
    deployment_cores,
    role_thread_env,
    thread_plan,
)

COMPUTE = ("actor", "inference", "actor-forward", "evaluator")


@pytest.mark.parametrize(
    ("cores", "actor", "inference"),
    [(1, 1, 1), (2, 1, 1), (4, 2, 1), (8, 4, 2), (16, 8, 4)],
)
def test_the_plan_shares_the_cores(cores: int, actor: int, inference: int) -> None:
    assert (thread_plan("actor", cores), thread_plan("inference", cores)) == (actor, inference)
    # Every other role one thread: the scheduler, the control plane, workers...
    for role in DEPLOYMENT_ROLES:
        if role not in ("actor", "inference"):
            assert thread_plan(role, cores) == 1, role
    assert thread_plan("env-worker", cores) == 1
    # The compute roles' threads add up to about the cores (never twice them).
    assert sum(thread_plan(r, cores) for r in COMPUTE) <= max(cores + 2, 4)


def test_the_environment_a_launcher_gives_a_role() -> None:
    env = role_thread_env("inference", cores=8, environ={})
    assert env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2",
                   INFER_THREADS_ENV: "2"}
    # What the operator set stays theirs.
    kept = role_thread_env("actor", cores=8, environ={"OMP_NUM_THREADS": "3"})
    assert "OMP_NUM_THREADS" not in kept and kept["MKL_NUM_THREADS"] == "4"
    assert deployment_cores({CORES_ENV: "6"}) == 6 and deployment_cores({}) >= 1
    with pytest.raises(ValueError, match="JOYNEXUS_CORES"):
        deployment_cores({CORES_ENV: "many"})
    with pytest.raises(ValueError, match="must be >= 1"):
        thread_plan("actor", 0)


def test_a_role_process_computes_with_the_planned_threads() -> None:
    """torch takes its intra-op threads from OMP_NUM_THREADS at start: a process of
    the actor role on a 2-core plan runs one thread, not one per core."""
    env = {**os.environ, **role_thread_env("actor", cores=2, environ={})}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.strip()
    assert out == "1"
