"""Child processes of agents and operator tools: they die with their parent.

The health manager, the embedded nats-server (ops/runtime/natsserver.py) and the
operator tools that run a deployment's roles all start children; this is their
one helper, kept in the agents layer so that agents never import ops.

See docs/ARCHITECTURE.md, "Layout and import root" (layers point down).
"""

from __future__ import annotations

import ctypes
import shutil
import signal
from collections.abc import Callable, Sequence

__all__ = ["die_with_parent", "dying_with_parent"]

#: util-linux's setpriv, which sets the parent-death signal and then execs.
_SETPRIV = shutil.which("setpriv")


def die_with_parent() -> None:
    """preexec_fn for children: SIGTERM them when this process dies (PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def dying_with_parent(
    argv: Sequence[str], *, setpriv: str | None = _SETPRIV
) -> tuple[list[str], Callable[[], None] | None]:
    """``(argv, preexec_fn)`` to start a child that gets SIGTERM when this process dies.

    Through ``setpriv --pdeathsig TERM`` where there is one (it execs the command,
    so the child keeps its pid): then ``preexec_fn`` is None, and ``subprocess``
    starts the child with vfork() instead of a fork() that copies this process's
    page tables, which holds its event loop 15-60 ms in a process of 0.5-1.5 GB
    (measured as a tenant's latency in ``bench isolation``). Without setpriv:
    ``argv`` as it is and :func:`die_with_parent`."""
    if setpriv:
        return [setpriv, "--pdeathsig", "TERM", "--", *argv], None
    return list(argv), die_with_parent
