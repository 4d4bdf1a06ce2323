"""JetStream API error codes the code base decides on (``APIError.err_code``), in one
place as nats.py keeps its errors in ``nats.js.errors``. See docs/ARCHITECTURE.md,
"Layout and import root" (one home for every name)."""

from __future__ import annotations

#: "wrong last sequence": a compare-and-append or a KV update met a newer message.
WRONG_LAST_SEQUENCE = 10071
#: The clustered form: an expectation that cannot be checked while a message it
#: covers is still in flight (JSStreamWrongLastSequenceConstantErr).
WRONG_LAST_SEQUENCE_IN_FLIGHT = 10164
#: "stream name already in use with a different configuration".
STREAM_NAME_IN_USE = 10058
#: "insufficient storage resources available": the server cannot reserve a stream's
#: ``max_bytes`` (JSStorageResourcesExceededErr).
INSUFFICIENT_STORAGE = 10047
