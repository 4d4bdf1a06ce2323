"""Wire messages of the Inference Queue (``<ns>.infer.<model>``) and policy records.

Observations travel as raw little-endian bytes with dtype and shape
(:class:`TensorBytes`), never pickle; a reply is a tagged union,
``InferResult | InferError`` (field ``t``), decoded once at the client.
:class:`PolicyRecord` is the JSON value of ``<tenant>.<workload>`` in the
policy bucket (readable with ``nats kv get``). Inference's own errors live
here so client and engine share them; :func:`inference_error_from_code`
rebuilds any error by code.

See docs/ARCHITECTURE.md, "The Inference Queue".
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from joynexus.schemas.base import WIRE_VERSION, Wire
from joynexus.schemas.errors import (
    IncompatibleSchema,
    InvalidMessage,
    InvalidSpec,
    JoyNexusError,
    SchemaVersionError,
    ShapeMismatch,
    UnknownPolicyVersion,
    error_from_code,
)

__all__ = [
    "DEFAULT_MAX_ROWS",
    "DTYPES",
    "BatchInfo",
    "FeatureSchemaSpec",
    "IncompatibleSchema",
    "InferError",
    "InferReply",
    "InferRequest",
    "InferResult",
    "InferTimings",
    "Observation",
    "PolicyRecord",
    "TensorBytes",
    "UnknownPolicyVersion",
    "decode_msgpack",
    "encode_msgpack",
    "inference_error_from_code",
]


# -- errors -------------------------------------------------------------------


def inference_error_from_code(code: str, message: str) -> JoyNexusError:
    """Rebuild an error reply by its code (kept for callers; same as error_from_code)."""
    return error_from_code(code, message)


# -- tensors ------------------------------------------------------------------

#: dtypes a tensor may carry on the wire (little-endian).
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64",
    )
}


#: Rows an inference engine's batch holds at most by default; a request with more
#: runs in parts of at most this many, each taking its turn with other tenants'
#: requests (``agents/inference/batcher.py``, ``split``). It bounds how long any
#: request waits behind another tenant's work: one forward of this many rows (the tiny
#: base here: about 45 ms at 16 rows, 150-190 ms at 64, the quota's ``max_infer_rows``).
DEFAULT_MAX_ROWS = 16


class TensorBytes(Wire, kw_only=True, array_like=True):
    """A tensor as raw little-endian bytes; encoded as ``[dtype, shape, data]``."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_array(cls, x: Any) -> TensorBytes:
        """From a numpy array (or anything with ``.numpy()``/``__array__``, e.g. a CPU tensor)."""
        if hasattr(x, "detach"):
            x = x.detach().cpu().numpy()
        arr = np.asarray(x)
        name = arr.dtype.name
        if name not in DTYPES:
            raise InvalidSpec(f"dtype {name} cannot travel: use one of {sorted(DTYPES)}")
        arr = np.ascontiguousarray(arr, dtype=DTYPES[name])
        return cls(dtype=name, shape=[int(s) for s in arr.shape], data=arr.tobytes())

    def to_array(self, field: str = "tensor") -> np.ndarray:
        """A read-only numpy view of the bytes; raises naming ``field`` if they do not fit."""
        dt = DTYPES.get(self.dtype)
        if dt is None:
            raise InvalidSpec(f"{field}: dtype {self.dtype!r} not supported; use one of {sorted(DTYPES)}")
        if any(s < 0 for s in self.shape):
            raise ShapeMismatch(f"{field}: negative dimension in shape {self.shape}")
        n = math.prod(self.shape)
        if n * dt.itemsize != len(self.data):
            raise ShapeMismatch(
                f"{field}: shape {self.shape} of {self.dtype} needs {n * dt.itemsize} bytes, "
                f"got {len(self.data)}"
            )
        return np.frombuffer(self.data, dtype=dt).reshape(self.shape)


# -- requests -----------------------------------------------------------------


class Observation(Wire, kw_only=True, omit_defaults=True):
    """One observation (or a batch of them: ``state`` ``[B, S]``, images ``[B, C, H, W]``).

    ``images`` maps camera slot -> uint8 ``[C, H, W]``/``[H, W, C]`` (or batched);
    ``instruction`` is one string (broadcast) or one per sample.
    """

    images: dict[str, TensorBytes]
    instruction: str | list[str]
    state: TensorBytes
    history: TensorBytes | None = None


