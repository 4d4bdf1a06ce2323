"""Training Queue throughput: put and get (get_meta + get_data) MB/s per partition size.

Each round writes one partition holding one float32 field of the given size,
reads it back whole as one task would, checks it, and clears it (clearing is
not timed). ``python -m joynexus.ops.bench_tq [URL]`` prints the JSON; without
a URL it runs against an embedded nats-server in a temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

from joynexus.broker.connection import Broker
from joynexus.broker.layout import LayoutOptions, delete_layout, ensure_layout
from joynexus.broker.tq import TrainingQueue

MB = 1024 * 1024
TENANT = "bench"
ROW_FLOATS = 1024  # 4 KiB rows


async def _bench_size(tq: TrainingQueue, size_mb: int, seconds: float) -> dict[str, float]:
    rows = max(1, size_mb * MB // (4 * ROW_FLOATS))
    x = np.random.default_rng(size_mb).standard_normal((rows, ROW_FLOATS)).astype(np.float32)
    nbytes = x.nbytes
    put_s = get_s = 0.0
    n = 0
    deadline = time.perf_counter() + seconds
    while n == 0 or time.perf_counter() < deadline:
        pid = f"b{size_mb}-{n}"
        t0 = time.perf_counter()
        await tq.async_put({"x": x}, tenant_id=TENANT, partition_id=pid)
        t1 = time.perf_counter()
        meta = await tq.async_get_meta(["x"], rows, tenant_id=TENANT, partition_id=pid,
                                       task_name="bench")
        got = await tq.async_get_data(meta)
        t2 = time.perf_counter()
        if got["x"].shape != x.shape or not np.array_equal(got["x"][-1], x[-1]):
            raise AssertionError(f"partition {pid} came back different")
        await tq.async_clear_partition(TENANT, pid)
        put_s += t1 - t0
        get_s += t2 - t1
        n += 1
    mb = nbytes / MB
    return {"put_mb_s": round(mb * n / put_s, 1), "get_mb_s": round(mb * n / get_s, 1),
            "puts": n, "gets": n}


async def bench_tq(url: str, seconds: float, sizes_mb: list[int] | None = None) -> dict[str, Any]:
    """Measure against the server at ``url``, ~seconds/len(sizes) per size, in its own
    namespace (its streams are deleted afterwards)."""
    sizes = list(sizes_mb or [1, 2, 4, 8])
    ns = f"bench{uuid.uuid4().hex[:8]}"
    b = await Broker.connect(url, name="bench-tq", namespace=ns)
    try:
        await ensure_layout(b, LayoutOptions(tq_ttl_s=600))
        tq = TrainingQueue(b, ttl_s=600)
        await _bench_size(tq, 1, 0.0)  # warm up connections and the stream
        by_size = {s: await _bench_size(tq, s, seconds / len(sizes)) for s in sizes}
    finally:
        await delete_layout(b)
        await b.close()
    top = by_size[max(sizes)]
    return {"put_mb_s": top["put_mb_s"], "get_mb_s": top["get_mb_s"], "sizes_mb": sizes,
            "by_size": by_size}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    seconds = 8.0
    if args and args[0] not in ("", "-"):
        print(json.dumps(asyncio.run(bench_tq(args[0], seconds)), indent=2))
        return
    from joynexus.ops.natsserver import EmbeddedNats

    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(tmp) as server:
        print(json.dumps(asyncio.run(bench_tq(server.url, seconds)), indent=2))


if __name__ == "__main__":
    main()
