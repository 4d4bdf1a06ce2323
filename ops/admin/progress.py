"""A one-line progress bar for long operator work (dataset generation, base pretraining)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """A one-line progress bar on a terminal (plain lines otherwise)."""

    def __init__(self, total: int, label: str, stream: TextIO = sys.stderr) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()
        self._last = -1

    def __call__(self, kept: int, attempts: int) -> None:
        frac = min(1.0, kept / self.total)
        el = time.perf_counter() - self.t0
        eta = el / frac - el if frac > 0 else 0.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = (f"{self.label} [{bar}] {kept}/{self.total} episodes ({attempts} tried) "
                f"{el:.0f}s elapsed, ~{eta:.0f}s left")
        if kept == attempts == 0:  # shown at once: the first episode waits for the renderer
            line = f"{self.label} [{bar}] 0/{self.total} episodes, starting the simulator"
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif kept != self._last and (kept % max(1, self.total // 10) == 0 or kept == self.total):
            self.stream.write(line + "\n")
            self.stream.flush()
        self._last = kept

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
