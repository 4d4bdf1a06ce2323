"""The check every grouped-training test makes: a grouped step's losses and weights are
the serial step's (tests/unit/test_models.py, tests/unit/test_pi05.py,
tests/unit/test_pi05_token.py).

Importable from any test as ``grouped_checks``: pytest puts ``tests/`` (the directory of
the root conftest.py) on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from joynexus.agents.models.grouped import TrainItem


def assert_same_steps(g_curves: Sequence[Sequence[float]], s_curves: Sequence[Sequence[float]],
                      g_items: Sequence[TrainItem] = (), s_items: Sequence[TrainItem] = ()) -> None:
    """Each step's per-tenant losses agree to 1e-4 (relative above 1); the tenants' weights,
    where items are given, to 1e-5 absolute / 1e-4 relative."""
    assert len(g_curves) == len(s_curves) > 0
    for lg_step, ls_step in zip(g_curves, s_curves, strict=True):
        for lg, ls in zip(lg_step, ls_step, strict=True):
            assert abs(lg - ls) <= 1e-4 * max(1.0, abs(ls)), (g_curves, s_curves)
    for gi, si in zip(g_items, s_items, strict=True):
        gs, ss = gi.tenant.head.state_dict(), si.tenant.head.state_dict()
        assert gs.keys() == ss.keys()
        for k in gs:
            torch.testing.assert_close(gs[k], ss[k], atol=1e-5, rtol=1e-4)
