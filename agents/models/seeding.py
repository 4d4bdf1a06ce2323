"""Seeded builds under one lock: ``seeded(seed)``.

Heads and bases draw their fresh weights from torch's ONE process-wide
generator, forked and seeded for the build (``torch.random.fork_rng`` +
``manual_seed``). Two builds on two threads (the actor's step thread, the
``jnx-init`` endpoint's thread, the inference engine's) would interleave their
draws on that one generator, and a head built from ``seed`` would no longer be
the same weights every time. Every seeded build goes through this re-entrant
lock (re-entrant: a base build may build a head inside), so a seed names its
weights whatever other builds run meanwhile (``tests/unit/test_seeding.py``). A
draw from the global generator outside any seeded block, on another thread,
is not fenced by the lock: the service's own draws use each head's generator.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["seeded"]

_LOCK = threading.RLock()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's global generator seeded to ``seed``, alone among
    seeded blocks of this process, and restore the generator after it."""
    with _LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
