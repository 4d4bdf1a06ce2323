"""Every NATS / JetStream header name the code base writes or reads (as nats.py
keeps them in ``nats.js.api.Header``). Nothing else writes a ``Nats-`` string;
tests/unit/test_names.py checks it. See docs/ARCHITECTURE.md, "Layout and import root"."""

from __future__ import annotations

#: Compare-and-append: the sequence the subject's last message must have ...
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
#: ... counted over the subjects this filter matches (instead of the subject itself).
EXPECTED_LAST_SUBJECT_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
#: Deduplication id of a publish (within the stream's duplicate window).
MSG_ID = "Nats-Msg-Id"
#: Per-message TTL (``"<n>s"``) on a stream that allows it.
TTL = "Nats-TTL"
#: Direct get replies: the message's stream sequence and how many more a batch has.
SEQUENCE = "Nats-Sequence"
NUM_PENDING = "Nats-Num-Pending"
#: Micro-service error replies (the NATS services convention).
SERVICE_ERROR = "Nats-Service-Error"
SERVICE_ERROR_CODE = "Nats-Service-Error-Code"

