"""The base of every wire struct (``Wire``, strict under ``JOYNEXUS_STRICT_DECODE=1``), and
the codecs that read and write them (see the package docstring for why; docs/ARCHITECTURE.md,
"Layout and import root")."""

from __future__ import annotations

import os
from typing import Any, TypeVar

import msgspec

from joynexus.schemas.errors import InvalidMessage, SchemaVersionError

#: Read once at import: tests set it before importing joynexus.
STRICT_DECODE: bool = os.environ.get("JOYNEXUS_STRICT_DECODE", "0") == "1"

#: Major version of the wire schemas. Additive changes (a new field with a
#: default) keep it; anything a v1 reader would misread bumps it.
WIRE_VERSION = 1


class Wire(msgspec.Struct, kw_only=True, forbid_unknown_fields=STRICT_DECODE):
    """Base for messages: keyword-only, strict about unknown fields in tests."""


T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(obj: Any) -> bytes:
    """JSON bytes: readable in `nats stream view` and `nats kv get`."""
    return _json_encoder.encode(obj)


def decode(data: bytes | memoryview, typ: type[T], *, what: str | None = None) -> T:
    """Decode ``data`` as ``typ``; a bad payload raises InvalidMessage naming the problem."""
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.json.Decoder(typ)
    try:
        obj = dec.decode(data)
    except msgspec.ValidationError as e:
        raise InvalidMessage(f"malformed {what or getattr(typ, '__name__', typ)}: {e}") from e
    except msgspec.DecodeError as e:
        raise InvalidMessage(
            f"malformed {what or getattr(typ, '__name__', typ)}: not valid JSON ({e})"
        ) from e
    except RecursionError:  # msgspec's own depth check, on a free-form (Any) field
        raise InvalidMessage(
            f"malformed {what or getattr(typ, '__name__', typ)}: nested too deeply"
        ) from None
    v = getattr(obj, "v", WIRE_VERSION)
    if isinstance(v, int) and v > WIRE_VERSION:
        raise SchemaVersionError(
            f"{what or type(obj).__name__} uses wire schema v{v}, newer than this joynexus "
            f"(v{WIRE_VERSION}); upgrade joynexus on this agent"
        )
    return obj
