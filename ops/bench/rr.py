"""Where a request/reply round trip goes: interleaved (ABAB) arms, JSON out.

Two parts, each its arms alternating in one loop (order reversed every other
round, warm-up rounds dropped), every figure with its bootstrap 95% interval
and the machine's load before and after:

- ``echo``: a responder in its own process answers at once; the client asks
  with ``nc.request`` or :class:`joynexus.broker.fastpath.FastPath` (the
  responder answers with ``msg.respond`` or ``FastPath.respond``, on the same
  connection it listens on), with a 16-byte payload and with a real
  Inference Queue request's bytes (two 56x56 RGB images, state, instruction);
  ``small.bare_tcp``: the same 16 bytes echoed by the same process over a plain
  TCP socket (no broker: two processes wake, not three); ``real_held_6ms_outside``:
  the real request held 6 ms by the responder, as by a forward (round trip - hold).
- ``engine``: the real Inference Queue engine (``joynexus agent inference``'s
  code path, tiny backbone, B=1) in child processes that differ in one thing:
  torch intra-op threads 2 (the default here), 2 with ``OMP_WAIT_POLICY=PASSIVE``
  set before torch loads, or 1, all on nats-py's own request/respond
  (``JOYNEXUS_FASTPATH=0``), and ``fastpath``: 2 threads, the product's fast path on
  both sides. The client sends the same request to each in
  turn and records the round trip and the engine's own receipt-to-reply time
  (``timings.total_ms``); ``outside_ms`` = round trip - that: the two NATS legs,
  the client's codec and the engine's handler before receipt. ``gap_ms``
  between requests keeps one engine's spinning threads out of the next one's
  round.

    .venv/bin/python -m joynexus.ops.bench.rr [--part echo|engine|all] [--repeats N] [--nats URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from joynexus.broker.fastpath import ENV as FASTPATH_ENV
from joynexus.broker.fastpath import sync_server
from joynexus.ops.bench.engineload import real_request_payload, stop_engine
from joynexus.ops.bench.server import on_server
from joynexus.ops.measure import stats

__all__ = ["bench_rr", "main", "parse_arms"]

ECHO_SUBJECT = "bench.rr.echo"
HOLD_S = 0.006

#: name -> (torch threads, extra environment, fast path on both sides) of the engine processes compared.
ENGINE_ARMS: dict[str, tuple[int, dict[str, str], bool]] = {
    "threads2": (2, {}, False),
    "threads2_passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"}, False),
    "threads1": (1, {}, False),
    "fastpath": (2, {}, True),
}
#: The arms run by default. Each arm is a namespace with the whole layout, whose
#: stream limits JetStream reserves on disk (~9 GiB each): four of them beside a
#: deployment's own overran the embedded server's store here.
DEFAULT_ARMS = ("threads2", "fastpath", "threads1")


def _stats_of(ts: Mapping[str, Sequence[float]], base: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: stats.summarize(list(xs)) for name, xs in ts.items()}
    for name, xs in ts.items():
        if name == base:
            continue
        d, lo, hi = stats.difference_ci(list(xs), list(ts[base]))
        out[f"{name}_minus_{base}_p50_ms"] = [round(d, 3), round(lo, 3), round(hi, 3)]
    return out


async def _interleave(
    arms: Mapping[str, Callable[[], Awaitable[Any]]], repeats: int, warmup: int, gap_s: float
) -> dict[str, list[float]]:
    """``stats.interleaved_async`` with a pause after every call (outside the timing)."""
    names = tuple(arms)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        for n in names if r % 2 == 0 else tuple(reversed(names)):
            t0 = time.perf_counter()
            await arms[n]()
            dt = (time.perf_counter() - t0) * 1e3
            if r >= warmup:
                out[n].append(dt)
            if gap_s:
                await asyncio.sleep(gap_s)
    return out


# ---------------------------------------------------------------- echo


def _echo_server(url: str) -> None:
    """Body of the echo child: answer every request at once, two ways."""
    from joynexus.broker.connection import Broker
    from joynexus.broker.fastpath import FastPath

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        b = await Broker.connect(url, name="bench-rr-echo")  # $JOYNEXUS_CREDS, as every agent
        nc = b.nc
        fp = FastPath(nc)

        async def plain(msg: Any) -> None:
            await nc.publish(msg.reply, msg.data[:16])

        async def fast(msg: Any) -> None:
            await fp.respond(msg, msg.data[:16])

        async def hold(msg: Any) -> None:
            # as an engine's forward: answer after ~6 ms, saying how long it held the request
            t0 = time.perf_counter()
            await asyncio.sleep(HOLD_S)
            await nc.publish(msg.reply, f"{(time.perf_counter() - t0) * 1e3:.4f}".encode())

        async def hold_fast(msg: Any) -> None:
            t0 = time.perf_counter()
            await asyncio.sleep(HOLD_S)
            await fp.respond(msg, f"{(time.perf_counter() - t0) * 1e3:.4f}".encode())

        await nc.subscribe(ECHO_SUBJECT + ".plain", cb=plain)
        await nc.subscribe(ECHO_SUBJECT + ".fast", cb=fast)
        await nc.subscribe(ECHO_SUBJECT + ".hold", cb=hold)
        await nc.subscribe(ECHO_SUBJECT + ".holdfast", cb=hold_fast)
        # the same echo over a bare TCP socket, no broker between: what waking two
        # processes costs without nats-server's two wake-ups
        async def tcp(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while data := await r.read(65536):
                w.write(data[:16])

        tcp_server = await asyncio.start_server(tcp, "127.0.0.1", 0)
        await sync_server(nc)
        print(f"ready {tcp_server.sockets[0].getsockname()[1]}", flush=True)
        await stop.wait()
        tcp_server.close()
        await b.close()

    asyncio.run(run())


async def _echo(url: str, repeats: int, gap_s: float) -> dict[str, Any]:
    from joynexus.broker.connection import Broker
    from joynexus.broker.fastpath import FastPath

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "joynexus.ops.bench.rr", "--echo-server", url,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    client = await Broker.connect(url, name="bench-rr-client")
    nc = client.nc
    fp = FastPath(nc)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line.startswith(b"ready "):
            raise RuntimeError(f"echo server: {line!r}")
        tcp_r, tcp_w = await asyncio.open_connection("127.0.0.1", int(line.split()[1]))
        payloads = {"small": b"x" * 16, "real": real_request_payload()}
        out: dict[str, Any] = {"payload_bytes": {k: len(v) for k, v in payloads.items()}}
        for label, data in payloads.items():

            def arm(how: str, data: bytes = data) -> Callable[[], Awaitable[Any]]:
                if how == "nats":
                    return lambda: nc.request(ECHO_SUBJECT + ".plain", data, timeout=5)
                return lambda: fp.request(ECHO_SUBJECT + ".fast", data, timeout=5)

            arms = {"nats": arm("nats"), "fastpath": arm("fast")}
            if label == "small":

                async def bare_tcp() -> None:
                    tcp_w.write(b"x" * 16)
                    await tcp_r.readexactly(16)

                arms["bare_tcp"] = bare_tcp
            ts = await _interleave(arms, repeats, 20, gap_s)
            out[label] = _stats_of(ts, "nats")
        # the real request held ~6 ms by the responder, as by a forward: round trip - hold
        data = payloads["real"]
        held: dict[str, list[float]] = {"nats": [], "fastpath": []}

        def hold_arm(how: str) -> Callable[[], Awaitable[Any]]:
            async def one() -> None:
                if how == "nats":
                    m = await nc.request(ECHO_SUBJECT + ".hold", data, timeout=5)
                else:
                    m = await fp.request(ECHO_SUBJECT + ".holdfast", data, timeout=5)
                held[how].append(float(m.data))
            return one

        ts = await _interleave({"nats": hold_arm("nats"), "fastpath": hold_arm("fastpath")}, repeats, 20, gap_s)
        out["real_held_6ms_outside"] = _stats_of(
            {k: [rt - h for rt, h in zip(ts[k], held[k][20:], strict=True)] for k in ts}, "nats"
        )
        tcp_w.close()
        out["fastpath_counts"] = dict(fp.counts)
        out["fastpath_reason"] = fp.reason
        return out
    finally:
        await client.close()
        await stop_engine(proc, grace_s=10)


# ---------------------------------------------------------------- engine


def _serve_engine(url: str, namespace: str, threads: int) -> None:
    """Body of an engine child: ``bench_inference``'s engine (B=1, no wait); it
    answers through the fast path unless ``JOYNEXUS_FASTPATH=0`` (set per arm)."""
    from joynexus.ops.bench.engineload import serve_engine

    serve_engine(url, namespace, "tiny", 1, 0.0, threads)


async def _engine(url: str, repeats: int, gap_s: float, arms: Sequence[str]) -> dict[str, Any]:
    """The real engine in one child process per arm, asked in turn by one client."""
    from joynexus.agents.inference import InferenceClient
    from joynexus.agents.models.backbone_config import SIZES
    from joynexus.agents.models.policyio import PolicyStore
    from joynexus.broker.connection import Broker
    from joynexus.broker.layout import delete_layout, ensure_layout
    from joynexus.ops.bench.engineload import sample_module, sample_obs, sample_schema, wait_engine

    suffix = os.urandom(3).hex()
    feature_dim = int(SIZES["tiny"]["text"]["hidden_size"])
    schema = sample_schema("qwen2.5-vl-tiny")
    mod = sample_module("t0", 0, feature_dim)
    obs = sample_obs(0)
    brokers: dict[str, Any] = {}
    procs: dict[str, asyncio.subprocess.Process] = {}
    logs: dict[str, Any] = {}
    try:
        for i, arm in enumerate(arms):
            threads, extra, fast = ENGINE_ARMS[arm]
            ns = f"rr{i}{suffix}"
            b = await Broker.connect(url, name=f"bench-rr-{arm}", namespace=ns)
            brokers[arm] = b
            await ensure_layout(b)
            await PolicyStore(b).publish("t0", "default", mod, schema)
            logs[arm] = tempfile.NamedTemporaryFile(prefix=f"bench-rr-{arm}-", suffix=".log", delete=False)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
            env.update(extra)
            env[FASTPATH_ENV] = "1" if fast else "0"
            procs[arm] = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "joynexus.ops.bench.rr", "--serve", url, "--namespace", ns,
                "--threads", str(threads),
                stdout=logs[arm], stderr=subprocess.STDOUT, env=env,
            )
        for arm in arms:
            await wait_engine(brokers[arm], procs[arm])
        clients = {
            arm: InferenceClient(brokers[arm], base_model="qwen2.5-vl-tiny", fast=ENGINE_ARMS[arm][2])
            for arm in arms
        }
        inside: dict[str, list[float]] = {arm: [] for arm in arms}
        warmup = 20

        def ask(arm: str) -> Callable[[], Awaitable[Any]]:
            async def one() -> None:
                r = await clients[arm].request("t0", schema=schema, timeout_s=30, **obs)
                inside[arm].append(r.timings.total_ms)
            return one

        ts = await _interleave({arm: ask(arm) for arm in arms}, repeats, warmup, gap_s)
        # the engine's receipt-to-reply time of the counted rounds (warm-up dropped)
        outside = {arm: [rr - t for rr, t in zip(ts[arm], inside[arm][warmup:], strict=True)] for arm in arms}
        return {
            "round_trip": _stats_of(ts, arms[0]),
            "engine_total": _stats_of({a: inside[a][warmup:] for a in arms}, arms[0]),
            "outside": _stats_of(outside, arms[0]),
            "arms": {a: {"threads": ENGINE_ARMS[a][0], "env": ENGINE_ARMS[a][1], "fastpath": ENGINE_ARMS[a][2]}
                     for a in arms},
        }
    except BaseException:
        for arm, f in logs.items():
            f.flush()
            text = await asyncio.to_thread(Path(f.name).read_text, errors="replace")
            sys.stderr.write(f"{arm} engine log (tail):\n" + text[-2000:])
        raise
    finally:
        # every engine signalled at once (each call sends SIGTERM before it waits)
        await asyncio.gather(*(stop_engine(p, logs.pop(arm, None)) for arm, p in procs.items()))
        for f in logs.values():  # an arm whose process never started
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(f.name)
        for b in brokers.values():
            with contextlib.suppress(Exception):
                await delete_layout(b)
            await b.close()


# ---------------------------------------------------------------- the benchmark


async def bench_rr(
    url: str, *, part: str = "all", repeats: int = 200, gap_ms: float = 20.0,
    arms: Sequence[str] = DEFAULT_ARMS,
) -> dict[str, Any]:
    """Run the chosen parts against the NATS server at ``url``; returns the figures (JSON-ready)."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {"load": {"before": stats.load()}}
    if part in ("echo", "all"):
        out["echo"] = await _echo(url, repeats, gap_ms / 1e3)
    if part in ("engine", "all"):
        out["engine"] = await _engine(url, repeats, gap_ms / 1e3, arms)
    out["load"]["after"] = stats.load()
    out["config"] = {"repeats": repeats, "gap_ms": gap_ms, "cpus": os.cpu_count()}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def parse_arms(text: str) -> tuple[str, ...]:
    """``--arms``: known engine arm names, comma-separated (ValueError otherwise)."""
    arms = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in arms if x not in ENGINE_ARMS]
    if bad or not arms or len(set(arms)) != len(arms):
        raise ValueError(f"--arms: {bad or 'none or repeated'}; choose from {', '.join(ENGINE_ARMS)}")
    return arms


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--part", choices=("echo", "engine", "all"), default="all")
    ap.add_argument("--repeats", type=int, default=200, help="counted rounds per part (default 200)")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause after every request (default 20)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"engine arms, comma-separated, the first is the base (of {', '.join(ENGINE_ARMS)})")
    ap.add_argument("--nats", default=None, help="NATS URL (default: an embedded nats-server)")
    ap.add_argument("--echo-server", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--namespace", default="jnx", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        _serve_engine(a.serve, a.namespace, a.threads)
        return
    if a.echo_server:
        _echo_server(a.echo_server)
        return
    try:
        arms = parse_arms(a.arms)
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(asyncio.run(on_server(a.nats, bench_rr, part=a.part, repeats=a.repeats, gap_ms=a.gap_ms,
                                              arms=arms))))


if __name__ == "__main__":
    main()
