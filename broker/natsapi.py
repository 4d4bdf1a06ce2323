"""The NATS server's own subjects: the JetStream, KV, object store and micro-service
APIs and inboxes (what the service identities may use; ``broker/permissions.py``),
and the helpers that build them (a KV key's subject, a stream's API verb).

This deployment's own names (``<ns>.<token>...``, streams, buckets) are in
broker/subjects.py; nothing else writes either kind (tests/unit/test_names.py).
"""

from __future__ import annotations

JS_API = "$JS.API"
ALL_JS_API = f"{JS_API}.>"
ALL_JS_ACKS = "$JS.ACK.>"
ALL_JS_FLOW_CONTROL = "$JS.FC.>"
ALL_KV = "$KV.>"
ALL_OBJECTS = "$O.>"
ALL_SERVICES = "$SRV.>"
ALL_INBOXES = "_INBOX.>"
#: Every namespace's operator inboxes (``Names.admin_inbox_prefix``).
ALL_ADMIN_INBOXES = "_INBOX.*._admin.>"
#: JetStream's advisory when a stream (e.g. ``KV_<NS>_IDENTITIES``) is created.
STREAM_CREATED_ADVISORIES = "$JS.EVENT.ADVISORY.STREAM.CREATED.*"
#: JetStream's API verb that lists stream names, a page (1024) at a time.
JS_STREAM_NAMES = "$JS.API.STREAM.NAMES"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a KV put of ``key`` publishes to (a raw publish can carry headers
    such as a per-message TTL, which nats-py's ``kv.put`` cannot)."""
    return f"$KV.{bucket}.{key}"


def kv_stream(bucket: str) -> str:
    """The stream behind a KV bucket."""
    return f"KV_{bucket}"


def stream_api(op: str, stream: str) -> str:
    """A JetStream stream API subject, e.g. ``stream_api("PURGE", "JNX_JOBS")``
    (``op``: ``PURGE``, ``DELETE``, ``MSG.DELETE``, ...; ``stream`` may be ``>``)."""
    return f"{JS_API}.STREAM.{op}.{stream}"


def service_api(verb: str, service: str) -> str:
    """A micro-service discovery subject, e.g. ``service_api("PING", "jnx-sched")``."""
    return f"$SRV.{verb}.{service}"
