"""A process's start-up heap left out of the garbage collector's later passes.

CPython's full collections walk every tracked object. A role process holds 50,000
to 100,000 of them from its start (modules, classes, the base model's modules
and parameters, mirrors), and a burst of requests (each allocates) set one off
in the middle of serving: 26-32 ms in the control plane, 160 ms in the inference
engine, with other tenants' requests waiting behind it (issue 24). After
:func:`freeze_heap` those objects are never walked again; objects made later
are collected as before.

See docs/ARCHITECTURE.md, "Processes".
"""

from __future__ import annotations

import gc

__all__ = ["freeze_heap"]


def freeze_heap() -> None:
    """Collect once, then freeze every object alive now (``gc.freeze``). For a
    process that has finished starting and serves from here on: a role process once
    it is ready (``joynexus agent``), the isolation bench once its deployment is up;
    not a test process, whose later garbage would then stay."""
    gc.collect()
    gc.freeze()
