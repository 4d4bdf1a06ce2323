"""One home for every name on the wire (issue 16, item 2).

Subjects of this namespace layout, the server's API subjects (``$KV.``, ``$JS.``,
``$SRV.``, ``$O.``, inboxes), KV key prefixes, stream and bucket names,
``Nats-`` header names and the JetStream error codes the code decides on are
written in their home modules only; everywhere else imports them. An AST scan
of every string constant (and the literal parts of f-strings, a namespace read
as ``jnx``) in the package finds one written anywhere else. Docstrings are prose
and not scanned. Training Queue field names live in schemas/samples.py (its
``FIELDS`` table): the last tests here find one written elsewhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    # a stream, bucket or store name built inline: f"{ns.upper()}_USAGE", "JNX_TQ"
    "stream-name": re.compile(r"^(\{\}|JNX)_[A-Z]{2,}$"),
}
ERROR_CODES = {10071, 10164, 10058}

#: Where each kind lives.
HOMES: dict[str, set[str]] = {
    "server-subject": {"broker/subjects.py", "broker/natsapi.py"},
    "layout-subject": {"broker/subjects.py", "broker/layout.py"},
    "kv-key": {"broker/subjects.py"},
    "header": {"broker/headers.py"},
    "stream-name": {"broker/subjects.py"},
    "error-code": {"broker/errcodes.py"},
}

#: Files other sessions were editing when this test was written (issue 16): they
#: still write these names. Each entry is (file, kind, how many); move the name to
#: its home and delete the entry (a stale entry fails too, so the list only shrinks).
KNOWN_EXCEPTIONS: dict[tuple[str, str], int] = {
    # agents/envworkers/: ASSIGN_PREFIX ("env.", assign.py) and the env workers'
    # heartbeat filter (supervisor.py)
    ("agents/envworkers/assign.py", "kv-key"): 1,
    ("agents/envworkers/supervisor.py", "kv-key"): 1,
    # ops/bench/hostsrig.py: a health manager's state key read by hand
    ("ops/bench/hostsrig.py", "kv-key"): 1,
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


def test_the_scan_sees_a_stream_name_built_inline() -> None:
    src = '''
def f(b):
    return f"{b.names.namespace.upper()}_USAGE", "JNX_TQ", f"{b.names.namespace}_x", "A_B"
'''
    assert [(k, line, t) for k, line, t in scan(src)] == [
        ("stream-name", 3, "{}_USAGE"), ("stream-name", 3, "JNX_TQ"),
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
        "names written outside their homes (broker/subjects.py, broker/natsapi.py, broker/layout.py, "
        "broker/headers.py, broker/errcodes.py): import them instead\n" + "\n".join(outside)
    )
    stale = sorted(set(KNOWN_EXCEPTIONS) - set(counts))
    assert not stale, f"these files no longer write such names: remove {stale} from KNOWN_EXCEPTIONS"


# ---------------------------------------------------------------- Training Queue fields
# The table of Training Queue fields (name, dtype, shape) is schemas/samples.py's
# FIELDS; everything else imports the names. A string constant equal to a field
# name (or starting with the image prefix) anywhere else fails, but for these.

#: Where hostile or hand-made rows are built on purpose (benches, the isolation
#: suite): literals are the point there.
FIELD_LITERALS_OK = ("ops/bench/fencing.py", "ops/isolation/")
#: (file, name): how many such literals the file may hold at most, and why. Move the
#: name to an import and lower (or delete) the entry.
FIELD_EXCEPTIONS: dict[tuple[str, str], int] = {
    # "advantages" is also the advantage stage's name (scheduler stage, consumer, task)
    ("agents/advantage.py", "advantages"): 1,
    ("agents/stage.py", "advantages"): 1,
    ("agents/synthetic.py", "advantages"): 1,
    ("schemas/jobs.py", "advantages"): 1,
    ("ops/runtime/roles.py", "advantages"): 1,
    ("ops/plan/sim.py", "advantages"): 1,
    ("ops/bench/scheduler.py", "advantages"): 1,
    # other sessions' files when this was written (issue 16): they should import these
    ("agents/actor/forward.py", "old_logp"): 1,
    ("agents/actor/forward.py", "values"): 1,
    ("agents/actor/decisions.py", "advantages"): 1,
    ("agents/actor/decisions.py", "returns"): 1,
    ("agents/models/heads/gaussian.py", "old_logp"): 1,
    ("agents/models/heads/gaussian.py", "advantages"): 1,
    ("agents/models/heads/gaussian.py", "returns"): 1,
    ("broker/inference_client.py", "actions"): 1,  # the reply's tensor, named as the chunk
    # schemas/rows.py: two bounds' descriptions are the words themselves
    ("schemas/rows.py", "advantages"): 1,
    ("schemas/rows.py", "returns"): 1,
    # the same words in other vocabularies: LeRobot's dataset columns, ManiSkill's
    # info key, a torch optimizer's state
    ("agents/envs/lerobot_data.py", "episode_index"): 2,
    ("agents/envs/lerobot_data.py", "frame_index"): 2,
    ("agents/envs/maniskill/env.py", "success"): 1,
    ("ops/bench/faults.py", "step"): 1,
}


def _field_names() -> set[str]:
    from joynexus.schemas.samples import EXECUTED_ACTION_FIELD, FIELDS

    # "action" is LeRobot's key too (heads, datasets) and an audit record's field:
    # not scanned (the table gives it one shape, [M, A]).
    return {n for n in FIELDS if "<" not in n} - {EXECUTED_ACTION_FIELD}


def field_literals(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string constant in ``source`` that is a Training Queue
    field name or starts with the image prefix (docstrings and ``__all__`` aside)."""
    from joynexus.schemas.samples import IMAGE_FIELD_PREFIX

    tree = ast.parse(source)
    skip = _docstrings(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets
        ):
            skip.update(id(c) for c in ast.walk(n.value))
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
        and (n.value in names or n.value.startswith(IMAGE_FIELD_PREFIX))
    ]


