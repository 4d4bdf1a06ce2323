"""The control plane's door count: each tenant's messages a second, and who is paused.

A tenant that publishes as fast as it can and never reads its replies stalls the
control plane: every message crosses its one connection and is parsed in Python,
and NATS has no per-user publish rate. So the door counts each tenant's messages
in one-second windows (a dict update per message, before any parsing); past the
tenant's ``max_requests_per_s`` the tenant is paused: the control plane drops its
messages unanswered from then on and writes a ``Penalty`` record, which the auth
sync of every server turns into the tenant's user being taken off the server for
the pause (ops/runtime/penaltybox.py). Then the server drops the flood, and the
other tenants' requests stop queueing behind it. A pause that ends with the flood
still going earns the next a doubled length, up to 16x.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MAX_STRIKES", "DoorCount", "IngressPace"]

#: Pauses in a row double up to 2^(MAX_STRIKES - 1) times ``penalty_s``.
MAX_STRIKES = 5
#: A tenant quiet (no pause) for this many pause lengths starts again at one strike.
FORGIVE_AFTER = 4.0


@dataclass
class _Tenant:
    window: int = -1
    count: int = 0
    paused_until: float = 0.0
    strikes: int = 0
    last_pause_s: float = 0.0


@dataclass
class DoorCount:
    """Pure bookkeeping (no I/O): the clock is passed in."""

    tenants: dict[str, _Tenant] = field(default_factory=dict)

    def paused(self, tenant: str, now: float) -> bool:
        t = self.tenants.get(tenant)
        return t is not None and now < t.paused_until

    def hit(self, tenant: str, now: float, limit: int, penalty_s: float) -> tuple[float, int, int] | None:
        """Count one message of ``tenant`` at ``now``. None, or ``(until, rate, strikes)``
        the first time its count this second passes ``limit`` (0: no limit): it is
        paused until ``until`` from now on."""
        if limit <= 0:
            return None
        t = self.tenants.get(tenant)
        if t is None:
            if len(self.tenants) > 100_000:  # bounded: forget the quiet ones
                self.tenants = {k: v for k, v in self.tenants.items() if v.paused_until > now}
            t = self.tenants[tenant] = _Tenant()
        window = int(now)
        if window != t.window:
            t.window, t.count = window, 0
        t.count += 1
        if t.count <= limit or now < t.paused_until:
            return None
        quiet = now - t.paused_until
        t.strikes = 1 if quiet > FORGIVE_AFTER * max(t.last_pause_s, penalty_s) else min(t.strikes + 1, MAX_STRIKES)
        t.last_pause_s = penalty_s * 2 ** (t.strikes - 1)
        t.paused_until = now + t.last_pause_s
        return t.paused_until, t.count, t.strikes


@dataclass
class IngressPace:
    """Each tenant's Training Queue bytes paced to its ``tq_bytes_per_s``: a token
    bucket holding at most one second's bytes. ``delay`` reserves a put's bytes and
    says how long to wait before storing them (0: at once). A push of a whole quota
    at once (the stream persists every byte) is spread over seconds, so the other
    tenants' calls do not all land in the same moment of storage work; the wait
    holds only the pushing tenant's own working slots."""

    tenants: dict[str, tuple[float, float]] = field(default_factory=dict)

    def delay(self, tenant: str, size: int, now: float, rate: int) -> float:
        if rate <= 0:
            return 0.0
        tokens, last = self.tenants.get(tenant, (float(rate), now))
        tokens = min(float(rate), tokens + (now - last) * rate) - size
        self.tenants[tenant] = (tokens, now)
        return 0.0 if tokens >= 0 else -tokens / rate
