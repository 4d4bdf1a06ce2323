"""How often two nats-py races strike, with and without this code base's guard.

Each part alternates its two arms round by round (order flipped every round) on
one server, and counts the rounds the race struck:

- ``kv_marker``: a watch of a bucket of ``keys`` keys. nats-py's watcher
  (``kv.watchall()``) sends its end-of-current-values marker before all the
  values now and then (nats-io/nats.py#842); ``broker.kvwatch.watch`` does not.
  Struck: the marker came before every key was seen.
- ``join``: a micro service is added, then asked at once from another
  connection. One ``nc.flush()`` lets its PING overtake the SUBs still in
  nats-py's buffer; ``fastpath.sync_server`` does not. Struck: no responders.

The counts are small (a few in a thousand on a 2-core VM), so the JSON gives
each with the rounds it came from; compare arms of one run only.

    .venv/bin/joynexus bench races --json [--rounds N]
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.micro import add_service

from joynexus.broker import kvwatch
from joynexus.broker.connection import Broker
from joynexus.broker.fastpath import sync_server
from joynexus.ops.measure.stats import load, round_order


async def _count(
    arms: dict[str, Callable[[int], Awaitable[bool]]], rounds: int
) -> dict[str, dict[str, int]]:
    names = tuple(arms)
    struck = dict.fromkeys(names, 0)
    for r in range(rounds):
        for name in round_order(names, r):
            struck[name] += bool(await arms[name](r))
    return {n: {"struck": struck[n], "rounds": rounds} for n in names}


async def _kv_marker(url: str, rounds: int, n_keys: int) -> dict[str, Any]:
    b = await Broker.connect(url, name="bench-races-kv")
    bucket = f"BENCH_RACES_{uuid.uuid4().hex[:8].upper()}"
    js = b.js
    try:
        kv = await js.create_key_value(bucket=bucket, history=2)
        for i in range(n_keys):
            await kv.put(f"k{i}", b"x" * 200)

        async def marker_early(watcher: Any) -> bool:
            seen = 0
            try:
                while await watcher.updates(timeout=10) is not None:
                    seen += 1
            finally:
                await watcher.stop()
            return seen < n_keys

        async def nats_py(_r: int) -> bool:
            return await marker_early(await kv.watchall())

        async def guarded(_r: int) -> bool:
            return await marker_early(await kvwatch.watch(kv))

        out = await _count({"nats_py_watch": nats_py, "kvwatch": guarded}, rounds)
        return {"keys": n_keys, **out}
    finally:
        try:
            await js.delete_key_value(bucket)
        finally:
            await b.close()


async def _join(url: str, rounds: int) -> dict[str, Any]:
    serve = await Broker.connect(url, name="bench-races-serve")
    ask = await Broker.connect(url, name="bench-races-ask")
    serving, asking = serve.nc, ask.nc
    prefix = f"bench.races.{uuid.uuid4().hex[:8]}"

    async def answer(req: Any) -> None:
        await req.respond(b"ok")

    async def ask_at_once(r: int, ready: Callable[[Any], Awaitable[None]]) -> bool:
        svc = await add_service(serving, name="bench-races", version="0.1.0", queue_group="q")
        try:
            await svc.add_endpoint(name="ep", subject=f"{prefix}.{r}", handler=answer)
            await ready(serving)
            try:
                await asking.request(f"{prefix}.{r}", b"", timeout=5)
            except nats.errors.NoRespondersError:
                return True
            return False
        finally:
            await svc.stop()

    async def one_flush(nc: Any) -> None:
        await nc.flush()

    async def flush(r: int) -> bool:
        return await ask_at_once(r, one_flush)

    async def settled(r: int) -> bool:
        return await ask_at_once(r, sync_server)

    try:
        return await _count({"one_flush": flush, "sync_server": settled}, rounds)
    finally:
        await serve.close()
        await ask.close()


async def bench_races(url: str, *, rounds: int = 500, keys: int = 100) -> dict[str, Any]:
    before = load()
    kv = await _kv_marker(url, rounds, keys)
    join = await _join(url, rounds)
    return {"kv_marker": kv, "join": join, "load": {"before": before, "after": load()}}
