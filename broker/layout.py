"""The JetStream layout of a deployment, created idempotently.

Any agent may call :func:`ensure_layout` at start; the first creates the
streams and buckets, the rest find them (and an existing stream is never
scaled down). Descriptions are written for the operator reading
``nats stream ls``.

See docs/ARCHITECTURE.md, "Names an operator sees".
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError

from joynexus.broker.connection import Broker
from joynexus.broker.errcodes import INSUFFICIENT_STORAGE, STREAM_NAME_IN_USE
from joynexus.schemas.errors import InvalidSpec

DAY = 24 * 3600.0


def _default_replicas() -> int:
    """``$JOYNEXUS_REPLICAS`` (a cluster's deployment sets it for every role), else 1."""
    return max(1, int(os.environ.get("JOYNEXUS_REPLICAS", "1")))


#: The smallest cap a stream may be given from the environment.
MIN_STREAM_BYTES = 16 * 1024**2
TQ_MAX_BYTES_ENV = "JOYNEXUS_TQ_MAX_BYTES"
METRICS_MAX_BYTES_ENV = "JOYNEXUS_METRICS_MAX_BYTES"


def _env_bytes(name: str, default: int) -> int:
    """A stream's byte cap from ``$name`` (a whole number of bytes, or with a K/M/G
    suffix, powers of 1024), else ``default``. Every role of a deployment reads the
    same environment, so the roles agree on the cap they ensure."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    text = raw.upper().removesuffix("IB").removesuffix("B")
    scale = units.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in units else text
    if not digits.isdigit() or int(digits) * scale < MIN_STREAM_BYTES:
        raise InvalidSpec(
            f"${name}={raw!r}: give a stream cap in bytes, at least "
            f"{MIN_STREAM_BYTES // 1024**2} MiB (e.g. 2G, 512M or 1073741824)"
        )
    return int(digits) * scale


@dataclass(frozen=True)
class LayoutOptions:
    #: Replicas of every stream and bucket. An existing stream is never scaled down
    #: by a role that starts with fewer (see ``ensure_stream``).
    replicas: int = field(default_factory=_default_replicas)
    #: How long job events are kept (accounting needs the terminal ones).
    jobs_max_age_s: float = 7 * DAY
    #: Default per-message TTL of Training Queue data: orphans expire.
    tq_ttl_s: float = 3600.0
    #: Cap on the whole Training Queue (bytes); puts beyond it fail loudly. JetStream
    #: reserves it on the server's store when the stream is made (``$JOYNEXUS_TQ_MAX_BYTES``).
    tq_max_bytes: int = field(default_factory=lambda: _env_bytes(TQ_MAX_BYTES_ENV, 8 * 1024**3))
    #: Dedupe window for retried appends.
    duplicate_window_s: float = 120.0
    #: Caps on the metrics stream (events older than a day go anyway): the whole
    #: stream's bytes and messages, the messages of one subject
    #: (``<ns>.metrics.<kind>.<tenant>``: one tenant's flood of one kind evicts only
    #: its own oldest events), and one event (a metric is well under 4 kB; the
    #: strings in it are clipped). Past a cap the oldest events are discarded:
    #: publishing a metric never fails for it.
    metrics_max_bytes: int = field(
        default_factory=lambda: _env_bytes(METRICS_MAX_BYTES_ENV, 1024**3)
    )
    metrics_max_msgs: int = 2_000_000
    metrics_max_msgs_per_subject: int = 500_000
    metrics_max_msg_size: int = 64 * 1024


def stream_configs(b: Broker, opts: LayoutOptions) -> list[StreamConfig]:
    n = b.names
    return [
        StreamConfig(
            name=n.jobs_stream,
            description=f"JoyNexus job event log: {n.namespace}.job.<tenant>.<job>.<state> "
            "(source of truth of every training job)",
            subjects=[n.all_jobs, n.all_lease_epochs],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=opts.jobs_max_age_s,
            duplicate_window=opts.duplicate_window_s,
            num_replicas=opts.replicas,
            allow_direct=True,
        ),
        StreamConfig(
            name=n.tq_stream,
            description=f"JoyNexus Training Queue: {n.namespace}.tq.<tenant>.<partition>.<kind>... "
            "(sample batches as raw tensors)",
            subjects=[n.all_tq],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_bytes=opts.tq_max_bytes,
            discard=DiscardPolicy.NEW,
            max_msg_size=b.max_payload,
            num_replicas=opts.replicas,
            allow_direct=True,
            allow_msg_ttl=True,
            duplicate_window=opts.duplicate_window_s,
        ),
        StreamConfig(
            name=n.metrics_stream,
            description=f"JoyNexus metrics: {n.namespace}.metrics.<kind>.<tenant> "
            "(control, learning and system signals)",
            subjects=[n.all_metrics],
            storage=StorageType.FILE,
            max_age=DAY,
            max_bytes=opts.metrics_max_bytes,
            max_msgs=opts.metrics_max_msgs,
            max_msgs_per_subject=opts.metrics_max_msgs_per_subject,
            max_msg_size=opts.metrics_max_msg_size,
            discard=DiscardPolicy.OLD,
            num_replicas=opts.replicas,
        ),
        StreamConfig(
            name=n.advisories_stream,
            description="JoyNexus: JetStream max-deliveries advisories of the job consumers "
            "(the scheduler fails those jobs)",
            subjects=[n.max_deliveries_advisories],
            storage=StorageType.FILE,
            max_age=opts.jobs_max_age_s,
            num_replicas=opts.replicas,
        ),
    ]


def kv_configs(b: Broker, opts: LayoutOptions) -> list[KeyValueConfig]:
    n = b.names
    return [
        KeyValueConfig(
            bucket=n.tenants_bucket,
            description="JoyNexus tenant-task policies: <tenant>.<task_type> -> admission limits",
            history=8,
            replicas=opts.replicas,
        ),
        KeyValueConfig(
            bucket=n.workloads_bucket,
            description="JoyNexus workloads: <tenant>.<name> -> spec and state (the control plane writes)",
            history=4,
            replicas=opts.replicas,
        ),
        KeyValueConfig(
            bucket=n.policy_bucket,
            description="JoyNexus policy versions: <tenant>.<workload> -> current version "
            "and its weights object (history keeps the retained versions)",
            history=64,
            replicas=opts.replicas,
        ),
        KeyValueConfig(
            bucket=n.identities_bucket,
            description="JoyNexus tenant identities: <tenant> -> NATS user and bcrypt password "
            "hash (the control plane writes, the server's auth sync renders them into its "
            "authorization; _applied = the revision it applied)",
            history=8,
            replicas=opts.replicas,
        ),
        KeyValueConfig(
            bucket=n.apikeys_bucket,
            description="JoyNexus policy gateway API keys: key.<id> -> tenant, scope and the "
            "sha256 of the key (the control plane writes), used.<id> -> last use",
            history=1,
            replicas=opts.replicas,
        ),
        KeyValueConfig(
            bucket=n.health_bucket,
            description="JoyNexus health: hb.<role>.<instance> heartbeats (per-message TTL; "
            "the server writes a marker when one expires) and mgr.<instance> supervisor state",
            history=1,
            replicas=opts.replicas,
            limit_marker_ttl=60.0,
        ),
        KeyValueConfig(
            bucket=n.trainer_bucket,
            description="JoyNexus trainer state: <tenant>.<workload> -> the checkpoint in "
            "force (object name, digest, version); written by compare-and-set, the commit "
            "point of an actor's step",
            history=4,
            replicas=opts.replicas,
        ),
    ]


def object_store_configs(b: Broker, opts: LayoutOptions) -> list[ObjectStoreConfig]:
    return [
        ObjectStoreConfig(
            bucket=b.names.weights_store,
            description="JoyNexus action-module weights: <tenant>/<workload>/v<version>.safetensors",
            replicas=opts.replicas,
        ),
        ObjectStoreConfig(
            bucket=b.names.checkpoints_store,
            description="JoyNexus trainer checkpoints: <tenant>/<workload>/v<version>-<nonce>.ckpt "
            "(module, optimizer, applied jobs; the trainer KV says which one is in force)",
            replicas=opts.replicas,
        ),
    ]


def _no_storage(b: Broker, cfg: StreamConfig, e: APIError) -> InvalidSpec:
    """What to do when the server cannot reserve a stream's cap (10047)."""
    knob = {b.names.tq_stream: TQ_MAX_BYTES_ENV, b.names.metrics_stream: METRICS_MAX_BYTES_ENV}
    lower = f"lower ${knob[cfg.name]}, " if cfg.name in knob else ""
    gib = (cfg.max_bytes or 0) / 1024**3
    return InvalidSpec(
        f"stream {cfg.name} reserves {gib:.2f} GiB of JetStream file storage and the server "
        f"has not that much left unreserved ({e.description}). nats-server gives JetStream "
        "75% of its store disk's free space unless `max_file_store` is set (the embedded "
        "server: $JOYNEXUS_NATS_MAX_FILE_STORE, bytes); free disk, "
        f"{lower}or delete unused streams (`nats stream report` shows what each reserves)"
    )


async def ensure_stream(b: Broker, cfg: StreamConfig) -> None:
    assert cfg.name is not None
    try:
        info = await b.js.stream_info(cfg.name)
    except NotFoundError:
        try:
            await b.js.add_stream(cfg)
        except APIError as e:
            if e.err_code == INSUFFICIENT_STORAGE:
                raise _no_storage(b, cfg, e) from e
            raise
        return
    existing = info.config.num_replicas or 1
    if (cfg.num_replicas or 1) < existing:  # a cluster's R3 stays R3
        cfg = dataclasses.replace(cfg, num_replicas=existing)
    try:
        await b.js.update_stream(cfg)
    except BadRequestError as e:
        raise InvalidSpec(
            f"stream {cfg.name} exists with a configuration this version cannot update "
            f"({e.description}); inspect it with `nats stream info {cfg.name}`"
        ) from e
    except APIError as e:
        if e.err_code == INSUFFICIENT_STORAGE:  # a larger cap than the stream has
            raise _no_storage(b, cfg, e) from e
        raise


async def ensure_layout(b: Broker, opts: LayoutOptions | None = None) -> None:
    opts = opts or LayoutOptions()
    for cfg in stream_configs(b, opts):
        await ensure_stream(b, cfg)
    for kv in kv_configs(b, opts):
        try:
            await b.js.create_key_value(kv)
        except BadRequestError as e:
            if e.err_code != STREAM_NAME_IN_USE:
                raise
            # It exists with another configuration (an operator's R3 bucket met by a
            # role started without $JOYNEXUS_REPLICAS): use it as it is.
            await b.js.key_value(kv.bucket)
    for obj in object_store_configs(b, opts):
        assert obj.bucket is not None
        try:
            await b.js.object_store(obj.bucket)
        except (NotFoundError, BucketNotFoundError):
            await b.js.create_object_store(obj.bucket, config=obj)


async def delete_layout(b: Broker) -> None:
    """Delete every stream and bucket of this namespace (tests and benchmarks clean up)."""
    n = b.names
    for stream in (n.jobs_stream, n.tq_stream, n.metrics_stream, n.advisories_stream):
        try:
            await b.js.delete_stream(stream)
        except NotFoundError:
            pass
    for kv in kv_configs(b, LayoutOptions()):
        try:
            await b.js.delete_key_value(kv.bucket)
        except NotFoundError:
            pass
    for obj in object_store_configs(b, LayoutOptions()):
        assert obj.bucket is not None
        try:
            await b.js.delete_object_store(obj.bucket)
        except NotFoundError:
            pass
