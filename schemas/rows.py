"""Value checks on the rows a tenant hands in (``put_data``), before they reach
the Training Queue.

Shapes are checked against the workload's schema by the control plane
(``check_rows`` in agents/control/checks.py); ``check_values`` checks what
shapes cannot (dtypes, finiteness, ranges the heads train for, a sane row
count), so a bad batch fails its own job at the door instead of the shared
actor's step. It is pure and raises ``InvalidSpec`` (``ShapeMismatch`` for a
row-count or rank problem) naming the field and what is allowed. What passes
is what the service's own producers write and the SDK documents:

==========================  =================================  =====================
field                       dtype                              values
==========================  =================================  =====================
``obs_image_<camera>``      uint8                              0..255 (any)
``obs_state``               float (float32; 16/64 are cast)    finite, ``|x| <= STATE_LIMIT``
``actions``                 float                              finite, ``|x| <= ACTION_LIMIT``
``rewards``                 float or integer                   finite, ``|x| <= REWARD_LIMIT``
``dones`` ``terminated``    bool, or a number that is 0 or 1
``truncated`` ``success``
``env_id`` ``step``         integer                            ``0 <= x < INDEX_LIMIT``
``episode_index``
``frame_index``
``episode_seed``            integer                            any
``advantages`` ``returns``  float                              finite, ``|x| <= VALUE_LIMIT``
``values`` ``log_probs``...
any other field             any numeric dtype                  finite if float
==========================  =================================  =====================

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from joynexus.schemas.errors import InvalidSpec, ShapeMismatch
from joynexus.schemas.inference import FeatureSchemaSpec
from joynexus.schemas.samples import (
    ACTIONS_FIELD,
    ADVANTAGES_FIELD,
    DONES_FIELD,
    ENV_ID_FIELD,
    EPISODE_INDEX_FIELD,
    EPISODE_SEED_FIELD,
    FRAME_INDEX_FIELD,
    IMAGE_FIELD_PREFIX,
    RETURNS_FIELD,
    REWARDS_FIELD,
    STATE_FIELD,
    STEP_FIELD,
    SUCCESS_FIELD,
    TERMINATED_FIELD,
    TRUNCATED_FIELD,
    VALUES_FIELD,
)

__all__ = [
    "ACTION_LIMIT",
    "FLAG_FIELDS",
    "INDEX_LIMIT",
    "MAX_ROWS_PER_CALL",
    "REWARD_LIMIT",
    "STATE_LIMIT",
    "VALUE_LIMIT",
    "check_values",
]

IMAGE_PREFIX = IMAGE_FIELD_PREFIX

#: Rows one ``put_data`` call may carry. The SDK sends a batch in requests under
#: the payload limit (a few thousand rows of the smallest images), so this is
#: far above anything legitimate and far below what would exhaust a worker.
MAX_ROWS_PER_CALL = 1 << 16
#: The hosted environments take normalized actions in [-1, 1] (ManiSkill's
#: pd_ee_delta_pos; the service's RL producer clips to it, its datasets are
#: recorded in it); unclipped policy outputs a tenant executed may overshoot a
#: little. Past this bound it is a unit or scaling mistake, and the squared
#: losses of the heads would overflow.
ACTION_LIMIT = 10.0
#: Robot state (joint positions and velocities, poses in metres): generous.
STATE_LIMIT = 1e4
#: Per-step rewards (the hosted tasks' normalized dense rewards are in [0, 1]).
REWARD_LIMIT = 1e4
#: Advantages, returns, values, log-probabilities.
VALUE_LIMIT = 1e6
#: Non-negative indices (env, rollout step, episode, frame).
INDEX_LIMIT = 1 << 31

FLAG_FIELDS: tuple[str, ...] = (DONES_FIELD, TERMINATED_FIELD, TRUNCATED_FIELD, SUCCESS_FIELD)
INDEX_FIELDS: tuple[str, ...] = (ENV_ID_FIELD, STEP_FIELD, EPISODE_INDEX_FIELD, FRAME_INDEX_FIELD)
INT_FIELDS: tuple[str, ...] = (EPISODE_SEED_FIELD,)
#: Float fields, their bound and a word on what the bound is for.
BOUNDED: dict[str, tuple[float, str]] = {
    STATE_FIELD: (STATE_LIMIT, "robot state"),
    ACTIONS_FIELD: (ACTION_LIMIT, "actions are normalized to [-1, 1]"),
    REWARDS_FIELD: (REWARD_LIMIT, "per-step rewards"),
    ADVANTAGES_FIELD: (VALUE_LIMIT, "advantages"),
    RETURNS_FIELD: (VALUE_LIMIT, "returns"),
    VALUES_FIELD: (VALUE_LIMIT, "value estimates"),
    "log_probs": (VALUE_LIMIT, "log-probabilities"),
    "logprobs": (VALUE_LIMIT, "log-probabilities"),
    "old_log_probs": (VALUE_LIMIT, "log-probabilities"),
}
#: Per-row scalar fields of a rollout: [B].
SCALAR_FIELDS: frozenset[str] = frozenset({*FLAG_FIELDS, *INDEX_FIELDS, *INT_FIELDS, REWARDS_FIELD})
_INT_FIELDS_OK_FOR_FLOAT = frozenset({REWARDS_FIELD})


def _where(mask: np.ndarray) -> str:
    """'n of m values (first at row r)' for a boolean mask over a field."""
    n = int(mask.sum())
    row = int(np.argwhere(mask)[0][0])
    return f"{n} of {mask.size} value(s) (first at row {row})"


def _field(name: str, workload: str) -> str:
    return f"field {name!r} of workload {workload!r}"


def _check_float(name: str, arr: np.ndarray, workload: str, *, allow_int: bool = False) -> None:
    kind = arr.dtype.kind
    if kind == "f" or (allow_int and kind in "iu"):
        pass
    else:
        want = "float32 (or float16/float64)" + (", or an integer type" if allow_int else "")
        raise InvalidSpec(f"{_field(name, workload)}: dtype {arr.dtype.name} not allowed; send {want}")
    if kind != "f":
        return
    bad = ~np.isfinite(arr)
    if bad.any():
        raise InvalidSpec(
            f"{_field(name, workload)}: {_where(bad)} are non-finite (NaN/inf); send finite numbers only"
        )


def _check_bound(name: str, arr: np.ndarray, workload: str, limit: float, what: str) -> None:
    over = np.abs(arr.astype(np.float64, copy=False)) > limit
    if over.any():
        worst = float(np.abs(arr.astype(np.float64, copy=False)).max())
        raise InvalidSpec(
            f"{_field(name, workload)}: {_where(over)} exceed |x| <= {limit:g} ({what}); "
            f"largest |x| is {worst:.4g}: check units and normalization"
        )


def _check_flag(name: str, arr: np.ndarray, workload: str) -> None:
    kind = arr.dtype.kind
    if kind == "b":
        return
    if kind not in "iuf":
        raise InvalidSpec(f"{_field(name, workload)}: dtype {arr.dtype.name} not allowed; send bool")
    bad = (arr != 0) & (arr != 1)  # NaN compares unequal to both: refused too
    if bad.any():
        raise InvalidSpec(f"{_field(name, workload)}: {_where(bad)} are not 0/1; send bool (or 0 and 1)")


def _check_index(name: str, arr: np.ndarray, workload: str, *, bounded: bool) -> None:
    if arr.dtype.kind not in "iu":
        raise InvalidSpec(
            f"{_field(name, workload)}: dtype {arr.dtype.name} not allowed; send an integer type (int64)"
        )
    if not bounded or arr.size == 0:
        return
    bad = (arr < 0) | (arr >= INDEX_LIMIT)
    if bad.any():
        raise InvalidSpec(
            f"{_field(name, workload)}: {_where(bad)} are outside 0..{INDEX_LIMIT - 1}; "
            "indices count from 0"
        )


def check_values(data: dict[str, np.ndarray], fs: FeatureSchemaSpec, workload: str) -> None:
    """Refuse rows whose values the trainer cannot use (see the module docstring).

    ``data``: field name -> array with the rows on axis 0 (one ``put_data``
    call); ``fs``: the workload's feature schema; ``workload``: its name, for
    the messages. Fields the schema needs but ``data`` lacks are left to the
    shape check. Raises ``InvalidSpec`` naming the field and what is allowed,
    ``ShapeMismatch`` if the fields' row counts differ, a field has no row
    axis, or the call has no rows or more than ``MAX_ROWS_PER_CALL``.
    """
    if not data:
        raise InvalidSpec(f"workload {workload!r}: no fields given")
    arrays: dict[str, np.ndarray] = {}
    for name, raw in data.items():
        arr: Any = raw if isinstance(raw, np.ndarray) else np.asarray(raw)
        if arr.ndim == 0:
            raise ShapeMismatch(f"{_field(name, workload)}: a scalar; send an array with one entry per row [B, ...]")
        if arr.dtype.kind not in "biuf":
            raise InvalidSpec(
                f"{_field(name, workload)}: dtype {arr.dtype.name} not allowed; send numbers "
                "(uint8 images, float32 values, int64 indices, bool flags)"
            )
        arrays[name] = arr
    counts = {name: int(a.shape[0]) for name, a in arrays.items()}
    rows = counts.get(STATE_FIELD, next(iter(counts.values())))
    odd = {n: c for n, c in counts.items() if c != rows}
    if odd:
        raise ShapeMismatch(
            f"workload {workload!r}: every field needs the same number of rows; "
            f"{STATE_FIELD if STATE_FIELD in counts else next(iter(counts))!r} has {rows}, {odd}"
        )
    if rows < 1:
        raise ShapeMismatch(f"workload {workload!r}: no rows; send at least one")
    if rows > MAX_ROWS_PER_CALL:
        raise ShapeMismatch(
            f"workload {workload!r}: {rows} rows in one call; send at most {MAX_ROWS_PER_CALL} "
            "per call (the SDK splits a batch for you)"
        )
    images = {f"{IMAGE_PREFIX}{slot}" for slot in fs.camera_slots}
    for name, arr in arrays.items():
        if name in images or name.startswith(IMAGE_PREFIX):
            if arr.dtype != np.uint8:
                raise InvalidSpec(
                    f"{_field(name, workload)}: dtype {arr.dtype.name} not allowed; camera images are "
                    f"uint8 0..255 [B, {fs.channels}, {fs.image_hw[0]}, {fs.image_hw[1]}]"
                )
            continue
        if name in SCALAR_FIELDS and arr.ndim != 1:
            raise ShapeMismatch(f"{_field(name, workload)}: expected one value per row [B], got {list(arr.shape)}")
        if name in FLAG_FIELDS:
            _check_flag(name, arr, workload)
        elif name in INDEX_FIELDS or name in INT_FIELDS:
            _check_index(name, arr, workload, bounded=name in INDEX_FIELDS)
        elif name in BOUNDED:
            limit, what = BOUNDED[name]
            _check_float(name, arr, workload, allow_int=name in _INT_FIELDS_OK_FOR_FLOAT)
            _check_bound(name, arr, workload, limit, what)
        elif arr.dtype.kind == "f":  # a field of the tenant's own: finite at least
            _check_float(name, arr, workload)
