"""The training client's calls on a ``task_type="custom"`` workload (Tinker-style
primitives): what a call asks, what it answers, and the door's checks on both.

Each call of ``Client.training_client(workload)`` is one job in the event log
(``TrainingJob.task_type == "custom"``) whose ``metadata.extra`` carries the
call (:meth:`TrainCall.extra`); its rows, if it has any, go through the
Training Queue like any job's; the actor applies the calls of one workload in
``seq`` order, exactly once, and keeps each call's :class:`TrainResult`.
Nothing a tenant sends is executed: a call names an operation and a built-in
loss from fixed tables, with bounded numbers; a custom loss's gradients come
as tensors (``grad_<output>`` fields, the exact shapes of the outputs).

See docs/ARCHITECTURE.md, "The training client".
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from joynexus.schemas.base import Wire
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch
from joynexus.schemas.inference import TensorBytes
from joynexus.schemas.jobs import check_name
from joynexus.schemas.samples import (
    ACTIONS_FIELD,
    ADVANTAGES_FIELD,
    FIELDS,
    FLOW_T_FIELD,
    FLOW_XT_FIELD,
    GRAD_LOG_STD_FIELD,
    GRAD_MEAN_FIELD,
    GRAD_VALUE_FIELD,
    GRAD_VELOCITY_FIELD,
    IMAGE_FIELD_PREFIX,
    OLD_LOGP_FIELD,
    RETURNS_FIELD,
    STATE_FIELD,
)
from joynexus.schemas.scheduler import ErrorBody

__all__ = [
    "FLOW_OUTPUTS",
    "FLOW_T_FIELD",
    "FLOW_XT_FIELD",
    "GAUSSIAN_OUTPUTS",
    "GRAD_PREFIX",
    "HEAD_FAMILIES",
    "LOSSES",
    "LOSS_SETTINGS",
    "MAX_SEQ",
    "OPS",
    "OUTPUT_GRADS",
    "ROW_OPS",
    "Op",
    "TrainCall",
    "TrainResult",
    "TrainResultQuery",
    "call_fields",
    "check_call_rows",
    "check_state_name",
    "grad_field",
]

Op = Literal[
    "forward", "forward_backward", "backward", "optim_step", "zero_grad",
    "save_state", "load_state", "list_states", "delete_state",
]
OPS: tuple[str, ...] = (
    "forward", "forward_backward", "backward", "optim_step", "zero_grad",
    "save_state", "load_state", "list_states", "delete_state",
)
#: Calls whose rows go through the Training Queue (the others carry no rows).
ROW_OPS = frozenset({"forward", "forward_backward", "backward"})
#: Calls that name a checkpoint.
STATE_OPS = frozenset({"save_state", "load_state", "delete_state"})

#: The built-in losses and the settings each takes: name -> (low, high) inclusive.
LOSS_SETTINGS: dict[str, dict[str, tuple[float, float]]] = {
    "bc_mse": {},
    "ppo": {"clip": (0.0, 1.0), "vf_coef": (0.0, 100.0), "ent_coef": (-1.0, 1.0),
            "std_floor": (0.0, 1.0)},
    "awr": {"beta": (1e-3, 100.0)},
    "flow_matching": {},
}
LOSSES: tuple[str, ...] = tuple(LOSS_SETTINGS)

#: What ``forward`` answers per head family (and what a custom loss may take the
#: gradient of): a Gaussian head's mean chunk [B, H, A] (env action units), its
#: log-std [B, A] (the same per row) and critic value [B]; a flow head's velocity
#: [B, H, A] at the rows' point ``flow_xt`` [B, H, A] and time ``flow_t`` [B].
GAUSSIAN_OUTPUTS: tuple[str, ...] = ("mean", "log_std", "value")
FLOW_OUTPUTS: tuple[str, ...] = ("velocity",)
#: A custom loss's gradient of output ``o`` travels as field ``grad_<o>``.
GRAD_PREFIX = "grad_"
OUTPUT_GRADS: dict[str, str] = {
    "mean": GRAD_MEAN_FIELD, "log_std": GRAD_LOG_STD_FIELD, "value": GRAD_VALUE_FIELD,
    "velocity": GRAD_VELOCITY_FIELD,
}
#: The action modules a training client drives, and their family (its outputs).
HEAD_FAMILIES: dict[str, str] = {"oft_mlp": "gaussian", "oft_attn": "gaussian",
                                 "flow_matching": "flow"}
#: Call sequence numbers are 1, 2, ... below this.
MAX_SEQ = 2**53


def grad_field(output: str) -> str:
    """The Training Queue field of the gradient of ``output``."""
    return OUTPUT_GRADS[output]


#: Fields each built-in loss reads besides the observation.
_LOSS_FIELDS: dict[str, tuple[str, ...]] = {
    "bc_mse": (ACTIONS_FIELD,),
    "ppo": (ACTIONS_FIELD, OLD_LOGP_FIELD, ADVANTAGES_FIELD, RETURNS_FIELD),
    "awr": (ACTIONS_FIELD, ADVANTAGES_FIELD),
    "flow_matching": (ACTIONS_FIELD,),
}
#: Which family each built-in loss trains.
LOSS_FAMILY: dict[str, str] = {"bc_mse": "gaussian", "ppo": "gaussian", "awr": "gaussian",
                               "flow_matching": "flow"}


def call_fields(op: str, loss: str, family: str) -> tuple[set[str], set[str]]:
    """(required, optional) Training Queue fields of a row call besides the images
    and ``obs_state``; at least one optional field is required where there are any."""
    if op == "forward":
        return ({FLOW_XT_FIELD, FLOW_T_FIELD} if family == "flow" else set()), set()
    if op == "forward_backward":
        if LOSS_FAMILY[loss] != family:
            raise InvalidSpec(
                f"loss {loss!r} trains {LOSS_FAMILY[loss]} heads; this workload's head is {family}"
            )
        return set(_LOSS_FIELDS[loss]), set()
    if family == "flow":
        return {FLOW_XT_FIELD, FLOW_T_FIELD, GRAD_VELOCITY_FIELD}, set()
    return {GRAD_MEAN_FIELD, GRAD_LOG_STD_FIELD, GRAD_VALUE_FIELD}, set()


def check_call_rows(call: TrainCall, family: str, shapes: dict[str, tuple[int, ...]],
                    sizes: dict[str, int], cameras: list[str]) -> None:
    """The fields of one ``put_data`` of a row call (``shapes``: name -> per-row
    shape): exactly those the call reads (the images, ``obs_state``, the loss's or
    the gradients'), each of its table shape for the workload's ``sizes``
    (``samples.dims_of``). Values (finite, dtypes) are ``schemas.rows.check_values``'s."""
    names = set(shapes)
    images = {IMAGE_FIELD_PREFIX + c for c in cameras}
    required, optional = call_fields(call.op, call.loss, family)
    missing = {STATE_FIELD, *required, *images} - names
    if missing:
        raise InvalidSpec(f"{call.op} needs fields {sorted(missing)}")
    extra = names - {STATE_FIELD, *required, *images} - optional
    if extra:
        raise InvalidSpec(f"{call.op} takes no fields {sorted(extra)[:8]}")
    if optional and not names & optional:
        raise InvalidSpec(f"backward needs the gradient of at least one output: {sorted(optional)}")
    for name, got in shapes.items():
        want = FIELDS[IMAGE_FIELD_PREFIX + "<camera>" if name in images else name].shape(sizes)
        if got != want:
            raise ShapeMismatch(
                f"field {name!r} must be [B, {', '.join(map(str, want))}] (the workload's "
                f"shape), got per-row {list(got)}"
            )


def check_state_name(name: str) -> str:
    """A checkpoint name: a plain token (it becomes part of a key under the tenant's
    own workload, never a path or another tenant's)."""
    return check_name("state name", name)


def _number(what: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise InvalidSpec(f"{what} must be a finite number in [{lo:g}, {hi:g}], got {value!r:.40}")
    return float(value)


class TrainCall(Wire, kw_only=True, omit_defaults=True):
    """One training-client call (the ``train_call`` verb): ``op`` on ``workload``,
    ``seq``-th of its calls; a row call then sends ``sample_count`` rows with
    ``put_data`` and ``close_job``, as a tenant's SFT batch."""

    workload: str
    op: Op
    seq: int
    #: forward_backward: the built-in loss and its settings (``LOSS_SETTINGS``).
    loss: str = ""
    settings: dict[str, float] = {}
    #: optim_step: the optimizer's hyper-parameters for this step (None: as before).
    learning_rate: float | None = None
    betas: list[float] | None = None
    weight_decay: float | None = None
    #: optim_step: clip the accumulated gradient's global norm to this (None: no clip).
    grad_clip: float | None = None
    #: save_state, load_state, delete_state: the checkpoint's name.
    name: str = ""
    #: Row calls: the rows the call will put (1..the tenant's max_batch_size).
    sample_count: int = 0
    #: How long to wait in the admission queue (seconds, at most 10).
    wait_s: float = 0.0
    #: The training client's epoch (``ApiReply.client`` of its start): once a newer
    #: client started on the workload, an older one's calls are refused (0: unfenced).
    client: int = 0
    #: Sent again after no reply (the control plane restarted): the job this client's
    #: call ``seq`` already has is answered instead of reserving another.
    again: bool = False

    def __post_init__(self) -> None:
        check_name("workload", self.workload)
        if isinstance(self.client, bool) or not isinstance(self.client, int) or not 0 <= self.client < MAX_SEQ:
            raise InvalidSpec(f"client must be an integer in 0..2**53, got {self.client!r:.40}")
        if self.op not in OPS:
            raise InvalidSpec(f"op {self.op!r:.40} is not one of {list(OPS)}")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or not 1 <= self.seq < MAX_SEQ:
            raise InvalidSpec(f"seq must be an integer in 1..2**53, got {self.seq!r:.40}")
        if self.op == "forward_backward":
            if self.loss not in LOSS_SETTINGS:
                raise InvalidSpec(f"loss {self.loss!r:.40} is not one of {list(LOSSES)}")
            allowed = LOSS_SETTINGS[self.loss]
            for key, value in self.settings.items():
                if key not in allowed:
                    raise InvalidSpec(
                        f"loss {self.loss!r} takes settings {sorted(allowed)}, not {key!r:.40}"
                    )
                _number(f"{self.loss} setting {key}", value, *allowed[key])
        elif self.loss or self.settings:
            raise InvalidSpec(f"op {self.op!r} takes no loss or settings")
        if self.learning_rate is not None:
            _number("learning_rate", self.learning_rate, 1e-9, 1.0)
        if self.betas is not None:
            if len(self.betas) != 2:
                raise InvalidSpec(f"betas must be two numbers, got {len(self.betas)}")
            for b in self.betas:
                _number("betas", b, 0.0, 0.9999999)
        if self.weight_decay is not None:
            _number("weight_decay", self.weight_decay, 0.0, 1.0)
        if self.grad_clip is not None:
            _number("grad_clip", self.grad_clip, 1e-6, 1e6)
        optim = (self.learning_rate, self.betas, self.weight_decay, self.grad_clip)
        if self.op != "optim_step" and any(x is not None for x in optim):
            raise InvalidSpec(f"op {self.op!r} takes no optimizer settings")
        if self.op in STATE_OPS:
            check_state_name(self.name)
        elif self.name:
            raise InvalidSpec(f"op {self.op!r} takes no state name")
        if self.op in ROW_OPS:
            if isinstance(self.sample_count, bool) or not 1 <= self.sample_count <= 1 << 20:
                raise InvalidSpec(f"op {self.op!r} needs sample_count >= 1, got {self.sample_count!r:.40}")
        elif self.sample_count:
            raise InvalidSpec(f"op {self.op!r} carries no rows (sample_count must be 0)")
        if not (isinstance(self.wait_s, (int, float)) and math.isfinite(self.wait_s)):
            raise InvalidSpec("wait_s must be a finite number")

    def extra(self) -> dict[str, str]:
        """The job metadata's ``extra`` that carries this call to the actor."""
        return {"op": self.op, "seq": str(self.seq), "client": str(self.client),
                "call": msgspec.json.encode(msgspec.structs.replace(self, wait_s=0.0, again=False)).decode()}

    @staticmethod
    def from_extra(extra: dict[str, str]) -> TrainCall:
        """The call a custom job carries (checked again: the actor trusts no field)."""
        raw = extra.get("call")
        if not raw:
            raise InvalidSpec("this custom job carries no training call")
        try:
            return msgspec.json.decode(raw.encode(), type=TrainCall)
        except msgspec.ValidationError as e:
            raise InvalidSpec(f"malformed training call: {e}") from e


class TrainResultQuery(Wire, kw_only=True, omit_defaults=True):
    """The ``train_result`` verb: the result of call job ``job_id`` of ``workload``,
    waiting up to ``wait_s`` (at most 20 s) for it; without ``job_id``: the
    sequence number of the workload's last call applied or still to apply
    (``ApiReply.last_seq``)."""

    workload: str
    job_id: str = ""
    wait_s: float = 0.0
    #: Without ``job_id``: a new training client starts and takes the workload over
    #: (``ApiReply.client``: its epoch, which its calls carry).
    start: bool = False


class TrainResult(Wire, kw_only=True, omit_defaults=True):
    """What one applied call answered (kept by the actor under the call's job id,
    so a re-delivered call answers it again instead of applying twice)."""

    job_id: str
    seq: int
    op: str
    #: forward_backward / backward: the loss (backward: the one the client computed: None).
    loss: float | None = None
    metrics: dict[str, float] = {}
    #: forward: the head's outputs (``GAUSSIAN_OUTPUTS`` / ``FLOW_OUTPUTS``).
    outputs: dict[str, TensorBytes] = {}
    #: The policy version after the call (optim_step: the one it published).
    version: int = 0
    #: list_states: the workload's checkpoint names.
    states: list[str] = []
    #: The call failed (its module unchanged); the calls after it still apply.
    error: ErrorBody | None = None
