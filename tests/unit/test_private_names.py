"""No module takes another module's private (``_name``) names: not by import, and not
in an ``__all__`` (issue 25). What a module shares it names without an underscore."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("agents", "broker", "schemas", "sdk", "ops")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("joynexus"):
            out += [f"imports {node.module}.{a.name}" for a in node.names if _private(a.name)]
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            out += [f"exports {e.value}" for e in getattr(node.value, "elts", [])
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                    and _private(e.value)]
    return out


def test_the_check_sees_both_kinds(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from joynexus.broker.rpc import _x, y\n__all__ = ['y', '_z']\n")
    assert _offences(f) == ["imports joynexus.broker.rpc._x", "exports _z"]


def test_no_private_name_crosses_a_module() -> None:
    found = {str(p.relative_to(ROOT)): o for top in PRODUCT
             for p in sorted((ROOT / top).rglob("*.py")) if (o := _offences(p))}
    assert not found, f"private names shared across modules: {found}"
