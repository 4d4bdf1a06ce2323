"""broker/disposition.py as a table: the error a handler raised (and how often
the message was delivered) -> ack, nak after a delay, or term, and whether the
job is failed. Pure: no server."""

from __future__ import annotations

import pytest

from joynexus.broker.disposition import Disposition, MessageAction, backoff_s, decide
from joynexus.schemas.errors import (
    Conflict,
    IllegalTransition,
    IncompatibleSchema,
    InvalidMessage,
    InvalidSpec,
    QuotaExceeded,
    RateLimited,
    SchemaVersionError,
    StaleLease,
    Timeout,
    Unavailable,
    UnknownJob,
    UnknownPartition,
)

ACK, NAK, TERM = MessageAction.ACK, MessageAction.NAK, MessageAction.TERM


@pytest.mark.parametrize(
    ("error", "delivered", "want"),
    [
        # success
        (None, 1, Disposition(ACK)),
        (None, 99, Disposition(ACK)),
        # garbage never improves, and is not the job's fault
        (InvalidMessage("bad"), 1, Disposition(TERM)),
        (SchemaVersionError("v9"), 1, Disposition(TERM)),
        # the job moved on: nothing to fail
        (IllegalTransition("done"), 1, Disposition(TERM)),
        (UnknownJob("gone"), 3, Disposition(TERM)),
        (StaleLease("re-leased"), 1, Disposition(TERM)),
        # another worker holds the stage lease: look again later, never give up
        (Conflict("held"), 1, Disposition(NAK, delay_s=1.0)),
        (Conflict("held"), 3, Disposition(NAK, delay_s=4.0)),
        (Conflict("held"), 50, Disposition(NAK, delay_s=15.0)),
        # permanent errors fail the job at once
        (InvalidSpec("no"), 1, Disposition(TERM, fail_reason="InvalidSpec: no")),
        (IncompatibleSchema("dims"), 1, Disposition(TERM, fail_reason="IncompatibleSchema: dims")),
        (UnknownPartition("p"), 1, Disposition(TERM, fail_reason="UnknownPartition: p")),
        (QuotaExceeded("q"), 1, Disposition(TERM, fail_reason="QuotaExceeded: q")),
        # transient errors retry with backoff until max_deliver
        (Unavailable("down"), 1, Disposition(NAK, delay_s=0.5)),
        (Unavailable("down"), 2, Disposition(NAK, delay_s=1.0)),
        (Timeout("slow"), 4, Disposition(NAK, delay_s=4.0)),
        (RateLimited("busy"), 1, Disposition(NAK, delay_s=0.5)),
        (RuntimeError("bug"), 1, Disposition(NAK, delay_s=0.5)),
        (OSError("disk"), 4, Disposition(NAK, delay_s=4.0)),
        (
            Unavailable("down"), 5,
            Disposition(TERM, fail_reason="gave up after 5 deliveries; last error Unavailable: down"),
        ),
        (
            RuntimeError("bug"), 7,
            Disposition(TERM, fail_reason="gave up after 7 deliveries; last error RuntimeError: bug"),
        ),
    ],
)
def test_decide(error: BaseException | None, delivered: int, want: Disposition) -> None:
    assert decide(error, num_delivered=delivered, max_deliver=5) == want


@pytest.mark.parametrize(
    ("delivered", "kwargs", "delay"),
    [
        (0, {}, 0.5),  # a first delivery reported as 0 waits like the first
        (1, {}, 0.5),
        (2, {}, 1.0),
        (5, {}, 8.0),
        (6, {}, 15.0),  # capped
        (1000, {}, 15.0),
        (1, {"base": 1.0}, 1.0),
        (3, {"base": 1.0, "cap": 3.0}, 3.0),
    ],
)
def test_backoff(delivered: int, kwargs: dict[str, float], delay: float) -> None:
    assert backoff_s(delivered, **kwargs) == delay


def test_a_conflict_is_never_given_up_and_success_is_acked_past_max_deliver() -> None:
    assert decide(Conflict("held"), num_delivered=10, max_deliver=5).action is NAK
    assert decide(None, num_delivered=10, max_deliver=5).action is ACK
    # a permanent error fails the job on the first delivery as on the last
    for n in (1, 5, 10):
        assert decide(InvalidSpec("x"), num_delivered=n, max_deliver=5).fail_reason
