"""What happens to a message whose handling failed: the one place that decides.

Like Temporal's ``non_retryable`` or arq's ``Retry(defer=)``: the error's
class decides whether the message is retried later (nak with a delay),
dropped (term), or acknowledged because the work is moot, and whether the
job itself must be failed. No other module wraps calls in retry loops for
message handling; JetStream's max_deliver bounds redeliveries.

See docs/ARCHITECTURE.md, "Stage workers and failures".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from joynexus.schemas.errors import (
    Conflict,
    IllegalTransition,
    InvalidMessage,
    JoyNexusError,
    StaleLease,
    UnknownJob,
)


class MessageAction(Enum):
    ACK = "ack"  # done, or nothing left to do
    NAK = "nak"  # retry after ``delay_s``
    TERM = "term"  # never redeliver


@dataclass(frozen=True)
class Disposition:
    action: MessageAction
    delay_s: float = 0.0
    #: Fail the job with this reason ("" = leave the job alone).
    fail_reason: str = ""


def backoff_s(num_delivered: int, *, base: float = 0.5, cap: float = 15.0) -> float:
    return min(cap, base * 2 ** max(0, num_delivered - 1))


def decide(error: BaseException | None, *, num_delivered: int, max_deliver: int) -> Disposition:
    """Disposition of a job-event message after handling raised ``error`` (None: success)."""
    if error is None:
        return Disposition(MessageAction.ACK)
    if isinstance(error, InvalidMessage):
        return Disposition(MessageAction.TERM)  # garbage does not improve with retries
    if isinstance(error, (IllegalTransition, UnknownJob, StaleLease)):
        return Disposition(MessageAction.TERM)  # the job moved on (done, dropped, re-leased)
    if isinstance(error, Conflict):
        # Another worker holds the stage lease; look again once it may have expired.
        return Disposition(MessageAction.NAK, delay_s=backoff_s(num_delivered, base=1.0))
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, JoyNexusError) and error.permanent:
        return Disposition(MessageAction.TERM, fail_reason=reason)
    if num_delivered >= max_deliver:
        return Disposition(
            MessageAction.TERM,
            fail_reason=f"gave up after {num_delivered} deliveries; last error {reason}",
        )
    return Disposition(MessageAction.NAK, delay_s=backoff_s(num_delivered))
