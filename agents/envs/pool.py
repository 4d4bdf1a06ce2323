"""A worker's built environments, kept between workloads (:class:`EnvPool`).

Building a workload's envs costs 1-3 s for ManiSkill and 2-8 s for LIBERO here
(scene, assets, renderer contexts), paid at the start of every workload however
short it is. A worker keeps the envs of the workloads it served, idle, and gives
one back to the next workload that asks for the same build (same env, obs mode,
number of envs, image size, cameras, state keys, control mode): every rollout
resets each env with its own seed first (``rollout(env, ..., seed=)``), so no
state of the previous workload, another tenant's included, reaches the next one.
The seed a build was made with is not part of the key for that reason.

Bounded: at most ``capacity`` idle envs (``$JOYNEXUS_ENV_POOL``, default 2; 0
turns pooling off), the least recently used closed first; an env whose workload
ended with an error is closed, not kept; a workload that finds no idle env of
its build closes the idle ones of its env name (another build) before it builds
its own. The worker's warm-up env is kept here too, built as a workload with the
default settings builds it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

POOL_ENV = "JOYNEXUS_ENV_POOL"
DEFAULT_CAPACITY = 2

#: What a build is keyed by: the ``make_env`` arguments but the seed.
BuildKey = tuple[str, str, int, int, tuple[str, ...] | None, tuple[str, ...] | None, str | None]


def build_key(
    name: str,
    *,
    obs: str,
    num_envs: int,
    image_size: int,
    cameras: Sequence[str] | None = None,
    state_keys: Sequence[str] | None = None,
    control_mode: str | None = None,
) -> BuildKey:
    return (
        name,
        obs,
        int(num_envs),
        int(image_size),
        tuple(cameras) if cameras is not None else None,
        tuple(state_keys) if state_keys is not None else None,
        control_mode,
    )


def pool_capacity(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    raw = environ.get(POOL_ENV, "").strip()
    if not raw:
        return DEFAULT_CAPACITY
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"${POOL_ENV}={raw!r}: give a whole number of idle envs (0: none)") from None
    if n < 0:
        raise ValueError(f"${POOL_ENV}={raw!r}: give 0 or more")
    return n


class EnvPool:
    """Idle built envs by :func:`build_key`, at most ``capacity``, LRU."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = pool_capacity() if capacity is None else max(0, capacity)
        self._idle: OrderedDict[BuildKey, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._idle)

    def names(self) -> list[str]:
        """The env names idle here (what the supervisor's assignment prefers)."""
        return sorted({k[0] for k in self._idle})

    def take(self, key: BuildKey) -> Any | None:
        """The idle env built as ``key`` (now the caller's), or None."""
        env = self._idle.pop(key, None)
        if env is None:
            self.misses += 1
        else:
            self.hits += 1
        return env

    async def give(self, key: BuildKey, env: Any) -> None:
        """Keep ``env`` idle for the next build of ``key``; close what no longer fits."""
        old = self._idle.pop(key, None)
        self._idle[key] = env
        closing = [old] if old is not None else []
        while len(self._idle) > self.capacity:
            closing.append(self._idle.popitem(last=False)[1])
        for e in closing:
            await close_env(e)

    async def evict(self, name: str) -> int:
        """Close the idle envs of env ``name`` (any build): a workload about to build
        ``name`` another way would otherwise hold both. How many were closed."""
        keys = [k for k in self._idle if k[0] == name]
        for k in keys:
            await close_env(self._idle.pop(k))
        return len(keys)

    async def close(self) -> None:
        while self._idle:
            await close_env(self._idle.popitem(last=False)[1])


async def close_env(env: Any) -> None:
    try:
        await asyncio.to_thread(env.close)
    except Exception as e:  # a broken env is dropped either way
        log.warning("closing an env failed: %r", e)
