"""The training client (Tinker-style primitives) on a ``task_type="custom"`` workload:
``tc = await client.training_client("my-algo")``.

Every call returns an awaitable future at once; several may be in flight; they
apply in the order they were made. One sender task hands the calls to the
service in that order (``train_call``, and for a call with rows ``put_data`` and
``close_job``: each call is a job in the event log, its rows in the Training
Queue), numbered ``seq`` 1, 2, ... after the workload's last call; the
results are awaited concurrently (``train_result``). ``forward_backward_custom``
runs the tenant's loss on this machine: a ``forward`` call, the loss and its
gradients with respect to the outputs with torch here, then a ``backward``
call that carries only those gradients (the service never runs tenant code).

This module needs only the base install; ``forward_backward_custom`` imports torch.
See docs/ARCHITECTURE.md, "The training client".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
from nats.errors import NoRespondersError

from joynexus.schemas.errors import InvalidSpec, Unavailable, error_from_code
from joynexus.schemas.inference import FeatureSchemaSpec, decode_msgpack
from joynexus.schemas.jobs import JobState
from joynexus.schemas.samples import IMAGE_FIELD_PREFIX, STATE_FIELD
from joynexus.schemas.scheduler import FINAL_REFUSALS
from joynexus.schemas.training import (
    HEAD_FAMILIES,
    OUTPUT_GRADS,
    ROW_OPS,
    TrainCall,
    TrainResult,
    TrainResultQuery,
    call_fields,
)
from joynexus.sdk.base import ClientBase
from joynexus.sdk.data import OUTAGE_WAIT_S, DataCalls

__all__ = ["TrainingCalls", "TrainingClient"]

#: How long one train_result request waits for its call's result (the control plane's bound).
RESULT_WAIT_S = 10.0
#: How long a call waits for admission in all (then: the future fails).
ADMISSION_WAIT_S = 600.0

LossFn = Callable[[dict[str, Any], dict[str, Any]], Any]


class TrainingClient:
    """Calls on one custom workload (see the module). Make it with
    ``await client.training_client(workload)``."""

    def __init__(self, client: DataCalls, workload: str, action_module: str, last_seq: int,
                 schema: FeatureSchemaSpec | None = None, epoch: int = 0) -> None:
        self.client = client
        self.workload = workload
        #: The workload's sample layout (cameras, image size, state, action dims, horizon).
        self.schema = schema
        family = HEAD_FAMILIES.get(action_module)
        if family is None:
            raise InvalidSpec(f"the training client drives heads {sorted(HEAD_FAMILIES)}, not {action_module!r}")
        self.family = family
        self.seq = last_seq
        #: This client's epoch on the workload: a newer client's start fences this one.
        self.epoch = epoch
        self._queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None
        #: When the control plane stopped answering train_result (None: it answers).
        self._outage_since: float | None = None

    # ------------------------------------------------------------ the calls
    def forward(self, batch: Mapping[str, Any]) -> asyncio.Future[dict[str, np.ndarray]]:
        """The head's outputs for the rows (Gaussian heads: ``mean`` [B, H, A] in env
        action units, ``log_std`` [B, A] in the same units (the policy is
        N(mean, exp(log_std)), as its rollouts sample it), ``value`` [B]; flow heads: ``velocity``
        [B, H, A] at the rows' ``flow_xt`` [B, H, A] and ``flow_t`` [B])."""
        return self._submit("forward", batch, lambda r: _outputs(r))

    def forward_backward(self, batch: Mapping[str, Any], loss: str = "bc_mse",
                         **settings: float) -> asyncio.Future[dict[str, Any]]:
        """A built-in loss (``bc_mse``, ``ppo``, ``awr``, ``flow_matching``) of the rows;
        its gradients accumulate in the workload's module. -> ``{"loss", "metrics"}``."""
        return self._submit("forward_backward", batch, _loss_of, loss=loss, settings=dict(settings))

    def forward_backward_custom(self, batch: Mapping[str, Any], loss_fn: LossFn) -> asyncio.Future[dict[str, Any]]:
        """``loss_fn(outputs, batch)`` (torch tensors; a scalar tensor) evaluated here on
        the ``forward`` outputs; only d(loss)/d(outputs) goes back, and the service
        accumulates their back-propagation into the module. -> ``{"loss", "metrics"}``."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(("custom", dict(batch), loss_fn, fut))
        self._start()
        return fut

    def optim_step(self, learning_rate: float | None = None, betas: tuple[float, float] | None = None,
                   weight_decay: float | None = None, grad_clip: float | None = None
                   ) -> asyncio.Future[dict[str, Any]]:
        """Apply the accumulated gradients with the workload's AdamW and publish a new
        policy version. -> ``{"version", "metrics"}``."""
        return self._submit("optim_step", None, lambda r: {"version": r.version, "metrics": r.metrics},
                            learning_rate=learning_rate, betas=None if betas is None else list(betas),
                            weight_decay=weight_decay, grad_clip=grad_clip)

    def zero_grad(self) -> asyncio.Future[None]:
        return self._submit("zero_grad", None, lambda r: None)

    def save_state(self, name: str) -> asyncio.Future[None]:
        """Save the module and optimizer as checkpoint ``name`` of this workload."""
        return self._submit("save_state", None, lambda r: None, name=name)

    def load_state(self, name: str) -> asyncio.Future[int]:
        """Load checkpoint ``name`` (weights and optimizer); publishes it as a new version."""
        return self._submit("load_state", None, lambda r: r.version, name=name)

    def list_states(self) -> asyncio.Future[list[str]]:
        return self._submit("list_states", None, lambda r: list(r.states))

    def delete_state(self, name: str) -> asyncio.Future[None]:
        return self._submit("delete_state", None, lambda r: None, name=name)

    async def close(self) -> None:
        """Stop sending (calls not yet sent fail)."""
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(BaseException):
                await self._sender

    # ------------------------------------------------------------ plumbing
    def _submit(self, op: str, batch: Mapping[str, Any] | None, answer: Callable[[TrainResult], Any],
                **fields: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((op, None if batch is None else dict(batch), fields, answer, fut))
        self._start()
        return fut

    def _start(self) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send_all())

    async def _send_all(self) -> None:
        """Send the calls one at a time, in order; their results resolve concurrently."""
        while not self._queue.empty():
            item = self._queue.get_nowait()
            fut = item[-1]
            if fut.cancelled():
                continue
            try:
                if item[0] == "custom":
                    await self._custom(item[1], item[2], fut)
                    continue
                op, batch, fields, answer, _ = item
                job_id = await self._send(op, batch, fields)
                _resolve(fut, self._result(job_id), answer)
            except Exception as e:
                if not fut.done():
                    fut.set_exception(e)

    async def _send(self, op: str, batch: dict[str, Any] | None, fields: dict[str, Any]) -> str:
        """One call to the service, as the next ``seq``; returns its job id."""
        rows = self._rows(op, fields.get("loss", ""), batch) if op in ROW_OPS else None
        n = 0 if rows is None else len(rows[STATE_FIELD])
        call = TrainCall(workload=self.workload, op=op, seq=self.seq + 1, sample_count=n,  # type: ignore[arg-type]
                         client=self.epoch, **{k: v for k, v in fields.items() if v is not None})
        job = await self._admitted(call)
        # (A call asked again may answer a job whose rows went in before: closed already.)
        if rows is not None and job.state is JobState.RESERVED:
            await self.client._send_rows(job, rows)  # aborted on failure: the seq is not used
        self.seq = call.seq
        return job.job_id

    async def _admitted(self, call: TrainCall) -> Any:
        """The call's job. A request with no reply (the control plane restarting) is
        asked again, for ``OUTAGE_WAIT_S``, marked ``again`` when it may have reached
        a control plane (it then answers the job it reserved, not a second one)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ADMISSION_WAIT_S
        again, outage = False, None
        while True:
            wait = min(10.0, max(0.0, deadline - loop.time()))
            try:
                reply = await self.client._api(
                    "train_call", TrainCall(**{**_fields(call), "wait_s": wait, "again": again}),
                    timeout_s=self.client.timeout_s + wait)
            except Unavailable as e:
                outage = outage or loop.time()
                if not self.epoch or loop.time() - outage > OUTAGE_WAIT_S:
                    if not isinstance(e.__cause__, NoRespondersError) or loop.time() >= deadline:
                        raise
                again = again or not isinstance(e.__cause__, NoRespondersError)
                await asyncio.sleep(0.5)
                continue
            outage = None
            if reply.job is not None:
                return reply.job
            if reply.refusal in FINAL_REFUSALS or loop.time() >= deadline:
                raise InvalidSpec(f"workload {self.workload!r} took no call: {reply.refused}")
            if not reply.position:
                await asyncio.sleep(0.05)

    async def _result(self, job_id: str) -> TrainResult:
        """The call's result. A read: asked again while the control plane does not
        answer (for ``OUTAGE_WAIT_S``), so a call in flight outlives its restart."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                reply = await self.client._api(
                    "train_result", TrainResultQuery(workload=self.workload, job_id=job_id, wait_s=RESULT_WAIT_S),
                    timeout_s=self.client.timeout_s + RESULT_WAIT_S,
                )
            except Unavailable:
                outage = self._outage_since or loop.time()
                self._outage_since = outage
                if loop.time() - outage > OUTAGE_WAIT_S:
                    raise
                await asyncio.sleep(0.5)
                continue
            self._outage_since = None
            if reply.data:
                result: TrainResult = decode_msgpack(reply.data, TrainResult, what="training call result")
                if result.error is not None:
                    raise error_from_code(result.error.code, result.error.message)
                return result

    def _rows(self, op: str, loss: str, batch: dict[str, Any] | None) -> dict[str, Any]:
        """The batch's fields this call reads (images, state, its loss's or gradients')."""
        if batch is None or STATE_FIELD not in batch:
            raise InvalidSpec(f"{op} needs a batch with {STATE_FIELD!r} and {IMAGE_FIELD_PREFIX}<camera> fields")
        required, optional = call_fields(op, loss, self.family)
        keep = {STATE_FIELD, *required, *optional}
        rows = {k: v for k, v in batch.items() if k in keep or k.startswith(IMAGE_FIELD_PREFIX)}
        missing = sorted(required - set(rows))
        if missing:
            raise InvalidSpec(f"{op} needs fields {missing}")
        return rows

    async def _custom(self, batch: dict[str, Any], loss_fn: LossFn, fut: asyncio.Future[Any]) -> None:
        """forward, the loss here, backward with d(loss)/d(outputs): two calls in a row."""
        job_id = await self._send("forward", batch, {})
        outs = _outputs(await self._result(job_id))
        loss, grads = await asyncio.to_thread(_client_loss, loss_fn, outs, batch)
        rows = {k: v for k, v in batch.items()}
        rows.update({OUTPUT_GRADS[k]: g for k, g in grads.items()})
        job_id = await self._send("backward", rows, {})
        _resolve(fut, self._result(job_id), lambda r: {"loss": loss, "metrics": dict(r.metrics)})


