"""One home for every name on the wire (issue 16, item 2).

Subjects of this namespace layout, the server's API subjects (``$KV.``, ``$JS.``,
``$SRV.``, ``$O.``, inboxes), KV key prefixes, ``Nats-`` header names and the
JetStream error codes the code decides on are written in their home modules
only; everywhere else imports them. An AST scan of every string constant (and
the literal parts of f-strings, a namespace read as ``jnx``) in the package
finds one written anywhere else. Docstrings are prose and not scanned.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("agents", "broker", "schemas", "sdk", "ops")

#: The subject tokens after a namespace (broker/subjects.py).
TOKENS = ("job", "tq", "sched", "metrics", "infer", "api", "admin", "lease")
_TOKEN_CONSTANTS = {"JOB": "job", "TQ": "tq", "SCHED": "sched", "METRICS": "metrics",
                    "INFER": "infer", "API": "api", "ADMIN": "admin", "LEASE": "lease"}

KINDS: dict[str, re.Pattern[str]] = {
    # the server's own APIs and inboxes
    "server-subject": re.compile(r"\$(KV|JS|SRV|O)\.|_INBOX\."),
    # a subject of this layout: <ns>.<token>... or *.<token>...
    "layout-subject": re.compile(rf"^(\*|jnx)\.({'|'.join(TOKENS)})(\.|$)"),
    # KV keys: heartbeats, supervisors, leases, assignments, cursors, versions, limits
    "kv-key": re.compile(r"^(hb|mgr|lease|env|cursor|version)\.|^_global\."),
    "header": re.compile(r"^Nats-"),
}
ERROR_CODES = {10071, 10164, 10058}

#: Where each kind lives.
HOMES: dict[str, set[str]] = {
    "server-subject": {"broker/subjects.py"},
    "layout-subject": {"broker/subjects.py", "broker/layout.py"},
    "kv-key": {"broker/subjects.py"},
    "header": {"broker/headers.py"},
    "error-code": {"broker/errcodes.py"},
}

#: Files other sessions were editing when this test was written (issue 16): they
#: still write these names. Each entry is (file, kind, how many); move the name to
#: its home and delete the entry (a stale entry fails too, so the list only shrinks).
KNOWN_EXCEPTIONS: dict[tuple[str, str], int] = {
    # agents/envworkers.py: ASSIGN_PREFIX ("env.") and the env workers' heartbeat filter
    ("agents/envworkers.py", "kv-key"): 2,
    # ops/bench_faults.py: a health manager's state key read by hand
    ("ops/bench_faults.py", "kv-key"): 1,
}


def _text(node: ast.JoinedStr) -> str:
    out = []
    for v in node.values:
        if isinstance(v, ast.Constant):
            out.append(str(v.value))
            continue
        assert isinstance(v, ast.FormattedValue)
        e = v.value
        name = e.attr if isinstance(e, ast.Attribute) else e.id if isinstance(e, ast.Name) else ""
        if name in ("namespace", "ns"):
            out.append("jnx")
        elif name in _TOKEN_CONSTANTS:
            out.append(_TOKEN_CONSTANTS[name])
        else:
            out.append("{}")
    return "".join(out)


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = n.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def scan(source: str) -> list[tuple[str, int, str]]:
    """(kind, line, text) of every name written in ``source``."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr):
            skip.update(id(v) for v in n.values)
    found = []
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Constant) and type(n.value) is int and n.value in ERROR_CODES:
            found.append(("error-code", n.lineno, str(n.value)))
            continue
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            text = n.value
        elif isinstance(n, ast.JoinedStr):
            text = _text(n)
        else:
            continue
        for kind, pattern in KINDS.items():
            if pattern.search(text):
                found.append((kind, n.lineno, text))
    return found


def test_the_scan_sees_each_kind_written_inline() -> None:
    src = '''
"""$KV.docstrings are prose."""
def f(b, ns, bucket, key):
    a = f"$KV.{bucket}.{key}"
    c = f"{b.names.namespace}.job.{key}"
    d = f"{ns}.{API}.x.*"
    e = "*.admin.>"
    g = {"Nats-TTL": "5s"}
    h = e.err_code == 10071
    i = "hb.>"
    j = "_INBOX.jnx.acme"
    return "jnx.jobs are fine", "lease expired", f"{key}.job"
'''
    kinds = sorted((k, line) for k, line, _ in scan(src))
    assert kinds == [
        ("error-code", 9), ("header", 8), ("kv-key", 10), ("layout-subject", 5),
        ("layout-subject", 6), ("layout-subject", 7), ("server-subject", 4), ("server-subject", 11),
    ]


def test_every_name_is_written_in_its_home_only() -> None:
    counts: dict[tuple[str, str], list[str]] = {}
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for kind, line, text in scan(path.read_text()):
                if rel not in HOMES[kind]:
                    counts.setdefault((rel, kind), []).append(f"{rel}:{line}: {text!r}")
    outside = [
        hit
        for key, hits in sorted(counts.items())
        if len(hits) != KNOWN_EXCEPTIONS.get(key, 0)
        for hit in hits
    ]
    assert not outside, (
        "names written outside their homes (broker/subjects.py, broker/layout.py, "
        "broker/headers.py, broker/errcodes.py): import them instead\n" + "\n".join(outside)
    )
    stale = sorted(set(KNOWN_EXCEPTIONS) - set(counts))
    assert not stale, f"these files no longer write such names: remove {stale} from KNOWN_EXCEPTIONS"
