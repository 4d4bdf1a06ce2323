"""A deployment's child processes, stopped together: SIGTERM to all, then SIGKILL to
whichever has not exited after a common grace period (the roles drain on SIGTERM).
Used by the main job's and the attack catalogue's one-process-per-role deployments."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable


def stop_all(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 20.0) -> None:
    """Terminate every live process of ``procs``, wait up to ``grace_s`` in all, kill the rest."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


__all__ = ["stop_all"]
