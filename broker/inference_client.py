"""The Inference Queue's client: ask for actions over NATS request-reply.

Torch-free (numpy and msgpack only), so the tenant SDK can use it; the
engines that answer live in ``joynexus.agents.inference``. A tenant's request
travels on its own subject, ``<ns>.infer.<model>.<tenant>`` (the only inference
subject its NATS user may publish to). Errors come back as the engine's
classes (unknown tenant or version, incompatible schema, bad shapes or
values, permission denied).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from joynexus.broker import rpc, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import check_token
from joynexus.schemas.errors import PayloadTooLarge, Timeout, Unavailable
from joynexus.schemas.inference import (
    InferError,
    InferReply,
    InferRequest,
    InferResult,
    Observation,
    TensorBytes,
    decode_msgpack,
    encode_msgpack,
)


class _HasSignature(Protocol):
    def signature(self) -> str: ...


def _result(data: bytes) -> InferResult:
    """The engine's result, or its error raised as the engine's class."""
    reply: InferReply = decode_msgpack(data, InferReply, what="inference reply")
    if isinstance(reply, InferError):
        raise reply.to_exception()
    return reply


class InferenceClient:
    """Ask the Inference Queue for actions; errors come back as the engine's classes."""

    def __init__(
        self,
        broker: Broker,
        *,
        base_model: str = "qwen2.5-vl-tiny",
        timeout_s: float = 10.0,
        retry_for_s: float = 0.0,
        fast: bool = True,
        service: bool = True,
    ) -> None:
        """``retry_for_s``: keep retrying a request that found no engine, that an
        engine dropped (it died mid-batch) or that its engine refused as
        overloaded, for up to this long (inference is idempotent); 0 = fail at once.
        ``fast``: ask through the connection's fast path (False: nats-py's request).
        ``service``: an agent asking for a tenant (the agents' subject, replies in the
        agents' inboxes); False: the tenant itself (its own subject and inboxes)."""
        self.b = broker
        self.subject = broker.names.service_infer if service else broker.names.infer
        self.base_model = base_model
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.retry = rpc.inference_policy(retry_for_s)
        # The connection's fast path (docs/ARCHITECTURE.md, "The Inference Queue").
        self._request = broker.fastpath().request if fast else None

    async def request(
        self,
        tenant_id: str,
        *,
        schema: str | _HasSignature,
        images: Mapping[str, Any],
        instruction: str | Sequence[str],
        state: Any,
        history: Any | None = None,
        workload: str = "default",
        policy_version: int | None = None,
        session_id: str = "",
        noise: Any | None = None,
        timeout_s: float | None = None,
        base_model: str | None = None,
    ) -> InferResult:
        """The full reply (actions, version served, batch info, timings)."""
        check_token("tenant", tenant_id)  # a subject token: fail here, not at the broker
        req = InferRequest(
            tenant_id=tenant_id,
            workload=workload,
            session_id=session_id,
            schema_signature=schema if isinstance(schema, str) else schema.signature(),
            policy_version=policy_version,
            observation=Observation(
                images={slot: TensorBytes.from_array(x) for slot, x in images.items()},
                instruction=instruction if isinstance(instruction, str) else list(instruction),
                state=TensorBytes.from_array(state),
                history=None if history is None else TensorBytes.from_array(history),
            ),
            noise=None if noise is None else TensorBytes.from_array(noise),
        )
        model = base_model or self.base_model
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return await self._once(model, encode_msgpack(req), tenant_id, timeout, self.retry)

    async def _once(
        self, model: str, payload: bytes, tenant_id: str, wait_s: float,
        retry: rpc.RetryPolicy = rpc.ONCE,
    ) -> InferResult:
        try:
            return await rpc.call(
                self.b,
                self.subject(model, tenant_id),
                payload,
                _result,
                timeout_s=wait_s,
                # no trace to carry (tracing off): no header block to write and parse
                headers=tracing.inject() or None,
                retry=retry,
                request=self._request,
            )
        except rpc.NoResponders as e:  # worded here: no closure on the hot path
            raise Unavailable(
                f"no inference engine serves {model!r}; is `joynexus agent inference` running?"
            ) from e.__cause__
        except rpc.NoReply as e:
            raise Timeout(
                f"no inference reply for tenant {tenant_id!r} within {wait_s:g}s"
            ) from e.__cause__

    async def act(self, tenant_id: str, **kw: Any) -> np.ndarray:
        """Actions ``[B, horizon, action_dim]`` (``[B]`` for value heads); same arguments as
        ``request``. A batch over the server's message limit (``PayloadTooLarge``) is
        asked in halves of its rows, one after the other, each half pinned to the policy
        version that served the first: every row gets the same version."""
        actions, _ = await self._act_rows(tenant_id, kw)
        return actions

    async def _act_rows(self, tenant_id: str, kw: dict[str, Any]) -> tuple[np.ndarray, int]:
        try:
            r = await self.request(tenant_id, **kw)
        except PayloadTooLarge:
            halves = row_halves(kw)
            if halves is None:  # one row over the limit: nothing to split
                raise
            first, version = await self._act_rows(tenant_id, halves[0])
            second, _ = await self._act_rows(tenant_id, {**halves[1], "policy_version": version})
            return np.concatenate([first, second]), version
        return r.actions.to_array("actions"), r.policy_version


def row_halves(kw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``request``'s arguments as two requests of half the rows each; None when they
    hold one row, or anything batched whose rows do not match ``state``'s (the engine
    refuses those whole, so they are sent as they are)."""
    state = np.asarray(kw["state"])
    if state.ndim != 2 or len(state) < 2:
        return None
    n, mid = len(state), len(state) // 2
    images = {slot: np.asarray(x) for slot, x in kw["images"].items()}
    extra = {k: np.asarray(kw[k]) for k in ("history", "noise") if kw.get(k) is not None}
    instruction = kw.get("instruction", "")
    if any(x.ndim < 1 or len(x) != n for x in (*images.values(), *extra.values())) or (
        not isinstance(instruction, str) and len(instruction) != n
    ):
        return None
    halves = []
    for lo, hi in ((0, mid), (mid, n)):
        part = {**kw, **{k: x[lo:hi] for k, x in extra.items()}, "state": state[lo:hi],
                "images": {slot: x[lo:hi] for slot, x in images.items()}}
        if not isinstance(instruction, str):
            part["instruction"] = list(instruction)[lo:hi]
        halves.append(part)
    return halves[0], halves[1]
