"""No import cycle between any two modules of the project, imports inside functions
and under TYPE_CHECKING counted (grimp, import-linter's graph): a cycle held together
by a lazy import is still a cycle."""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            if i < len(adj[v]):
                work.append((v, i + 1))
                w = adj[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def test_the_finder_sees_a_cycle() -> None:
    g = grimp.ImportGraph()
    for m in ("a", "b", "c"):
        g.add_module(m)
    g.add_import(importer="a", imported="b")
    g.add_import(importer="b", imported="a")
    g.add_import(importer="b", imported="c")
    assert _cycles(g) == [["a", "b"]]
    g.add_module("d")
    g.add_import(importer="c", imported="d")
    g.add_import(importer="d", imported="b")  # b -> c -> d -> b joins a's cycle
    assert _cycles(g) == [["a", "b", "c", "d"]]


def test_no_module_imports_itself_through_others() -> None:
    cycles = _cycles(grimp.build_graph("joynexus"))
    assert not cycles, f"import cycles: {cycles}"