class InferRequest(Wire, kw_only=True, omit_defaults=True):
    """Ask for an action chunk. ``policy_version`` None or 0 means the latest loaded."""

    v: int = WIRE_VERSION
    tenant_id: str
    workload: str = "default"
    session_id: str = ""
    #: ``FeatureSchema.signature()`` the caller built its observation for.
    schema_signature: str
    policy_version: int | None = None
    observation: Observation
    #: Flow-matching heads: the initial noise ``[B, horizon, action_dim]`` (pins sampling).
    noise: TensorBytes | None = None


# -- replies ------------------------------------------------------------------


class BatchInfo(Wire, kw_only=True):
    """Which shared forward served a request (observability)."""

    batch_id: str
    #: requests in the batch, and their sample rows in total
    size: int
    rows: int
    instance: str = ""
    #: True when the batch fell back to one forward per request after a failure.
    fallback: bool = False


class InferTimings(Wire, kw_only=True):
    """Milliseconds: waiting for a batch, the shared forward, this request's head, receipt to reply."""

    queue_ms: float
    forward_ms: float
    decode_ms: float
    total_ms: float


class InferResult(Wire, kw_only=True, tag="ok", tag_field="t"):
    actions: TensorBytes
    policy_version: int
    batch: BatchInfo
    timings: InferTimings


class InferError(Wire, kw_only=True, tag="error", tag_field="t"):
    code: str
    message: str

    def to_exception(self) -> JoyNexusError:
        return inference_error_from_code(self.code, self.message)


InferReply = InferResult | InferError


# -- policy records (KV) ------------------------------------------------------


class FeatureSchemaSpec(Wire, kw_only=True):
    """The plain-data form of ``agents.models.features.FeatureSchema``."""

    camera_slots: list[str]
    image_hw: list[int]
    state_dim: int
    action_dim: int
    action_horizon: int
    base_model: str
    history_len: int = 0
    channels: int = 3
    #: What the state vector is made of (empty: unknown); see FeatureSchema.state_keys.
    state_keys: list[str] = []


class PolicyRecord(Wire, kw_only=True, omit_defaults=True):
    """One published policy version of a tenant (value of ``<tenant>.<workload>``)."""

    v: int = WIRE_VERSION
    tenant_id: str
    workload: str
    version: int
    head_type: str
    head_config: dict[str, Any]
    schema_signature: str
    feature_schema: FeatureSchemaSpec
    base_model: str
    #: Object name in the weights store (safetensors bytes).
    object_name: str
    size_bytes: int = 0
    created_at: float = 0.0


# -- msgpack codec ------------------------------------------------------------

_mp_encoder = msgspec.msgpack.Encoder()
_mp_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode_msgpack(obj: Any) -> bytes:
    """msgpack bytes (compact; binary tensors stay binary)."""
    return _mp_encoder.encode(obj)


def decode_msgpack(data: bytes | memoryview, typ: Any, *, what: str | None = None) -> Any:
    """Decode msgpack ``data`` as ``typ`` (a struct or a union); InvalidMessage names the problem."""
    dec = _mp_decoders.get(typ)
    if dec is None:
        dec = _mp_decoders[typ] = msgspec.msgpack.Decoder(typ)
    name = what or getattr(typ, "__name__", str(typ))
    try:
        obj = dec.decode(data)
    except msgspec.ValidationError as e:
        raise InvalidMessage(f"malformed {name}: {e}") from e
    except msgspec.DecodeError as e:
        raise InvalidMessage(f"malformed {name}: not valid msgpack ({e})") from e
    except RecursionError:  # msgspec's own depth check, on a free-form (Any) field
        raise InvalidMessage(f"malformed {name}: nested too deeply") from None
    v = getattr(obj, "v", WIRE_VERSION)
    if isinstance(v, int) and v > WIRE_VERSION:
        raise SchemaVersionError(
            f"{name} uses wire schema v{v}, newer than this joynexus (v{WIRE_VERSION}); "
            "upgrade joynexus on this agent"
        )
    return obj
