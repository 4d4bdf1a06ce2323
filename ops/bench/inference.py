"""Inference Queue benchmark: grouped speedup, request-reply latency, throughput, RSS.

- ``group_speedup`` / ``group_speedup_ci95``: grouped vs serial shared-forward
  speedup per ``"TxB"`` with its 95% interval
  (T tenants x B samples each), from ``ops.mainjob.group.bench_group`` ("bench"
  backbone; "tiny" and a 2x2 grid with ``--quick``).
- Request-reply through NATS: an engine in its own process (the ``joynexus
  agent inference`` code path: B=16, T=5 ms) serves 8 tenants; closed-loop
  clients at rising concurrency report p50/p99 latency, throughput and the
  mean batch size per level. ``rr_p50_ms``/``rr_p99_ms`` are the lowest load
  level's; ``throughput_rps`` is the best level's. ``c1_vs_inproc``: the same
  eight tenants' requests at concurrency 1 alternated with the same calls in this
  process (same backbone size and heads), and the gap's 95% interval.
- ``rr_overhead_p50_ms``: request-reply p50 minus the in-process call
  (``inproc_p50_ms``) for the same work (canonicalize + backbone forward +
  head), alternated in one loop with a paired bootstrap 95% interval
  (``rr_overhead.rr_overhead_p50_ci95``), both with one request at a time, the engine set to B=1 (no batching wait) and running in this
  process, so only NATS, the codec and the engine's plumbing differ. The client
  has a connection of its own, as a tenant's SDK does; ``rr_overhead.same_connection_*``
  is the same with the client on the engine's connection, in the same rounds, and
  ``rr_overhead.inline_fraction`` the share of batches the engine ran on its loop.
  The product path is the fast path (:mod:`joynexus.broker.fastpath`, on both sides:
  the client's request and the engine's reply); ``rr_overhead_natspy_p50_ms``
  (``rr_overhead.natspy_*``) is the same request in the same rounds through nats-py's
  own request and respond, and ``fastpath_minus_natspy_p50_ms`` the paired difference
  with its interval. ``echo_p50_ms``: the broker's floor, the same request bytes on
  the same two connections in the same rounds answered at once with a reply of the
  engine's size; ``rr_overhead_over_echo_p50_ms``: the round trip minus (in-process
  call + echo), paired by round: what the service adds beyond the broker's own
  round trip. ``echo_work`` (``rr_overhead_over_echo_work_p50_ms``): the same echo whose
  responder first runs the in-process call, so its forward and reply leave from the
  engine's state (after an idle gap, after a forward); the round trip minus it is the
  service's code alone. ``rr_overhead.<arm>_outside_engine_*``
  (round trip - the engine's receipt-to-reply time) and ``<arm>_engine_plumbing_*``
  (receipt-to-reply - forward - head) split the overhead into parts the forward's own
  variance does not blur.
- ``rss_mb``: the engine process's RSS serving 1 tenant, then 8 tenants
  (same load shape), next to the 7 extra heads' weight bytes.

    .venv/bin/python -m joynexus.ops.bench.inference [--quick] [--nats URL]

prints one JSON object. The sample tenants, the engine child process and the
closed-loop load are in ops/bench/engineload.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from joynexus.ops.bench.engineload import (
    HEAD_HIDDEN,
    HW,
    SLOTS,
    TENANTS,
    closed_loop,
    real_request_payload,
    rss_mb,
    sample_module,
    sample_obs,
    sample_schema,
    serve_engine,
    stop_engine,
    wait_engine,
)
from joynexus.ops.bench.server import on_server
from joynexus.ops.measure import stats
from joynexus.ops.measure.stats import percentile

__all__ = ["bench_inference", "main"]

async def _overhead(b: Any, size: str, repeats: int) -> dict[str, Any]:
    """Request-reply through an in-process engine (B=1: no batching wait) vs the in-process call.

    The client asks on a connection of its own, as a tenant's SDK does (``rr``); the same
    request from a client sharing the engine's connection (``rr_same_connection``: one
    socket and one reader for both directions, how this was measured before issue 15's
    last part) runs in the same loop, so both figures come from the same rounds."""
    import torch

    from joynexus.agents.inference import InferenceClient, InferenceEngine
    from joynexus.agents.models.backbone import Backbone
    from joynexus.agents.models.backbone_config import BackboneConfig
    from joynexus.agents.models.features import canonicalize_request
    from joynexus.agents.models.policyio import PolicyStore
    from joynexus.broker import fastpath
    from joynexus.broker.connection import Broker

    bb = await asyncio.to_thread(Backbone.build, BackboneConfig(size=size))  # type: ignore[arg-type]
    schema = sample_schema(bb.config.base_model)
    mod = sample_module("solo", 0, bb.feature_dim)
    await PolicyStore(b).publish("solo", "default", mod, schema)
    engine = InferenceEngine(b, bb, max_batch=1, max_wait_ms=0, instance="bench-overhead")
    await engine.start()
    own = await Broker.connect(b.url, name="bench-infer-solo-client", namespace=b.names.namespace)
    client = InferenceClient(own, base_model=bb.config.base_model)
    shared = InferenceClient(b, base_model=bb.config.base_model)
    natspy = InferenceClient(own, base_model=bb.config.base_model, fast=False)
    fast_respond = engine.rpc.respond  # the product's: a FastResponder (None: nats-py's)
    # The broker's floor: the same request bytes, on the same two connections and in
    # the same rounds, answered at once with a reply of the engine's size (no engine).
    echo_subject = f"{b.names.namespace}.bench.echo"
    echo_payload = real_request_payload()
    echo_reply = b"r" * 400
    b_fast, own_fast = b.fastpath(), own.fastpath()

    async def _answer(msg: Any) -> None:
        await b_fast.respond(msg, echo_reply)

    obs = sample_obs(0)

    def inproc() -> None:
        fb = canonicalize_request(schema, {k: torch.from_numpy(v) for k, v in obs["images"].items()},
                                  obs["instruction"], obs["state"])
        mod.act(bb.encode(fb), fb.state_B_S)

    # The same floor around the same work: this responder runs the in-process call before it
    # answers, so its forward follows the request's idle gap and its reply follows a forward,
    # as the engine's do (the inproc arm's forward follows another forward within ~0.5 ms:
    # warm caches, 0.2-0.3 ms faster; a reply sent after 5 ms of compute costs 0.2-0.3 ms
    # more to send and to arrive than the back-to-back echo's).
    async def _answer_after_work(msg: Any) -> None:
        inproc()
        await b_fast.respond(msg, echo_reply)

    echo_sub = await b.nc.subscribe(echo_subject, cb=_answer)
    work_sub = await b.nc.subscribe(echo_subject + "_work", cb=_answer_after_work)
    await fastpath.sync_server(b.nc)

    async def local() -> None:
        inproc()

    # the engine's own receipt-to-reply time and forward+head time of every reply
    engine_ms: dict[str, list[tuple[float, float]]] = {"rr": [], "rr_natspy": []}

    def note(arm: str, r: Any) -> None:
        engine_ms[arm].append((r.timings.total_ms, r.timings.forward_ms + r.timings.decode_ms))

    async def remote() -> None:
        note("rr", await client.request("solo", schema=schema, **obs))

    async def remote_shared() -> None:
        await shared.request("solo", schema=schema, **obs)

    async def echo() -> None:
        await own_fast.request(echo_subject, echo_payload, timeout=10)

    async def echo_work() -> None:
        await own_fast.request(echo_subject + "_work", echo_payload, timeout=10)

    async def remote_natspy() -> None:
        engine.rpc.respond = None  # the engine answers through nats-py's respond
        try:
            note("rr_natspy", await natspy.request("solo", schema=schema, **obs))
        finally:
            engine.rpc.respond = fast_respond

    try:
        # In-process and request-reply alternate (ABCD DCBA ...), three warm-up rounds dropped.
        ts = await stats.interleaved_async(
            {
                "inproc": local,
                "rr": remote,
                "rr_same_connection": remote_shared,
                "rr_natspy": remote_natspy,
                "echo": echo,
                "echo_work": echo_work,
            },
            repeats=repeats,
            warmup=3,
        )
    finally:
        await echo_sub.unsubscribe()
        await work_sub.unsubscribe()
        await engine.stop()
        await own.close()
    diff, lo, hi = stats.difference_ci(ts["rr"], ts["inproc"])
    sdiff, slo, shi = stats.difference_ci(ts["rr_same_connection"], ts["inproc"])
    fdiff, flo, fhi = stats.difference_ci(ts["rr_natspy"], ts["inproc"])
    gain, glo, ghi = stats.difference_ci(ts["rr"], ts["rr_natspy"])
    # What the service adds beyond the broker's own round trip (same rounds, paired).
    floor = [i + e for i, e in zip(ts["inproc"], ts["echo"], strict=True)]
    adds, alo, ahi = stats.difference_ci(ts["rr"], floor)
    # ... and beyond the broker's round trip around the same work (the service's code alone).
    code, clo, chi = stats.difference_ci(ts["rr"], ts["echo_work"])
    # Low-noise parts of the overhead (the forward's own variance cancels): the round
    # trip outside the engine (both NATS legs, the client's codec, the handler before
    # receipt) and the engine's plumbing around the forward (receipt to reply - forward - head).
    parts: dict[str, Any] = {}
    for arm, pairs in engine_ms.items():
        counted = pairs[len(pairs) - len(ts[arm]):]  # warm-up rounds dropped
        outside = [rt - tot for rt, (tot, _) in zip(ts[arm], counted, strict=True)]
        plumbing = [tot - fwd for tot, fwd in counted]
        for key, xs in (("outside_engine", outside), ("engine_plumbing", plumbing)):
            med, p_lo, p_hi = stats.median_ci(xs)
            parts[f"{arm}_{key}_p50_ms"] = round(med, 3)
            parts[f"{arm}_{key}_p50_ci95"] = [round(p_lo, 3), round(p_hi, 3)]
    st = engine.stats
    return {
        "inproc_p50_ms": percentile(ts["inproc"], 50, digits=3),
        "rr_p50_ms": percentile(ts["rr"], 50, digits=3),
        "rr_overhead_p50_ms": round(diff, 3),
        "rr_overhead_p50_ci95": [round(lo, 3), round(hi, 3)],
        "same_connection_overhead_p50_ms": round(sdiff, 3),
        "same_connection_overhead_p50_ci95": [round(slo, 3), round(shi, 3)],
        "echo_p50_ms": percentile(ts["echo"], 50, digits=3),
        "echo_p50_ci95": [round(x, 3) for x in stats.median_ci(ts["echo"])[1:]],
        "overhead_over_echo_p50_ms": round(adds, 3),
        "overhead_over_echo_p50_ci95": [round(alo, 3), round(ahi, 3)],
        "echo_work_p50_ms": percentile(ts["echo_work"], 50, digits=3),
        "overhead_over_echo_work_p50_ms": round(code, 3),
        "overhead_over_echo_work_p50_ci95": [round(clo, 3), round(chi, 3)],
        "natspy_rr_p50_ms": percentile(ts["rr_natspy"], 50, digits=3),
        "natspy_overhead_p50_ms": round(fdiff, 3),
        "natspy_overhead_p50_ci95": [round(flo, 3), round(fhi, 3)],
        "fastpath_minus_natspy_p50_ms": round(gain, 3),
        "fastpath_minus_natspy_p50_ci95": [round(glo, 3), round(ghi, 3)],
        **parts,
        # batches whose forward ran on the engine's event loop (short: no thread hop)
        "inline_fraction": round(st.inline_batches / max(st.batches, 1), 3),
        "repeats": repeats,
    }


async def _c1_gap(client: Any, schema: Any, tenants: Sequence[str], mods: Sequence[Any],
                  size: str, repeats: int) -> dict[str, Any]:
    """Concurrency 1 against the engine process vs the same requests in-process.

    The same sequence (the eight tenants in turn, each with its own head: OFT MLP or
    flow matching, and the same observations) alternates with an in-process call of the
    same backbone and heads, so the gap is what serving through NATS and another
    process adds at concurrency 1, like for like."""
    import torch

    from joynexus.agents.models.backbone import Backbone
    from joynexus.agents.models.backbone_config import BackboneConfig
    from joynexus.agents.models.features import canonicalize_request

    bb = await asyncio.to_thread(Backbone.build, BackboneConfig(size=size))  # type: ignore[arg-type]
    obs = [sample_obs(i) for i in range(16)]
    n_rr, n_local = itertools.count(), itertools.count()

    async def remote() -> None:
        i = next(n_rr)
        await client.request(tenants[i % len(tenants)], schema=schema, timeout_s=30, **obs[i % len(obs)])

    async def local() -> None:
        i = next(n_local)
        o = obs[i % len(obs)]
        fb = canonicalize_request(schema, {k: torch.from_numpy(v) for k, v in o["images"].items()},
                                  o["instruction"], o["state"])
        with torch.inference_mode():
            mods[i % len(mods)].act(bb.encode(fb), fb.state_B_S)

    ts = await stats.interleaved_async({"inproc": local, "rr": remote}, repeats=repeats, warmup=8)
    gap, lo, hi = stats.difference_ci(ts["rr"], ts["inproc"])
    return {
        "inproc_p50_ms": percentile(ts["inproc"], 50, digits=3),
        "rr_p50_ms": percentile(ts["rr"], 50, digits=3),
        "gap_p50_ms": round(gap, 3),
        "gap_p50_ci95": [round(lo, 3), round(hi, 3)],
        "repeats": repeats,
    }


# ---------------------------------------------------------------- the benchmark


def _warmup(threads: int) -> None:
    import torch

    from joynexus.agents.models.backbone import Backbone
    from joynexus.agents.models.backbone_config import BackboneConfig
    from joynexus.agents.models.features import canonicalize_request

    torch.set_num_threads(threads)
    bb = Backbone.build(BackboneConfig(size="tiny"))
    schema = sample_schema(bb.config.base_model)
    for b in (1, 8, 32):
        fb = canonicalize_request(schema, {s: torch.zeros(b, 3, *HW, dtype=torch.uint8) for s in SLOTS},
                                  "warm up", torch.zeros(b, 8))
        bb.encode(fb)


async def bench_inference(
    url: str, *, quick: bool = False, threads: int = 2, serve_threads: int | None = None
) -> dict[str, Any]:
    """Run every part against the NATS server at ``url``; returns the figures (JSON-ready).

    The grid runs with ``threads`` torch threads; the engine process and the in-process
    references it is compared with (``c1_vs_inproc``, ``rr_overhead``) with
    ``serve_threads``, by default what ``joynexus agent inference`` takes
    (:func:`~joynexus.agents.inference.pool.serving_threads`): like with like."""
    import torch

    from joynexus.agents.inference import InferenceClient
    from joynexus.agents.inference.pool import serving_threads
    from joynexus.agents.models.backbone_config import SIZES, BackboneConfig
    from joynexus.agents.models.policyio import PolicyStore
    from joynexus.broker.connection import Broker
    from joynexus.broker.layout import delete_layout, ensure_layout
    from joynexus.ops.mainjob.group import bench_group

    t_start = time.perf_counter()
    load_before = stats.load()
    grid_size = "tiny" if quick else "bench"
    rr_size = "tiny" if quick else "bench"
    # 1. grouped vs serial shared forward, in this process (before anything else loads the CPUs);
    # a few throwaway forwards first so torch's first-call costs do not land in the grid.
    await asyncio.to_thread(_warmup, threads)
    group = await asyncio.to_thread(bench_group, size=grid_size, quick=quick, threads=threads, rss=False)
    serve_threads = serving_threads(serve_threads)
    torch.set_num_threads(serve_threads)  # the in-process references run as the engine does

    suffix = os.urandom(3).hex()
    ns_engine, ns_solo = f"bi{suffix}", f"bo{suffix}"
    b = await Broker.connect(url, name="bench-infer", namespace=ns_engine)
    solo = await Broker.connect(url, name="bench-infer-solo", namespace=ns_solo)
    await ensure_layout(b)
    await ensure_layout(solo)
    # The engine process builds the same (seeded) backbone; its facts are known from config.
    feature_dim = int(SIZES[rr_size]["text"]["hidden_size"])
    base_model = BackboneConfig(size=rr_size).base_model  # type: ignore[arg-type]
    schema = sample_schema(base_model)
    store = PolicyStore(b)
    tenants = [f"t{i}" for i in range(TENANTS)]
    mods = [sample_module(t, i, feature_dim) for i, t in enumerate(tenants)]
    await store.publish(tenants[0], "default", mods[0], schema)

    max_batch, max_wait_ms = 16, 5.0
    log = tempfile.NamedTemporaryFile(prefix="bench-infer-engine-", suffix=".log", delete=False)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "joynexus.ops.bench.inference", "--serve", url, "--namespace", ns_engine,
        "--size", rr_size, "--max-batch", str(max_batch), "--max-wait-ms", str(max_wait_ms),
        "--threads", str(serve_threads),
        stdout=log, stderr=subprocess.STDOUT,
    )
    out: dict[str, Any] = {}
    try:
        await wait_engine(b, proc)
        client = InferenceClient(b, base_model=base_model)
        warm_n = 64 if quick else 256
        # 2. RSS with one tenant, at the load shape used with eight (same batch sizes and rows)
        await closed_loop(client, schema, tenants[:1], 16, warm_n)
        rss_1 = rss_mb(proc.pid)
        for i in range(1, TENANTS):
            await store.publish(tenants[i], "default", mods[i], schema)
        await closed_loop(client, schema, tenants, 16, warm_n)
        rss_8 = rss_mb(proc.pid)
        extra_heads_mb = sum(
            p.numel() * p.element_size() for m in mods[1:] for p in m.head.parameters()
        ) / 2**20

        # 3. latency and throughput at rising load, 8 tenants
        levels = (1, 8, 32) if quick else (1, 4, 16, 32, 64)
        per_level = []
        for c in levels:
            n = max(30, 6 * c) if quick else max(200, 20 * c)
            per_level.append(await closed_loop(client, schema, tenants, c, n))
        # 4. concurrency 1 through the engine process vs the same requests in this process
        c1 = await _c1_gap(client, schema, tenants, mods, rr_size, 60 if quick else 200)
        # 5. request-reply overhead vs in-process (own namespace, engine in this process)
        overhead = await _overhead(solo, rr_size, 60 if quick else 200)

        out = {
            "group_speedup": group["group_speedup"],
            "group_speedup_ci95": group["group_speedup_ci95"],
            "inproc_p50_ms": overhead["inproc_p50_ms"],
            "rr_p50_ms": per_level[0]["p50_ms"],
            "rr_p99_ms": per_level[0]["p99_ms"],
            "rr_by_load": per_level,
            "c1_vs_inproc": c1,
            "rr_overhead_p50_ms": overhead["rr_overhead_p50_ms"],
            "rr_overhead_natspy_p50_ms": overhead["natspy_overhead_p50_ms"],
            # the broker's own round trip for the same bytes, and what the service adds to it
            "echo_p50_ms": overhead["echo_p50_ms"],
            "rr_overhead_over_echo_p50_ms": overhead["overhead_over_echo_p50_ms"],
            # ... and beyond the same round trip around the same work: the service's code alone
            "rr_overhead_over_echo_work_p50_ms": overhead["overhead_over_echo_work_p50_ms"],
            "rr_overhead": overhead,
            "throughput_rps": max(lv["throughput_rps"] for lv in per_level),
            "rss_mb": {
                "1_tenant": round(rss_1, 1),
                "8_tenants": round(rss_8, 1),
                "extra_7_tenants": round(rss_8 - rss_1, 2),
                "extra_7_heads_weights": round(extra_heads_mb, 2),
            },
            "config": {
                "quick": quick,
                "grid_backbone": grid_size,
                "rr_backbone": rr_size,
                "tenants": TENANTS,
                "engine_max_batch": max_batch,
                "engine_max_wait_ms": max_wait_ms,
                "head_hidden": HEAD_HIDDEN,
                "threads": threads,
                "serve_threads": serve_threads,
                "cpus": os.cpu_count(),
            },
            "group": {k: v for k, v in group.items() if k != "group_speedup"},
        }
    except BaseException:
        log.flush()
        text = await asyncio.to_thread(Path(log.name).read_text, errors="replace")
        sys.stderr.write("engine process log (tail):\n" + text[-4000:])
        raise
    finally:
        await stop_engine(proc, log)
        for br in (b, solo):
            with contextlib.suppress(Exception):
                await delete_layout(br)
            await br.close()
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    out["load"] = {"before": load_before, "after": stats.load()}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny backbone, small grid and loads (< 1 min)")
    ap.add_argument("--nats", default=None, help="NATS URL (default: an embedded nats-server)")
    # the engine child process (internal)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--namespace", default="jnx", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="tiny", help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--max-wait-ms", type=float, default=5.0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        serve_engine(a.serve, a.namespace, a.size, a.max_batch, a.max_wait_ms, a.threads)
        return
    print(json.dumps(asyncio.run(on_server(a.nats, bench_inference, quick=a.quick))))


if __name__ == "__main__":
    main()
