"""Request/reply, the asking side: :func:`call`, :class:`RetryPolicy` and the
policies each client uses, and :func:`checked` (an error reply raised as its
typed error). The serving side (:class:`joynexus.broker.responder.Server`: who
may be answered, how many requests at once, the span, the error body, the reply)
is in broker/responder.py.

Every client of the service (the scheduler's, the inference queue's, the SDK,
the operator's tenant commands) asks through :func:`call`, and every request
server (the scheduler, the control plane's tenant and operator APIs, the
inference engines) answers through a ``Server``. See docs/ARCHITECTURE.md
("Request/reply: one layer").

The transport is a seam: :func:`call` sends with ``nc.request`` unless a faster
raw request (same signature) is passed in (``request=``: the Inference Queue's
client passes its connection's fast path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from nats.errors import MaxPayloadError, NoRespondersError

from joynexus.broker.connection import Broker
from joynexus.schemas.base import decode
from joynexus.schemas.errors import (
    JoyNexusError,
    PayloadTooLarge,
    RateLimited,
    Unavailable,
    error_from_code,
)

R = TypeVar("R")

#: ``nc.request``'s shape: ``(subject, payload, *, timeout, headers) -> Msg`` (``.data``).
RawRequest = Callable[..., Awaitable[Any]]


class NoResponders(Unavailable):
    """Nobody serves the subject (the server's no-responders status)."""


class NoReply(Unavailable):
    """A request got no reply within its timeout."""


@dataclass(frozen=True)
class RetryPolicy:
    """When :func:`call` asks again, as data. A failure whose error is one of
    ``retry_on`` (the typed error of a reply, or :class:`NoResponders` /
    :class:`NoReply` for no answer) is tried again after a backoff of ``base_s``,
    times ``factor`` each time, at most ``cap_s``, while fewer than ``attempts``
    tries were made (0: no bound) and ``deadline_s`` after the call began has not
    passed (0: no deadline; the last sleep is cut to the deadline). Anything else
    is raised at once."""

    name: str
    attempts: int = 1
    deadline_s: float = 0.0
    base_s: float = 0.05
    cap_s: float = 1.0
    factor: float = 2.0
    retry_on: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.deadline_s < 0 or self.base_s < 0 or self.cap_s < 0:
            raise ValueError(f"retry policy {self.name}: negative bound")
        if self.attempts == 0 and self.deadline_s == 0 and self.retry_on:
            raise ValueError(f"retry policy {self.name}: neither attempts nor a deadline bound it")

    def within(self, extra_s: float) -> RetryPolicy:
        """The same policy with a deadline ``extra_s`` longer (a long poll's wait)."""
        if extra_s <= 0 or not self.deadline_s:
            return self
        return replace(self, deadline_s=self.deadline_s + extra_s)


#: Fail at once.
ONCE = RetryPolicy("once")
#: The scheduler's verbs are idempotent: a call that got no answer (the scheduler
#: restarting, its lease moving to another host) or found it saturated is asked
#: again until 60 s have passed; backoff 50 ms doubling to 1 s.
SCHEDULER = RetryPolicy("scheduler", attempts=0, deadline_s=60.0, base_s=0.05, cap_s=1.0,
                        retry_on=(NoResponders, NoReply, RateLimited))
#: Inference is idempotent: no engine, a request an engine dropped (it died mid
#: batch) or an overloaded engine is asked again, here for 10 s (the client's
#: ``retry_for_s`` sets it: :func:`inference_policy`); backoff 100 ms doubling to 2 s.
INFERENCE = RetryPolicy("inference", attempts=0, deadline_s=10.0, base_s=0.1, cap_s=2.0,
                        retry_on=(Unavailable,))
#: A tenant's control plane call: a ``rate_limited`` answer (too many of its
#: requests in flight) is asked again 5 times, backoff 50 ms doubling.
TENANT_API = RetryPolicy("tenant_api", attempts=6, base_s=0.05, cap_s=0.8,
                         retry_on=(RateLimited,))
#: An operator's request: no responders (a deployment still starting, the control
#: role restarting) is asked again every second for 60 s; nobody got the request,
#: so asking again cannot do it twice. A timeout is not retried.
OPERATOR = RetryPolicy("operator", attempts=0, deadline_s=60.0, base_s=1.0, cap_s=1.0,
                       factor=1.0, retry_on=(NoResponders,))


def inference_policy(retry_for_s: float) -> RetryPolicy:
    """:data:`INFERENCE` for ``retry_for_s`` (0: fail at once)."""
    return replace(INFERENCE, deadline_s=retry_for_s) if retry_for_s > 0 else ONCE


async def call(
    b: Broker,
    subject: str,
    payload: bytes,
    decode: Callable[[bytes], R],
    *,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    retry: RetryPolicy = ONCE,
    request: RawRequest | None = None,
    unanswered: Callable[[Unavailable], BaseException] | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> R:
    """Ask ``subject`` and return ``decode(reply.data)``, which raises the typed error
    of an error reply (:func:`checked`). No responders and no reply within
    ``timeout_s`` become :class:`NoResponders` and :class:`NoReply`, a payload over
    the server's ``max_payload`` :class:`PayloadTooLarge` (at once); ``retry`` says
    which failures are asked again; ``unanswered`` words the error raised when
    no answer came (else the NoResponders / NoReply itself); ``on_retry(error,
    sleep_s)`` is told before each backoff."""
    send = request or b.nc.request
    deadline = 0.0
    if retry.deadline_s:
        deadline = asyncio.get_running_loop().time() + retry.deadline_s
    tries = 0
    delay = retry.base_s
    while True:
        tries += 1
        try:
            msg = await send(subject, payload, timeout=timeout_s, headers=headers)
            return decode(msg.data)
        except NoRespondersError as e:
            err: BaseException = NoResponders(f"nobody serves {subject}")
            err.__cause__ = e
        except MaxPayloadError as e:  # never sent: asking again cannot help
            raise PayloadTooLarge(
                f"a request of {len(payload)} bytes; the NATS server takes at most "
                f"{b.max_payload} in one message: send less in one call (fewer rows)"
            ) from e
        except JoyNexusError as e:  # before TimeoutError: the typed Timeout of a reply is one
            err = e
        except TimeoutError as e:  # nats-py's timeout is asyncio's, the builtin in 3.11
            err = NoReply(f"no reply on {subject} within {timeout_s:g}s")
            err.__cause__ = e
        if not isinstance(err, retry.retry_on) or (retry.attempts and tries >= retry.attempts):
            raise _final(err, unanswered)
        sleep = delay
        if deadline:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise _final(err, unanswered)
            sleep = min(delay, remaining)
        if on_retry is not None:
            on_retry(err, sleep)
        await asyncio.sleep(sleep)
        delay = min(delay * retry.factor, retry.cap_s)


def _final(err: BaseException, unanswered: Callable[[Unavailable], BaseException] | None) -> BaseException:
    if unanswered is not None and isinstance(err, (NoResponders, NoReply)):
        final = unanswered(err)
        final.__cause__ = err.__cause__
        return final
    return err


def checked(reply_type: type[R], what: str) -> Callable[[bytes], R]:
    """A decoder of a JSON reply whose ``error`` field (an :class:`ErrorBody`-like
    ``code`` and ``message``) is raised as its typed error."""

    def decode_checked(data: bytes) -> R:
        reply = decode(data, reply_type, what=what)
        error = getattr(reply, "error", None)
        if error is not None:
            raise error_from_code(error.code, error.message)
        return reply

    return decode_checked
