"""Batched direct gets: read the messages of a subject filter from a stream
sequence on, without creating a consumer (no server-side state to leak).

The Training Queue reads its index and claim records this way, and the
control plane pages a tenant's job events for the SDK.
See docs/ARCHITECTURE.md, "Tenants fenced by the broker" (``read_events``).
"""

from __future__ import annotations

import json

from joynexus.broker.connection import Broker
from joynexus.broker.headers import NUM_PENDING, SEQUENCE
from joynexus.broker.natsapi import JS_API
from joynexus.schemas.errors import Unavailable

#: Records per direct-get round trip.
READ_BATCH = 1000
REQUEST_TIMEOUT_S = 10.0


async def read_subject(
    b: Broker,
    stream: str,
    subject: str,
    start_seq: int,
    *,
    limit: int | None = None,
    batch: int = READ_BATCH,
) -> tuple[list[tuple[int, bytes]], int]:
    """Messages on ``subject`` (wildcards allowed) from ``start_seq`` on, at most
    ``limit``: ``([(stream seq, payload), ...], last seq seen)``, one round trip
    per ``batch`` records. The last seq is ``start_seq - 1`` when none was found."""
    nc = b.nc
    prefix = getattr(b.js, "_prefix", JS_API)
    api = b.names.direct_get(stream, prefix)
    items: list[tuple[int, bytes]] = []
    last = start_seq - 1
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        while limit is None or len(items) < limit:
            want = batch if limit is None else min(batch, limit - len(items))
            req = json.dumps({"seq": last + 1, "next_by_subj": subject, "batch": want}).encode()
            await nc.publish(api, req, reply=inbox)
            more = False
            while True:
                try:
                    msg = await sub.next_msg(timeout=REQUEST_TIMEOUT_S)
                except TimeoutError as e:
                    raise Unavailable(f"reading {subject} from {stream} timed out") from e
                hdrs = msg.headers or {}
                status = hdrs.get("Status")
                if status == "404":
                    break
                if status == "204":  # end of batch: more may remain
                    more = int(hdrs.get(NUM_PENDING, "0")) > 0
                    break
                if status is not None:
                    raise Unavailable(
                        f"direct get on {stream} failed: {status} {hdrs.get('Description', '')}"
                    )
                seq = int(hdrs[SEQUENCE])
                items.append((seq, msg.data))
                last = seq
            if not more:
                break
    finally:
        await sub.unsubscribe()
    return items, max(last, start_seq - 1, 0)


async def last_seq_of(b: Broker, stream: str, subject: str) -> int:
    """The stream sequence of the last message on ``subject`` (wildcards allowed),
    0 if there is none: a position of that subject's own, which says nothing of
    the rest of the stream (the control plane's ``read_events`` "from now on")."""
    prefix = getattr(b.js, "_prefix", JS_API)
    try:
        msg = await b.nc.request(
            b.names.direct_get(stream, prefix), json.dumps({"last_by_subj": subject}).encode(),
            timeout=REQUEST_TIMEOUT_S,
        )
    except TimeoutError as e:
        raise Unavailable(f"reading the last of {subject} from {stream} timed out") from e
    hdrs = msg.headers or {}
    if hdrs.get("Status") == "404":
        return 0
    if hdrs.get("Status") is not None:
        raise Unavailable(f"direct get on {stream} failed: {hdrs.get('Status')} {hdrs.get('Description', '')}")
    return int(hdrs[SEQUENCE])
