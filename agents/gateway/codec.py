"""openpi's websocket frames, both ways, with bounds: pure, no I/O.

openpi (``openpi_client.msgpack_numpy``) packs a numpy array as a msgpack map
``{b"__ndarray__": True, b"data": <bytes>, b"dtype": "<f4", b"shape": [..]}`` and a
numpy scalar as ``{b"__npgeneric__": True, b"data": x, b"dtype": ..}``; everything
else is plain msgpack. The server sends its metadata first, then one reply per
observation, and an error as a text frame (the client raises it).

Decoding here never trusts the sender: msgspec refuses truncated input and
declared lengths past the frame, and nesting past its recursion limit; on top of
that an observation may nest :data:`MAX_DEPTH` maps deep, arrays take only the
dtypes of :data:`DTYPES` (never an object array), at most :data:`MAX_NDIM`
dimensions, and their bytes must be exactly what shape and dtype declare.

See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from joynexus.schemas.errors import InvalidMessage

#: openpi's markers of a packed array and scalar.
ND_MARK = b"__ndarray__"
NG_MARK = b"__npgeneric__"
#: dtypes an observation's arrays may carry (numpy's ``dtype.str``).
DTYPES = frozenset({"|u1", "|i1", "|b1", "<u2", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8"})
#: How deep an observation's maps and lists may nest (openpi's own: 2, ``images`` maps).
MAX_DEPTH = 4
MAX_NDIM = 5
#: Keys an observation (and each map in it) may hold.
MAX_KEYS = 64

_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


def _array(obj: dict[Any, Any]) -> np.ndarray:
    dtype, shape, data = obj.get(b"dtype"), obj.get(b"shape"), obj.get(b"data")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidMessage(f"array dtype {str(dtype)[:20]!r} not accepted; use one of "
                             f"{sorted(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(s, int) and 0 <= s < 2**31 for s in shape)):
        raise InvalidMessage(f"array shape must be at most {MAX_NDIM} non-negative integers")
    if not isinstance(data, bytes):
        raise InvalidMessage("array data must be bytes")
    dt = np.dtype(dtype)
    if math.prod(shape) * dt.itemsize != len(data):
        raise InvalidMessage(f"array of shape {shape} and dtype {dtype} needs "
                             f"{math.prod(shape) * dt.itemsize} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def _scalar(obj: dict[Any, Any]) -> Any:
    dtype, data = obj.get(b"dtype"), obj.get(b"data")
    if not isinstance(dtype, str) or dtype not in DTYPES or not isinstance(data, int | float | bool):
        raise InvalidMessage("numpy scalar of a dtype or value not accepted")
    return data


def _value(x: Any, depth: int) -> Any:
    if isinstance(x, dict):
        if ND_MARK in x:
            return _array(x)
        if NG_MARK in x:
            return _scalar(x)
        if depth >= MAX_DEPTH:
            raise InvalidMessage(f"observation nests deeper than {MAX_DEPTH} levels")
        if len(x) > MAX_KEYS:
            raise InvalidMessage(f"a map of {len(x)} keys; at most {MAX_KEYS}")
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise InvalidMessage("observation keys must be strings")
            out[k] = _value(v, depth + 1)
        return out
    if isinstance(x, list):
        if depth >= MAX_DEPTH:
            raise InvalidMessage(f"observation nests deeper than {MAX_DEPTH} levels")
        if len(x) > 4096:
            raise InvalidMessage("a list of more than 4096 items")
        return [_value(v, depth + 1) for v in x]
    return x


def decode_observation(frame: bytes) -> dict[str, Any]:
    """An observation frame as a dict of str -> numpy arrays, maps, strings, numbers;
    InvalidMessage naming what is wrong otherwise."""
    try:
        obj = _decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise InvalidMessage(f"not valid msgpack ({e})") from None
    except RecursionError:
        raise InvalidMessage("observation nested too deeply") from None
    if not isinstance(obj, dict):
        raise InvalidMessage(f"an observation is a map, got {type(obj).__name__}")
    out = _value(obj, 0)
    assert isinstance(out, dict)
    return out


def pack_array(x: np.ndarray) -> dict[bytes, Any]:
    """An array as openpi packs it."""
    x = np.ascontiguousarray(x)
    return {ND_MARK: True, b"data": x.tobytes(), b"dtype": x.dtype.str, b"shape": list(x.shape)}


def encode(obj: dict[str, Any]) -> bytes:
    """A reply or the metadata (arrays already packed with :func:`pack_array`)."""
    return _encoder.encode(obj)
