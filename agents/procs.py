"""Child processes of agents and operator tools: they die with their parent.

The health manager and the embedded nats-server (ops/runtime/natsserver.py) both
start children; this is their one helper, kept in the agents layer so that
agents never import ops.

See docs/ARCHITECTURE.md, "Layout and import root" (layers point down).
"""

from __future__ import annotations

import ctypes
import signal

__all__ = ["die_with_parent"]


def die_with_parent() -> None:
    """preexec_fn for children: SIGTERM them when this process dies (PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
