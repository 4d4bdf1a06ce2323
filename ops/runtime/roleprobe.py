"""One role in this process, measured: how long it took to serve, how much memory it
holds and which heavy libraries it loaded.

    python -m joynexus.ops.runtime.roleprobe ROLE --nats URL [--namespace NS] [--hold S | --until-stdin]

runs role ``ROLE`` (:func:`joynexus.ops.runtime.roles.run_role`, as ``joynexus agent`` does)
until it serves, prints one JSON line ``{"event": "ready", ...}``, keeps it running
``--hold`` seconds (or, with ``--until-stdin``, until a line or the end of stdin:
the caller drives the role meanwhile), prints ``{"event": "report", ...}`` and stops
it. Each line holds ``role``, ``ready_s`` (seconds from this process's start to the
role serving: interpreter start, imports, connection, layout and the role's own
start), ``rss_mb`` and ``peak_rss_mb`` (MiB) and ``heavy`` (the libraries of
:data:`HEAVY_MODULES` in ``sys.modules``). Exit status 1 if the role did not serve
within ``--timeout`` or stopped before. ``tests/agents/test_light_roles.py`` runs it; see
docs/ARCHITECTURE.md ("Light roles").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

#: What only a role that computes with them may load: models (torch, transformers),
#: simulators (ManiSkill: mani_skill, sapien; LIBERO: libero, robosuite, mujoco) and
#: the LeRobot datasets (lerobot).
HEAVY_MODULES = (
    "torch",
    "transformers",
    "mani_skill",
    "sapien",
    "libero",
    "robosuite",
    "mujoco",
    "lerobot",
)


def heavy_loaded(modules: Any = None) -> list[str]:
    """The top-level packages of :data:`HEAVY_MODULES` in ``modules`` (``sys.modules``)."""
    names = sys.modules if modules is None else modules
    return sorted({m.split(".", 1)[0] for m in names} & set(HEAVY_MODULES))


def _snapshot(role: str, ready_s: float | None) -> dict[str, Any]:
    from joynexus.agents.health.heartbeat import rss_mb

    return {
        "role": role,
        "ready_s": ready_s,
        "rss_mb": round(rss_mb(), 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "heavy": heavy_loaded(),
    }


def _say(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


async def probe(
    role: str,
    url: str,
    namespace: str,
    *,
    hold_s: float = 2.0,
    until_stdin: bool = False,
    timeout_s: float = 120.0,
    data_dir: Path | None = None,
) -> int:
    from joynexus.agents.health.heartbeat import process_age_s
    from joynexus.broker.connection import Broker
    from joynexus.ops.runtime.roles import RoleOptions, run_role

    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="jnx-probe-"))
    ready = asyncio.Event()
    ready_s: list[float | None] = [None]

    def on_ready() -> None:
        ready_s[0] = round(process_age_s() or 0.0, 3)
        ready.set()

    opts = RoleOptions(
        instance=f"{role}-probe",
        data_dir=data_dir,
        out_dir=data_dir / "actor",
        nats_url=url,
        ready=on_ready,
    )
    b = await Broker.connect(url, name=opts.instance, namespace=namespace)
    stop = asyncio.Event()
    task = asyncio.create_task(run_role(role, b, stop, opts))
    try:
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({task, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not ready.is_set():
            _say({"event": "not_ready", **_snapshot(role, None),
                  "error": repr(task.exception()) if task.done() else f"not ready in {timeout_s}s"})
            return 1
        _say({"event": "ready", **_snapshot(role, ready_s[0])})
        if until_stdin:
            await asyncio.to_thread(sys.stdin.readline)
        else:
            await asyncio.wait({task}, timeout=hold_s)
        if task.done():
            _say({"event": "stopped", **_snapshot(role, ready_s[0]), "error": repr(task.exception())})
            return 1
        _say({"event": "report", **_snapshot(role, ready_s[0])})
        return 0
    finally:
        stop.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 15.0)
        await b.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m joynexus.ops.runtime.roleprobe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role")
    p.add_argument("--nats", required=True)
    p.add_argument("--namespace", default="jnx")
    p.add_argument("--hold", type=float, default=2.0, help="seconds to keep it running once ready")
    p.add_argument("--until-stdin", action="store_true",
                   help="keep it running until a line (or the end) of stdin")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to become ready")
    p.add_argument("--data-dir", type=Path, default=None)
    a = p.parse_args(argv)
    return asyncio.run(probe(a.role, a.nats, a.namespace, hold_s=a.hold,
                             until_stdin=a.until_stdin, timeout_s=a.timeout, data_dir=a.data_dir))


if __name__ == "__main__":
    sys.exit(main())
