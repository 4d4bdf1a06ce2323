"""The actor's loop for a training client's calls (``task_type="custom"`` jobs).

A call is one job; the actor applies a workload's calls in their sequence
order, each exactly once: the tenant's committed state holds the last applied
``seq`` and the latest results by job id (``calls.CallLog``), committed with
the module, its optimizer and the gradients accumulated since the last
``optim_step`` by the same compare-and-set as a training step
(``broker.trainerstate``). A call re-delivered after a crash (its job id in
the log) answers its stored result and completes without applying again; a
call whose ``seq`` was applied already fails with a reason and changes nothing.
A call leased before an earlier one applied (another actor holds that one, or
an actor that died holding it: its lease lapses and it is leased again) is
held, its lease renewed, and tried again once the earlier calls applied; calls
that ended unapplied (the scheduler fails a call whose leases kept lapsing) are
passed over; only a gap no call fills fails. A call that fails on its
own data (non-finite gradients, wrong loss for the head) is recorded as
failed, so the calls after it still apply in order.

The call's result goes to the trainer KV (``broker.trainercalls``), where the
control plane answers ``train_result``; ``optim_step`` and ``load_state``
publish a new policy version first (inference and evaluation see it).

See docs/ARCHITECTURE.md, "The training client".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from joynexus.agents.actor.calls import apply_rows, optim_step, zero_grad
from joynexus.agents.actor.decisions import infrastructure
from joynexus.agents.models.features import canonicalize_request
from joynexus.agents.models.grouped import TrainItem, shared_features
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import feature_schema_of
from joynexus.broker import metrics
from joynexus.broker.trainercalls import CallStore
from joynexus.schemas.errors import Conflict, InvalidSpec, JoyNexusError
from joynexus.schemas.inference import TensorBytes, encode_msgpack
from joynexus.schemas.jobs import TERMINAL_STATES, JobState, TrainingJob
from joynexus.schemas.samples import STATE_FIELD, image_field
from joynexus.schemas.scheduler import ErrorBody
from joynexus.schemas.training import HEAD_FAMILIES, ROW_OPS, TrainCall, call_fields

if TYPE_CHECKING:
    from joynexus.agents.actor.state import TenantState

log = logging.getLogger(__name__)

__all__ = ["DEFER_POLL_S", "CallTodo", "CustomCalls", "compute_call"]

#: How often a call held for an earlier one is tried again (when nothing else is pending).
DEFER_POLL_S = 0.25


class CustomCalls:
    """Mixed into :class:`joynexus.agents.actor.agent.Actor` (its attributes)."""

    b: Any
    backbone: Any
    sched: Any
    tq: Any
    policies: Any
    trainer_state: Any
    tenants: dict[tuple[str, str], Any]
    #: Call results and named checkpoints (``broker.trainercalls``).
    calls: CallStore
    #: Calls held until the calls before them applied (the actor's loop retries them).
    deferred_calls: list[TrainingJob]

    async def tenant(self, tenant_id: str, workload: str) -> TenantState:  # the Actor's
        raise NotImplementedError

    async def _commit(self, job: TrainingJob, st: TenantState) -> bool:  # the Actor's
        raise NotImplementedError

    async def apply_call(self, job: TrainingJob) -> None:
        """Apply one call job exactly once, in order, alone (see the module)."""
        todo = await self.prepare_call(job)
        if todo is not None and todo.item is not None:
            feats = await asyncio.to_thread(shared_features, self.backbone, [todo.item])
            await self.settle_call(todo, await asyncio.to_thread(compute_call, todo, feats[0]))

    async def prepare_call(self, job: TrainingJob) -> CallTodo | None:
        """Take a call job in hand: a re-delivered or out-of-order call is answered
        here, a call without rows is applied here; a row call comes back with its
        item, to share a base forward with the group's other work (``compute_call``,
        then ``settle_call``)."""
        try:
            st = await self.tenant(job.tenant_id, job.workload)
            call = TrainCall.from_extra(job.metadata.extra)
        except JoyNexusError as e:
            if infrastructure(e):  # the machine, not the call: applied by the next lease
                raise
            await self._fail_call(job, e)
            return None
        stored = st.calls.results.get(job.job_id)
        if stored is not None:  # applied before a crash: answer it again, apply nothing
            await self.calls.put_result(job.tenant_id, job.workload, job.job_id, stored)
            await self._complete_call(job, st.module.version)
            return None
        expected = st.calls.last_seq + 1
        if call.seq > expected:
            earlier = await self._earlier_calls(job, expected, call.seq)
            if earlier == "open":
                await self._defer_call(job)  # an earlier call is still to apply (maybe elsewhere)
                return None
            if earlier == "ended":  # failed unapplied (by the scheduler): the rest go on
                expected = call.seq
        if call.seq != expected:
            why = "was applied already" if call.seq < expected else f"comes before call {expected}"
            await self._fail_call(job, InvalidSpec(
                f"call {call.seq} ({call.op}) {why}: calls apply in order, once; "
                f"the workload's last applied call is {st.calls.last_seq}"))
            return None
        try:
            if call.op in ROW_OPS:
                return CallTodo(job, st, call, *await self._call_item(job, st, call))
            result: dict[str, Any] | JoyNexusError = await self._run_call(job, st, call)
        except Exception as e:
            result = _as_call_error(e, call)
        await self.settle_call(CallTodo(job, st, call, None, {}), result)
        return None

    async def settle_call(self, todo: CallTodo, result: dict[str, Any] | JoyNexusError) -> None:
        """Record the call's result with the tenant's state (one commit), answer it,
        publish if it made a version, and complete or fail its job."""
        job, st, call = todo.job, todo.st, todo.call
        error = result if isinstance(result, JoyNexusError) else None
        fields = {"error": ErrorBody(code=error.code, message=str(error)[:2000])} if error else result
        assert isinstance(fields, dict)
        data = encode_msgpack({"job_id": job.job_id, "seq": call.seq, "op": call.op,
                               "version": st.module.version, **fields})
        gone = st.calls.record(job.job_id, call.seq, data)
        if not await self._commit(job, st):
            return  # another actor committed since: void; the job is retried on its state
        await self.calls.put_result(job.tenant_id, job.workload, job.job_id, data)
        if gone:
            await self.calls.forget_results(job.tenant_id, job.workload, gone)
        if error is not None:
            await self._fail_call(job, error)
            return
        if call.op in ("optim_step", "load_state"):
            await self._publish(job, st)
        await self._complete_call(job, st.module.version)
        if fields.get("loss") is not None:
            await metrics.emit(self.b, "learning", job.tenant_id, workload=job.workload,
                               job_id=job.job_id, task_type="custom", op=call.op,
                               version=st.module.version, loss=fields["loss"],
                               samples=job.sample_count)

    async def _run_call(self, job: TrainingJob, st: TenantState, call: TrainCall) -> dict[str, Any]:
        """A call without rows: its effect on the tenant's state, and its result's fields."""
        module = st.module
        if call.op == "optim_step":
            return {"metrics": await asyncio.to_thread(optim_step, module, call)}
        if call.op == "zero_grad":
            zero_grad(module)
            return {}
        if call.op == "list_states":
            return {"states": await self.calls.names(job.tenant_id, job.workload)}
        if call.op == "save_state":
            blob = await asyncio.to_thread(_module_blob, module)
            await self.calls.save(job.tenant_id, job.workload, call.name, blob, module.version)
            return {}
        if call.op == "delete_state":
            if not await self.calls.delete(job.tenant_id, job.workload, call.name):
                raise InvalidSpec(f"workload {job.workload!r} has no state named {call.name!r}")
            return {}
        # load_state: the saved weights and optimizer, as a new version of this workload
        blob = await self.calls.load(job.tenant_id, job.workload, call.name)
        loaded = await asyncio.to_thread(_module_from_blob, blob)
        if loaded.head_type != module.head_type or loaded.cfg != module.cfg:
            raise InvalidSpec(f"state {call.name!r} holds another head ({loaded.head_type})")
        version = module.version
        module.load_state_dict(loaded.state_dict())
        module.version = version + 1
        zero_grad(module)
        return {}

    async def _call_item(self, job: TrainingJob, st: TenantState, call: TrainCall
                         ) -> tuple[TrainItem, dict[str, np.ndarray]]:
        """A row call's rows (Training Queue) as an item of the group's base forward."""
        schema = feature_schema_of(st.record)
        family = HEAD_FAMILIES.get(st.module.head_type)
        if family is None:
            raise InvalidSpec(f"head {st.module.head_type!r} is not driven by the training client")
        required, optional = call_fields(call.op, call.loss, family)
        fields = [STATE_FIELD, *[image_field(c) for c in schema.camera_slots],
                  *sorted(required), *sorted(optional)]
        meta = await self.tq.async_get_meta(
            fields, job.sample_count or 1 << 30, tenant_id=job.tenant_id,
            partition_id=job.partition_id, task_name=f"actor-{job.attempt}",
        )
        if not meta.rows:
            raise InvalidSpec(f"call job {job.job_id}: its partition has no rows with fields {fields}")
        data = await self.tq.async_get_data(meta)
        batch = canonicalize_request(
            schema, {c: data[image_field(c)] for c in schema.camera_slots},
            job.metadata.extra.get("instruction", ""), data[STATE_FIELD],
        )
        return TrainItem(tenant=st.module, batch=batch, target=torch.empty(0)), data

    async def _publish(self, job: TrainingJob, st: TenantState) -> None:
        try:
            st.record = await self.policies.publish(
                job.tenant_id, job.workload, st.module, feature_schema_of(st.record),
                st.record.base_model, version=st.module.version,
            )
        except InvalidSpec:
            pass  # published before a crash
        except Conflict:
            st.record = await self.policies.latest(job.tenant_id, job.workload)

    async def _earlier_calls(self, job: TrainingJob, first: int, seq: int) -> str:
        """The calls of ``job``'s workload numbered ``first`` .. ``seq - 1``: ``"open"`` if
        one is still to apply (ready, or leased: by another actor, or by one that died
        holding it), ``"ended"`` if each of them ended unapplied (failed or dropped
        without reaching the tenant's state: the scheduler fails a call whose leases
        kept lapsing), else ``"gap"`` (a number no call has: nothing can fill it)."""
        ended: set[int] = set()
        for j in await self.sched.list_jobs(job.tenant_id, workload=job.workload,
                                            generation=job.generation, states=None):
            n = int(j.metadata.extra.get("seq", "0") or 0)
            if j.job_id == job.job_id or j.task_type != "custom" or not first <= n < seq:
                continue
            if j.state not in TERMINAL_STATES:
                return "open"
            if j.state is not JobState.COMPLETED:
                ended.add(n)
        return "ended" if len(ended) == seq - first else "gap"

    async def _defer_call(self, job: TrainingJob) -> None:
        """Keep holding ``job`` (its lease renewed) until the calls before it applied;
        the loop tries it again (``deferred_calls``). A lease already lapsed: let go."""
        try:
            self.deferred_calls.append(await self.sched.touch(job))
        except JoyNexusError as e:
            log.info("call job %s: %s (let go; it is leased again)", job.job_id, e)

    async def _complete_call(self, job: TrainingJob, version: int) -> None:
        try:
            await self.sched.complete(job, result_version=version)
        except JoyNexusError as e:  # a lapsed lease, or completed before a crash
            log.warning("call job %s: %s (applied; its result stays)", job.job_id, e)

    async def _fail_call(self, job: TrainingJob, error: JoyNexusError) -> None:
        log.info("call job %s failed: %s", job.job_id, error)
        with contextlib.suppress(JoyNexusError):
            await self.sched.fail(job.job_id, f"actor: {type(error).__name__}: {error}",
                                  attempt=job.attempt)


def _module_blob(module: TenantModule) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    return buf.getvalue()


def _module_from_blob(data: bytes) -> TenantModule:
    import io

    return TenantModule.from_state_dict(torch.load(io.BytesIO(data), weights_only=True))


@dataclass
class CallTodo:
    """A call in hand: its job, its tenant's state, the call, and for a row call the
    item of the base forward and its rows."""

    job: TrainingJob
    st: TenantState
    call: TrainCall
    item: TrainItem | None
    data: dict[str, np.ndarray]


def compute_call(todo: CallTodo, feats: torch.Tensor | JoyNexusError) -> dict[str, Any] | JoyNexusError:
    """On the worker thread: a row call on its rows' features (from a forward shared
    with the group); the result's fields, or the error that left the module as it was."""
    if isinstance(feats, JoyNexusError):
        return feats
    assert todo.item is not None
    try:
        loss, stats, outs = apply_rows(todo.st.module, todo.call, feats.detach(),
                                       todo.item.batch.state_B_S.to(feats.device), todo.data)
    except Exception as e:
        return _as_call_error(e, todo.call)
    return {"loss": loss, "metrics": stats,
            "outputs": {k: TensorBytes.from_array(v) for k, v in outs.items()}}


def _as_call_error(e: Exception, call: TrainCall) -> JoyNexusError:
    """A call's own failure as its typed error; the machine's failures propagate,
    ``Unavailable`` and ``Timeout`` included (a Training Queue read that timed out while
    a host was lost is no answer to the tenant's call: the actor stops, its lease
    lapses, and the call is applied by whoever leases it next)."""
    if infrastructure(e):
        raise e
    if isinstance(e, JoyNexusError):
        return e
    return InvalidSpec(f"call {call.op} raised {type(e).__name__}: {e}")
