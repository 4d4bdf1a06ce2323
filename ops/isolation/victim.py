"""The victim, tenant ``bolt``: a small SFT workload it feeds itself, and a probe.

Whether a tenant was harmed is measured from its side: :class:`Victim` probes
the service with cheap calls (``get_workload``, ``list_workloads``,
``latest_version``, ``act``) whose latencies (:class:`Stats`) give p50/p99 for a
baseline window and for the window of an attack, and says whether its policy
version advanced meanwhile. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from joynexus.broker.tasks import cancel_and_wait
from joynexus.ops.isolation.deployment import (
    VICTIM,
    VICTIM_WORKLOAD,
    SecuredDeployment,
    sft_batch,
    sft_spec,
)
from joynexus.ops.isolation.kit import (
    short_error,
)
from joynexus.sdk import Client

#: Each probe call must answer within this (else it counts as failed).
CALL_TIMEOUT_S = 10.0
#: After an attack, how long the victim's training may take to show progress.
PROGRESS_GRACE_S = 30.0


@dataclass
class Stats:
    n: int = 0
    p50: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    errors: list[str] = field(default_factory=list)
    #: The victim's policy versions per second over the window (None: not known).
    train_rate: float | None = None
    #: The slowest probes: (call, seconds, when, in seconds from the window's start).
    slowest: list[tuple[str, float, float]] = field(default_factory=list)

    @classmethod
    def of(cls, xs: list[float], errors: list[str], train_rate: float | None = None,
           calls: list[tuple[str, float]] | None = None) -> Stats:
        """``calls``: each probe's (call, start offset), in the order of ``xs``."""
        if not xs:
            return cls(errors=errors, train_rate=train_rate)
        s = sorted(xs)
        slow = sorted(range(len(xs)), key=lambda i: -xs[i])[:3] if calls else []
        return cls(n=len(s), p50=statistics.median(s),
                   p99=s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)], max=s[-1],
                   errors=errors, train_rate=train_rate,
                   slowest=[(calls[i][0], xs[i], calls[i][1]) for i in slow] if calls else [])

    def brief(self) -> dict[str, Any]:
        return {"n": self.n, "p50_ms": round(self.p50 * 1000, 1),
                "p99_ms": round(self.p99 * 1000, 1), "errors": len(self.errors),
                "versions_per_s": None if self.train_rate is None else round(self.train_rate, 2)}


def rate(v0: int, v1: int, seconds: float) -> float | None:
    """Versions per second between two reads of the latest version (None if either failed)."""
    if v0 < 0 or v1 < 0 or seconds <= 0:
        return None
    return (v1 - v0) / seconds


class Victim:
    """Tenant ``bolt``: a small SFT workload it feeds itself, and a probe of cheap calls."""

    def __init__(self, dep: SecuredDeployment, tenant: str = VICTIM, workload: str = VICTIM_WORKLOAD):
        self.dep, self.tenant, self.workload = dep, tenant, workload
        self.client: Client = None  # type: ignore[assignment]
        self.feed_errors: list[str] = []
        self.submitted = 0
        self._feeder: asyncio.Task[None] | None = None

    async def start(self, *, within_s: float = 180.0) -> None:
        if self.tenant not in self.dep.creds:
            await self.dep.issue(self.tenant)
        self.client = await self.dep.client(self.tenant)
        ds = await self.dep.dataset(self.tenant)
        await self.client.create_workload(sft_spec(self.workload, ds))
        self._feeder = asyncio.create_task(self._feed())
        deadline = time.monotonic() + within_s
        while await self.client.latest_version(self.workload) < 2:  # one step trained
            if time.monotonic() > deadline:
                raise AssertionError(f"the victim's first job was not trained in {within_s}s "
                                     f"(feeder errors: {self.feed_errors[-3:]})")
            await asyncio.sleep(0.3)
        await self.act()  # the engine has loaded bolt's policy

    async def stop(self) -> None:
        if self._feeder is not None:
            await cancel_and_wait(self._feeder)

    async def _feed(self) -> None:
        seed = 1000
        while True:
            try:
                await self.client.submit_sft_batch(self.workload, sft_batch(4, seed))
                self.submitted += 1
                await asyncio.sleep(0.3)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.feed_errors.append(short_error(e))
                await asyncio.sleep(0.5)
            seed += 1

    async def act(self) -> np.ndarray:
        b = sft_batch(1, 0)
        return await self.client.act(self.workload, images={"base_camera": b[
            "obs_image_base_camera"]}, state=b["obs_state"], timeout_s=CALL_TIMEOUT_S)

    def _calls(self) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
        c, w = self.client, self.workload
        return [("get_workload", lambda: c.get_workload(w)), ("list_workloads", c.list_workloads),
                ("act", self.act), ("latest_version", lambda: c.latest_version(w))]

    async def _sample(self, stop: asyncio.Event, xs: list[float], errors: list[str],
                      who: list[tuple[str, float]] | None = None) -> None:
        calls = self._calls()
        i = 0
        start = time.perf_counter()
        while not stop.is_set():
            what, call = calls[i % len(calls)]
            i += 1
            t0 = time.perf_counter()
            if who is not None:
                who.append((what, t0 - start))
            try:
                await asyncio.wait_for(call(), CALL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                errors.append(f"{what}: {short_error(e)}")
            xs.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)

    async def version(self) -> int:
        try:
            return await asyncio.wait_for(self.client.latest_version(self.workload),
                                          CALL_TIMEOUT_S)
        except Exception:
            return -1

    async def baseline(self, seconds: float = 2.0) -> Stats:
        xs: list[float] = []
        errors: list[str] = []
        stop = asyncio.Event()
        v0, t0 = await self.version(), time.monotonic()
        task = asyncio.create_task(self._sample(stop, xs, errors))
        await asyncio.sleep(seconds)
        stop.set()
        await task
        return Stats.of(xs, errors, rate(v0, await self.version(), time.monotonic() - t0))

    async def during(
        self, attack: Awaitable[Any], *, min_s: float = 1.0
    ) -> tuple[Any, Stats, bool, float]:
        """Run ``attack`` while probing; (its result, the probe's stats, whether bolt's
        policy version advanced since the attack started, the attack's seconds)."""
        xs: list[float] = []
        errors: list[str] = []
        who: list[tuple[str, float]] = []
        v0 = await self.version()
        stop = asyncio.Event()
        t0 = time.monotonic()
        task = asyncio.create_task(self._sample(stop, xs, errors, who))
        try:
            result = await attack
            left = min_s - (time.monotonic() - t0)
            if left > 0:
                await asyncio.sleep(left)
        finally:
            stop.set()
            await task
        took = time.monotonic() - t0
        v1 = await self.version()
        train_rate = rate(v0, v1, time.monotonic() - t0)
        deadline = time.monotonic() + PROGRESS_GRACE_S
        progressed = False
        while True:
            v = await self.version()
            if v > v0 >= 0:
                progressed = True
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        return result, Stats.of(xs, errors, train_rate, who), progressed, round(took, 1)
