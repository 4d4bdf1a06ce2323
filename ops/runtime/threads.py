"""Compute threads per role process, chosen from the cores the deployment has.

Every torch, OpenMP and BLAS runtime starts as many threads as the machine has
cores unless told otherwise, so a deployment of a dozen processes on 2 cores
would spin a dozen parallel regions for the same two cores (each waits for
whichever of its threads another process took the core from). The plan gives
each compute role a share and everything else one thread, so the threads that
compute add up to about the cores: :func:`thread_plan` is pure (tabled in
tests/unit/test_threads.py); :func:`role_thread_env` is what a launcher puts in a
role's environment (``OMP_NUM_THREADS``, which torch also takes for its
intra-op threads, ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, and the
inference engine's ``$JOYNEXUS_INFER_THREADS``). ``$JOYNEXUS_CORES`` says how many cores the
deployment has (default: the cores this process may run on); a variable the
operator set already is kept.

See docs/ARCHITECTURE.md, "Processes".
"""

from __future__ import annotations

import os
from collections.abc import Mapping

CORES_ENV = "JOYNEXUS_CORES"
#: The inference engine's own knob (agents/inference/pool.py, serving_threads).
INFER_THREADS_ENV = "JOYNEXUS_INFER_THREADS"
_BLAS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def deployment_cores(environ: Mapping[str, str] = os.environ) -> int:
    """``$JOYNEXUS_CORES``, else the cores this process may use (at least 1)."""
    raw = environ.get(CORES_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"${CORES_ENV}={raw!r}: expected a whole number >= 1") from None
        if n < 1:
            raise ValueError(f"${CORES_ENV}={n}: expected a whole number >= 1")
        return n
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def thread_plan(role: str, cores: int) -> int:
    """Intra-op threads for one process of ``role`` on a deployment of ``cores``.

    The trainer (``actor``) takes half the cores, the inference engine a quarter
    (its event loop needs a core beside its forward: one thread on 2-4 cores),
    every other role one: the actor-forward stage, the evaluator and each
    environment worker compute in bursts beside them, and the light roles
    (scheduler, control plane, monitor, producers, advantage) barely compute."""
    if cores < 1:
        raise ValueError(f"cores {cores}: must be >= 1")
    if role == "actor":
        return max(1, cores // 2)
    if role == "inference":
        return max(1, cores // 4)
    return 1


def role_thread_env(
    role: str, *, cores: int | None = None, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The thread settings for a process of ``role``, leaving out any the operator
    set in ``environ`` already (theirs wins)."""
    n = str(thread_plan(role, cores or deployment_cores(environ)))
    out = {name: n for name in _BLAS}
    if role == "inference":
        out[INFER_THREADS_ENV] = n
    return {k: v for k, v in out.items() if not environ.get(k, "").strip()}
