"""The first env build of each simulator in a process runs alone.

A simulator's first build imports the rest of its stack, and those stacks share
modules: ManiSkill's controllers import pytorch_kinematics, and LIBERO imports
robosuite; both import matplotlib. Two first builds in two threads (the evaluator
runs several evaluations at once) let Python's import deadlock avoidance hand one
thread a partially initialised ``matplotlib.cm``, and every later build in that
process failed (``cannot import name '_colormaps' from partially initialized
module``: seen in the main job, a LIBERO and a ManiSkill evaluation starting
together). So each simulator's first build holds ONE process-wide lock, shared by
all simulators; later builds of a simulator already built take no lock.
The lock is re-entrant, so a first build that triggers another (a registry
building through a simulator's own ``make_env``) does not deadlock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["first_build_alone"]

_LOCK = threading.RLock()
_built: set[str] = set()


@contextlib.contextmanager
def first_build_alone(simulator: str) -> Iterator[None]:
    """Hold the shared first-build lock unless ``simulator`` has already built an env
    in this process; mark it built when the block ends without an error."""
    if simulator in _built:
        yield
        return
    with _LOCK:
        yield
        _built.add(simulator)