class TrainingCalls(ClientBase):
    """``training_client`` (a verb of :class:`joynexus.sdk.Client`)."""

    def training_client(self, workload: str) -> asyncio.Future[TrainingClient]:
        """A training client on your ``task_type="custom"`` workload; its calls are
        numbered after the workload's last call made (applied, or still to apply).
        One client at a time: a new one takes the workload over, and the calls of
        an older one are refused from then on (``Conflict``, saying so)."""

        async def go() -> TrainingClient:
            rec = await self._workload_cache(workload)
            if rec.spec.task_type != "custom":
                raise InvalidSpec(f"workload {workload!r} is {rec.spec.task_type}, not custom")
            reply = await self._api("train_result", TrainResultQuery(workload=workload, start=True))
            policy = await self._policy(workload)
            # The Client (a DataCalls too) sends the rows of the calls.
            return TrainingClient(cast(DataCalls, self), workload, rec.spec.action_module, reply.last_seq,
                                  policy.feature_schema, epoch=reply.client)

        return self._future(go())


def _fields(call: TrainCall) -> dict[str, Any]:
    return {f: getattr(call, f) for f in call.__struct_fields__}


def _resolve(fut: asyncio.Future[Any], result: Any, answer: Callable[[TrainResult], Any]) -> None:
    """Resolve ``fut`` with ``answer(await result)`` in a task of its own."""

    async def wait() -> None:
        try:
            value = answer(await result)
        except Exception as e:
            if not fut.done():
                fut.set_exception(e)
            return
        if not fut.done():
            fut.set_result(value)

    task = asyncio.ensure_future(wait())
    _WAITERS.add(task)  # kept alive until it is done
    task.add_done_callback(_WAITERS.discard)


