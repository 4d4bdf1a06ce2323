"""Two builds of the inference engine side by side: throughput and latency, ABAB, JSON out.

This machine's speed drifts by +-15% within minutes, so two engine builds measured
in separate runs cannot be told apart by less than that. Here both serve at once
(each in its own process, its own namespace, the same NATS server, tiny backbone,
B=16, T=5 ms, eight tenants, half OFT MLP and half flow-matching heads) and
closed-loop clients in this process alternate between them round by round (AB,
BA, ...), so drift falls on both alike. Per concurrency level: each build's
median (throughput req/s, or p50 ms at concurrency 1), ``b_over_a`` the median
of the rounds' B/A ratios with its bootstrap 95% interval, and every round's
figures; the machine's load before and after. Run it with the same build on
both sides (``--a DIR --b DIR``) to see the method's own spread.

A build is a directory holding this repository at some commit, with its
``joynexus/`` folder (``git worktree add DIR COMMIT`` or ``git archive COMMIT |
tar -x -C DIR``); its engine child runs with ``PYTHONPATH=DIR``. The clients and
the published policies are this checkout's, so both builds must read today's
request and policy formats.

    .venv/bin/python -m joynexus.ops.bench.engines --a DIR [--b DIR] [--concurrency 32,1] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from joynexus.ops.bench.server import on_server
from joynexus.ops.measure import stats

__all__ = ["bench_engines", "check_build", "main"]

TENANTS = 8
MAX_BATCH, MAX_WAIT_MS = 16, 5.0
#: this checkout (the default build B)
HERE = str(Path(__file__).resolve().parents[2])


#: The module serving a build's engine child, by the file that holds it: builds
#: before ``ops/bench/`` had it as ``ops/bench_inference.py`` (same ``--serve`` flags).
ENGINE_MODULES = {
    "joynexus/ops/bench/inference.py": "joynexus.ops.bench.inference",
    "joynexus/ops/bench_inference.py": "joynexus.ops.bench_inference",
}


def engine_module(root: str) -> str | None:
    """The module that serves the engine of the build at ``root`` (None: not a build)."""
    for path, module in ENGINE_MODULES.items():
        if (Path(root) / path).exists():
            return module
    return None


def check_build(path: str) -> str:
    """The build directory, absolute; raises ``ValueError`` saying what is missing."""
    root = Path(path).resolve()
    if engine_module(str(root)) is None:
        raise ValueError(
            f"{root} holds no build: expected joynexus/ops/bench/inference.py under it "
            "(make one with `git worktree add DIR COMMIT` or `git archive COMMIT | tar -x -C DIR`)"
        )
    return str(root)


async def bench_engines(
    url: str,
    a: str,
    b: str | None = None,
    *,
    concurrency: Sequence[int] = (32, 1),
    rounds: int = 10,
    threads: int | None = None,
) -> dict[str, Any]:
    """Build ``a`` against build ``b`` (default: this checkout) at each concurrency, both
    engines with ``threads`` torch threads (default: what ``joynexus agent inference``
    takes, :func:`~joynexus.agents.inference.pool.serving_threads`)."""
    from joynexus.agents.inference import InferenceClient
    from joynexus.agents.inference.pool import serving_threads
    from joynexus.agents.models.backbone_config import SIZES, BackboneConfig
    from joynexus.agents.models.policyio import PolicyStore
    from joynexus.broker.connection import Broker
    from joynexus.broker.layout import delete_layout, ensure_layout
    from joynexus.ops.bench import engineload as bi

    if rounds < 2 or not concurrency or min(concurrency) < 1:
        raise ValueError("need rounds >= 2 and concurrency levels >= 1")
    builds = {"a": check_build(a), "b": check_build(b or HERE)}
    threads = serving_threads(threads)
    t_start, load_before = time.perf_counter(), stats.load()
    feature_dim = int(SIZES["tiny"]["text"]["hidden_size"])
    base_model = BackboneConfig(size="tiny").base_model
    schema = bi.sample_schema(base_model)
    tenants = [f"t{i}" for i in range(TENANTS)]
    mods = [bi.sample_module(t, i, feature_dim) for i, t in enumerate(tenants)]
    suffix = os.urandom(3).hex()
    arms: dict[str, tuple[Any, asyncio.subprocess.Process, Any, Any]] = {}
    try:
        for name, root in builds.items():
            br = await Broker.connect(url, name=f"bench-engines-{name}", namespace=f"be{name}{suffix}")
            await ensure_layout(br)
            for t, m in zip(tenants, mods, strict=True):
                await PolicyStore(br).publish(t, "default", m, schema)
            log = tempfile.NamedTemporaryFile(prefix=f"bench-engines-{name}-", suffix=".log", delete=False)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", str(engine_module(root)), "--serve", url,
                "--namespace", br.names.namespace, "--size", "tiny", "--max-batch", str(MAX_BATCH),
                "--max-wait-ms", str(MAX_WAIT_MS), "--threads", str(threads),
                env=dict(os.environ, PYTHONPATH=root), cwd=root, stdout=log, stderr=subprocess.STDOUT,
            )
            arms[name] = (br, proc, InferenceClient(br, base_model=base_model), log)
            try:
                await bi.wait_engine(br, proc)
            except RuntimeError as e:
                text = (await asyncio.to_thread(Path(log.name).read_text, errors="replace"))[-2000:]
                raise RuntimeError(f"build {name} ({root}): {e}; its log ends:\n{text}") from None
            await bi.closed_loop(arms[name][2], schema, tenants, 16, 128)  # warm-up
        seen: dict[tuple[str, int], list[float]] = {}
        for r in range(rounds):
            for c in concurrency:
                for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
                    n = 30 if c == 1 else 10 * c
                    got = await bi.closed_loop(arms[name][2], schema, tenants, c, n)
                    seen.setdefault((name, c), []).append(
                        got["throughput_rps"] if c > 1 else got["p50_ms"]
                    )
    finally:
        for br, proc, _, log in arms.values():
            await bi.stop_engine(proc, log)
            with contextlib.suppress(Exception):
                await delete_layout(br)
            await br.close()
    levels: dict[str, Any] = {}
    for c in concurrency:
        xa, xb = seen[("a", c)], seen[("b", c)]
        ratios = [y / x for x, y in zip(xa, xb, strict=True)]
        med, lo, hi = stats.median_ci(ratios)
        levels[str(c)] = {
            "metric": "throughput_rps" if c > 1 else "p50_ms",
            "a_median": round(statistics.median(xa), 2),
            "b_median": round(statistics.median(xb), 2),
            "b_over_a": round(med, 3),
            "b_over_a_ci95": [round(lo, 3), round(hi, 3)],
            "a": xa,
            "b": xb,
        }
    return {
        "builds": builds,
        "levels": levels,
        "config": {"rounds": rounds, "tenants": TENANTS, "max_batch": MAX_BATCH,
                   "max_wait_ms": MAX_WAIT_MS, "backbone": "tiny", "threads": threads,
                   "cpus": os.cpu_count()},
        "seconds": round(time.perf_counter() - t_start, 1),
        "load": {"before": load_before, "after": stats.load()},
    }


def parse_levels(text: str) -> tuple[int, ...]:
    """``"32,1"`` -> (32, 1); raises ``ValueError`` on anything else."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: give comma-separated whole numbers, e.g. 32,1") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {text!r}: each level must be >= 1")
    return levels


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--a", required=True, metavar="DIR", help="the build to compare against (a checkout)")
    ap.add_argument("--b", default=None, metavar="DIR", help="the other build (default: this checkout)")
    ap.add_argument("--concurrency", default="32,1", help="closed-loop levels, comma-separated (default 32,1)")
    ap.add_argument("--rounds", type=int, default=10, help="AB rounds per level (default 10, ~3 min)")
    ap.add_argument("--threads", type=int, default=None, metavar="N",
                    help="torch threads of both engines (default: what `joynexus agent inference` "
                    "takes: $JOYNEXUS_INFER_THREADS, else the CPU cores less one)")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--nats", default=None, help="NATS URL (default: an embedded nats-server)")
    a = ap.parse_args(argv)
    try:
        levels = parse_levels(a.concurrency)
        check_build(a.a)
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(asyncio.run(on_server(a.nats, bench_engines, a=a.a, b=a.b, concurrency=levels, rounds=a.rounds,
                                                 threads=a.threads))))


if __name__ == "__main__":
    main()
