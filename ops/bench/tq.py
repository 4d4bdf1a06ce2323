"""Training Queue throughput: put and get (get_meta + get_data) MB/s per partition size.

Each round writes, per size, one partition holding one float32 field of that
size, reads it back whole as one task would, checks it, and clears it
(clearing is not timed); sizes alternate within the round.
``python -m joynexus.ops.bench.tq [URL]`` prints the JSON; without a URL it
runs against an embedded nats-server in a temporary directory.
See docs/ARCHITECTURE.md, "Measured".
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

import numpy as np

from joynexus.broker.connection import Broker
from joynexus.broker.layout import LayoutOptions, delete_layout, ensure_layout
from joynexus.broker.tq import TrainingQueue
from joynexus.ops.bench.server import on_server
from joynexus.ops.measure import stats

MB = 1024 * 1024
TENANT = "bench"
ROW_FLOATS = 1024  # 4 KiB rows


async def _round(tq: TrainingQueue, x: np.ndarray, pid: str) -> tuple[float, float]:
    """One partition written, read back whole, checked and cleared: (put_s, get_s)."""
    t0 = time.perf_counter()
    await tq.async_put({"x": x}, tenant_id=TENANT, partition_id=pid)
    t1 = time.perf_counter()
    meta = await tq.async_get_meta(["x"], len(x), tenant_id=TENANT, partition_id=pid,
                                   task_name="bench")
    got = await tq.async_get_data(meta)
    t2 = time.perf_counter()
    if got["x"].shape != x.shape or not np.array_equal(got["x"][-1], x[-1]):
        raise AssertionError(f"partition {pid} came back different")
    await tq.async_clear_partition(TENANT, pid)  # not timed
    return t1 - t0, t2 - t1


def _figures(mb: float, put_s: list[float], get_s: list[float]) -> dict[str, Any]:
    put = [mb / t for t in put_s]
    get = [mb / t for t in get_s]
    p, p_lo, p_hi = stats.median_ci(put)
    g, g_lo, g_hi = stats.median_ci(get)
    return {"put_mb_s": round(p, 1), "put_mb_s_ci95": [round(p_lo, 1), round(p_hi, 1)],
            "get_mb_s": round(g, 1), "get_mb_s_ci95": [round(g_lo, 1), round(g_hi, 1)],
            "puts": len(put), "gets": len(get)}


async def bench_tq(url: str, seconds: float, sizes_mb: list[int] | None = None) -> dict[str, Any]:
    """Measure against the server at ``url`` for about ``seconds``, in its own namespace
    (its streams are deleted afterwards).

    Sizes are interleaved: every round writes and reads one partition of each size,
    the order flipped each round (``ops.measure.stats``), the first round dropped, so
    load from elsewhere lands on every size alike. Figures are medians over rounds
    of MB/s with bootstrap 95% intervals.
    """
    sizes = list(sizes_mb or [1, 2, 4, 8])
    ns = f"bench{uuid.uuid4().hex[:8]}"
    b = await Broker.connect(url, name="bench-tq", namespace=ns)
    load_before = stats.load()
    try:
        await ensure_layout(b, LayoutOptions(tq_ttl_s=600))
        tq = TrainingQueue(b, ttl_s=600)
        data = {
            s: np.random.default_rng(s).standard_normal(
                (max(1, s * MB // (4 * ROW_FLOATS)), ROW_FLOATS)
            ).astype(np.float32)
            for s in sizes
        }
        times: dict[int, tuple[list[float], list[float]]] = {s: ([], []) for s in sizes}
        deadline = time.perf_counter() + seconds
        r = 0
        while r < 4 or time.perf_counter() < deadline:
            order = sizes if r % 2 == 0 else sizes[::-1]
            for s in order:
                put_s, get_s = await _round(tq, data[s], f"b{s}-{r}")
                if r > 0:  # the first round warms connections and the stream
                    times[s][0].append(put_s)
                    times[s][1].append(get_s)
            r += 1
        by_size = {s: _figures(data[s].nbytes / MB, *times[s]) for s in sizes}
    finally:
        await delete_layout(b)
        await b.close()
    top = by_size[max(sizes)]
    return {"put_mb_s": top["put_mb_s"], "get_mb_s": top["get_mb_s"], "sizes_mb": sizes,
            "by_size": by_size, "rounds": r - 1,
            "load": {"before": load_before, "after": stats.load()}}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    seconds = 8.0
    url = args[0] if args and args[0] not in ("", "-") else None
    print(json.dumps(asyncio.run(on_server(url, bench_tq, seconds=seconds)), indent=2))


if __name__ == "__main__":
    main()