#: Tasks awaiting results (a task nobody references may be collected mid-wait).
_WAITERS: set[asyncio.Task[None]] = set()


def _outputs(result: TrainResult) -> dict[str, np.ndarray]:
    return {k: np.array(t.to_array(k)) for k, t in result.outputs.items()}


def _loss_of(result: TrainResult) -> dict[str, Any]:
    return {"loss": result.loss, "metrics": dict(result.metrics)}


def _client_loss(loss_fn: LossFn, outs: dict[str, np.ndarray], batch: Mapping[str, Any]
                 ) -> tuple[float, dict[str, np.ndarray]]:
    """The tenant's loss on this machine and its gradients w.r.t. each output (zeros
    for an output it does not use)."""
    import torch

    leaves = {k: torch.tensor(v, dtype=torch.float32, requires_grad=True) for k, v in outs.items()}
    tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}
    loss = loss_fn(dict(leaves), tensors)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise InvalidSpec("loss_fn must return a scalar torch tensor")
    loss.backward()
    grads = {k: (t.grad if t.grad is not None else torch.zeros_like(t)).numpy().astype(np.float32)
             for k, t in leaves.items()}
    for k, g in grads.items():
        if not np.isfinite(g).all():
            raise InvalidSpec(f"loss_fn's gradient of {k!r} is not finite")
    return float(loss.detach()), grads