def test_the_field_scan_sees_literals_and_not_imports() -> None:
    src = '''
"""Rewards and "actions" in prose are fine."""
from joynexus.schemas.samples import ACTIONS_FIELD
__all__ = ["step"]
def f(out):
    out[ACTIONS_FIELD] = out["actions"]
    return out["obs_image_base_camera"], {"rewards": 1}, "action", "reward"
'''
    assert field_literals(src, _field_names()) == [(6, "actions"), (7, "obs_image_base_camera"), (7, "rewards")]


def test_training_queue_field_names_are_written_in_schemas_samples_only() -> None:
    names = _field_names()
    counts: dict[tuple[str, str], list[str]] = {}
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "schemas/samples.py" or rel.startswith(FIELD_LITERALS_OK):
                continue
            for line, name in field_literals(path.read_text(), names):
                counts.setdefault((rel, name), []).append(f"{rel}:{line}: {name!r}")
    over = [
        hit
        for key, hits in sorted(counts.items())
        if len(hits) > FIELD_EXCEPTIONS.get(key, 0)
        for hit in hits
    ]
    assert not over, (
        "Training Queue field names written outside schemas/samples.py: import them "
        "from there (FIELDS is the table)\n" + "\n".join(over)
    )


def test_the_field_table_gives_each_name_one_shape() -> None:
    import re

    import numpy as np

    from joynexus.schemas import samples as s

    token = re.compile(r"^[a-z0-9_]{1,64}$")  # Training Queue fields are subject tokens
    for name, f in s.FIELDS.items():
        assert f.name == name and token.match(name.replace("<camera>", "cam")), name
        assert set(f.dims) <= set(s.DIMS), name
        np.dtype(f.dtype)  # a real dtype
    # the executed action and the learned chunk: two names, two shapes
    assert s.FIELDS[s.EXECUTED_ACTION_FIELD].dims == ("A",)
    assert s.FIELDS[s.ACTIONS_FIELD].dims == ("H", "A")
    assert s.EXECUTED_ACTION_FIELD != s.ACTIONS_FIELD
    for task, required in s.REQUIRED.items():
        assert set(required) <= set(s.FIELDS), task
    assert set(s.REQUIRED["sft"]) < set(s.REQUIRED["rl"])
    assert set(s.ROLLOUT_STEP_FIELDS) <= set(s.FIELDS)
    sizes = s.dims_of(2, 4, 9, 3, (8, 6))
    assert s.FIELDS[s.ACTIONS_FIELD].shape(sizes) == (2, 4)
    assert s.image_shape(sizes) == (3, 8, 6)
