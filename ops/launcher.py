"""``joynexus up``: one OS process per agent role against one NATS URL.

Each role is ``python -m joynexus.ops.cli agent <role>``, exactly what an
operator would run on separate machines. The launcher prints each role's
state, forwards Ctrl-C as SIGTERM (roles drain and stop), and reports a role
that exits on its own. Restarting failed roles in place is the health
manager's job.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from joynexus.ops.roles import ROLES


def role_command(role: str, url: str, namespace: str, *, instance: str, out_dir: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "joynexus.ops.cli",
        "agent",
        role,
        "--nats",
        url,
        "--namespace",
        namespace,
        "--instance",
        instance,
    ]
    if role == "actor":
        cmd += ["--out", str(out_dir)]
    return cmd


def launch(url: str, namespace: str, roles: list[str], *, out_dir: Path) -> int:
    bad = [r for r in roles if r not in ROLES]
    if bad:
        print(f"joynexus up: unknown roles {bad}; roles are {', '.join(ROLES)}", file=sys.stderr)
        return 2
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        for role in roles:
            procs[role] = subprocess.Popen(
                role_command(role, url, namespace, instance=f"{role}-0", out_dir=out_dir)
            )
            print(f"  started {role:<13} pid {procs[role].pid}", file=sys.stderr, flush=True)
        print(
            f"deployment up on {url} (namespace {namespace}); Ctrl-C stops it; "
            f"`joynexus status --nats {url}` shows it",
            file=sys.stderr,
            flush=True,
        )
        while not stopping:
            time.sleep(0.5)
            for role, p in procs.items():
                if p.poll() is not None and not getattr(p, "_reported", False):
                    print(f"  {role} exited with {p.returncode}", file=sys.stderr, flush=True)
                    p._reported = True  # type: ignore[attr-defined]
        return 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
