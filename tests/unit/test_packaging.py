"""The wheel carries every package of the import root (setuptools' list is explicit)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_under_the_import_root_is_in_the_wheel_list() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for d, dirs, files in os.walk(ROOT / "joynexus", followlinks=True):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        if "__init__.py" in files:
            found.add(".".join(Path(d).relative_to(ROOT).parts))
    assert "joynexus.agents.models" in found  # the walk follows the folder's symlinks
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; stale: {sorted(listed - found)}"
