"""The control plane's hook that publishes version 1 of a new workload's action
module: fresh weights, or a copy of a version of another of the tenant's
workloads (SFT then RL); an evaluation publishes nothing, its version is checked.

Light: the checks and the copy need no torch (a copy is the source version's
safetensors bytes with their header retagged, :func:`retag_safetensors`). Only
fresh weights do (a head built and initialised: :func:`publish_fresh`, imported
lazily). The control role runs ``PolicyInitializer(b, remote=True)``, which asks
for fresh weights at the actor role's endpoint (:class:`PolicyInitService`,
``<ns>.sched.init_policy``, served by the actor next to its training loop) with the
workload's schema and normalisation statistics read here, so the actor's host
needs no access to the tenant's dataset (except a workload's ``init_from_checkpoint``,
a LeRobot checkpoint the actor reads to start the head's expert from). In-process (tests, benches)
``PolicyInitializer(b)`` builds them itself.

See docs/ARCHITECTURE.md ("Workloads, from the SDK to a new policy version",
"Light roles").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from joynexus.agents.featureschema import (
    FeatureSchema,
    feature_dim,
    feature_schema_of,
    schema_from_spec,
    schema_spec,
)
from joynexus.agents.producers.schema import normalization_stats, workload_schema
from joynexus.broker import rpc
from joynexus.broker.connection import Broker
from joynexus.broker.fastpath import sync_server
from joynexus.broker.policy import PolicyRecords
from joynexus.broker.responder import Server
from joynexus.schemas.base import Wire, decode, encode
from joynexus.schemas.errors import InvalidSpec, Unavailable
from joynexus.schemas.inference import FeatureSchemaSpec, PolicyRecord
from joynexus.schemas.scheduler import ErrorBody
from joynexus.schemas.workloads import WorkloadRecord, WorkloadSpec

log = logging.getLogger(__name__)

#: Normalisation statistics: ``{"observation.state": {"mean": [...], ...}, "action": ...}``.
Stats = dict[str, dict[str, list[float]]]


class InitRequest(Wire, kw_only=True):
    """Fresh weights for version 1 of ``record``'s policy, of ``schema``, normalised
    by ``normalization`` (both read by the control plane)."""

    record: WorkloadRecord
    schema: FeatureSchemaSpec
    normalization: Stats = {}


class InitReply(Wire, kw_only=True):
    signature: str = ""
    error: ErrorBody | None = None


#: Asking the actor for fresh weights: nobody serving yet (the actor role starting:
#: it builds its backbone first) or a lost reply is asked again for 20 s; asking
#: twice is harmless (version 1 published already is a retried create). With the
#: per-call timeout (8 s) the control plane answers within the SDK's 30 s.
INIT_RETRY = rpc.RetryPolicy(
    "policy_init",
    attempts=0,
    deadline_s=20.0,
    base_s=0.2,
    cap_s=2.0,
    retry_on=(rpc.NoResponders, rpc.NoReply),
)


class PolicyInitializer:
    """Publishes version 1 of a new workload's policy (the control plane's hook).

    ``remote``: fresh weights come from the actor role's endpoint (the control role:
    no torch in its process); otherwise they are built here."""

    def __init__(self, broker: Broker, *, remote: bool = False, timeout_s: float = 8.0) -> None:
        self.b = broker
        self.records = PolicyRecords(broker)
        self.remote = remote
        self.timeout_s = timeout_s

    async def __call__(self, record: WorkloadRecord) -> str:
        spec = record.spec
        schema, _ = await asyncio.to_thread(workload_schema, spec)
        if spec.task_type == "eval":  # evaluates an existing version: check it, publish nothing
            src = await self.records.get(record.tenant_id, spec.init_from_workload, spec.init_from)
            check_eval_source(src, spec, schema)
            return src.schema_signature
        if spec.init_from_workload:
            src = await self.records.get(record.tenant_id, spec.init_from_workload, spec.init_from)
            await self._copy(record, schema, src)
            return schema.signature()
        if spec.init_from_export:
            data, manifest = await asyncio.to_thread(read_export, spec.init_from_export)
            await self._import(record, schema, data, manifest)
            return schema.signature()
        stats = await asyncio.to_thread(normalization_stats, spec)
        if self.remote:
            return await self._ask(record, schema, stats)
        await publish_fresh(self.b, record, schema, stats)
        return schema.signature()

    async def _copy(self, record: WorkloadRecord, schema: FeatureSchema, src: PolicyRecord) -> None:
        """Version 1 as a copy of ``src``'s weights (SFT then RL): same head, same schema."""
        what = f"{record.spec.init_from_workload!r} v{src.version}"
        if src.base_model != record.spec.base_model:
            raise InvalidSpec(
                f"cannot start {record.spec.name!r} from {what}: it was trained on "
                f"{src.base_model}, this workload runs on {record.spec.base_model}"
            )
        head_config = copied_head_config(
            what, src.head_type, src.head_config, feature_schema_of(src).signature(),
            record.spec, schema,
        )
        await self._publish_v1(
            record, schema, await self.records.load_weights(src), src.head_type, head_config,
            what=f"{src.tenant_id}.{src.workload} v{src.version}",
        )

    async def _import(
        self, record: WorkloadRecord, schema: FeatureSchema, data: bytes, manifest: dict[str, Any]
    ) -> None:
        """Version 1 from an exported head (``init_from_export``): the manifest must
        name this workload's head, width, sample layout and base model, and the
        weights must be well-formed safetensors of a bounded header."""
        spec = record.spec
        what = f"the exported head {spec.init_from_export!r}"
        head_type, head_config = manifest.get("action_module"), manifest.get("head_config")
        if not isinstance(head_type, str) or not isinstance(head_config, dict):
            raise InvalidSpec(f"{what}: its manifest.json names no action_module and head_config; export it again")
        if manifest.get("base_model") != spec.base_model:
            raise InvalidSpec(
                f"cannot start {spec.name!r} from {what}: it was trained on "
                f"{str(manifest.get('base_model'))[:64]!r}, this workload runs on {spec.base_model}"
            )
        signature = manifest.get("schema_signature")
        if not isinstance(signature, str) or len(signature) > 4096:
            signature = ""  # names no layout: refused below as another one
        head_config = copied_head_config(what, head_type, head_config, signature, spec, schema)
        check_safetensors(data, what=what)
        await self._publish_v1(record, schema, data, head_type, head_config, what=what)

    async def _publish_v1(
        self,
        record: WorkloadRecord,
        schema: FeatureSchema,
        data: bytes,
        head_type: str,
        head_config: dict[str, Any],
        *,
        what: str,
    ) -> None:
        weights = retag_safetensors(
            data, {"version": "1", "config": json.dumps(head_config)}, what=what
        )
        with contextlib.suppress(InvalidSpec):  # v1 exists: a retried create
            await self.records.publish_weights(
                record.tenant_id,
                record.spec.name,
                lambda _v: weights,
                head_type=head_type,
                head_config=head_config,
                feature_schema=schema_spec(schema),
                schema_signature=schema.signature(),
                base_model=record.spec.base_model,
                version=1,
            )

    async def _ask(self, record: WorkloadRecord, schema: FeatureSchema, stats: Stats) -> str:
        def unanswered(e: Unavailable) -> Unavailable:
            return Unavailable(
                f"no actor published version 1 of {record.spec.name!r} within "
                f"{INIT_RETRY.deadline_s:.0f}s ({type(e.__cause__ or e).__name__}): fresh "
                "weights are built by the actor role; is `joynexus agent actor` running?"
            )

        reply = await rpc.call(
            self.b,
            self.b.names.policy_init,
            encode(InitRequest(record=record, schema=schema_spec(schema), normalization=stats)),
            rpc.checked(InitReply, "policy init reply"),
            timeout_s=self.timeout_s,
            retry=INIT_RETRY,
            unanswered=unanswered,
        )
        return reply.signature


# ---------------------------------------------------------------- pure decisions
def check_eval_source(src: PolicyRecord, spec: WorkloadSpec, schema: FeatureSchema) -> None:
    """An evaluation's version must act in its env: same backbone inputs, state and
    action dims (InvalidSpec naming both otherwise)."""
    if feature_schema_of(src).backbone_key() != schema.backbone_key() or (
        src.feature_schema.state_dim,
        src.feature_schema.action_dim,
    ) != (schema.state_dim, schema.action_dim):
        raise InvalidSpec(
            f"{spec.init_from_workload!r} v{src.version} ({src.schema_signature}) cannot act in "
            f"{spec.env} ({schema.signature()}): cameras, image size, state and action dims must match"
        )


def copied_head_config(
    what: str,
    head_type: str,
    head_config: dict[str, Any],
    signature: str,
    spec: WorkloadSpec,
    schema: FeatureSchema,
) -> dict[str, Any]:
    """The head config of a copy of a trained head (``what``: another workload's
    version, or an exported head) for ``spec``: its own, with the new workload's
    sizes and seed (InvalidSpec where the weights would not fit: another head,
    sample layout, hidden width or ``expert_state``)."""
    if signature != schema.signature() or head_type != spec.action_module:
        raise InvalidSpec(
            f"cannot start {spec.name!r} from {what}: its head "
            f"({head_type[:64]}, {signature[:400]}) differs from this workload's "
            f"({spec.action_module}, {schema.signature()})"
        )
    hidden = head_config.get("hidden")
    if hidden != spec.head_hidden:
        raise InvalidSpec(
            f"cannot start {spec.name!r} from {what}: its head "
            f"is {str(hidden)[:16]} wide, this workload's head_hidden is {spec.head_hidden}; give the same"
        )
    state = head_config.get("expert_state", "prompt")
    if state != spec.expert_state:
        raise InvalidSpec(
            f"cannot start {spec.name!r} from {what}: its head reads the state as {str(state)[:16]!r}, "
            f"this workload's expert_state is {spec.expert_state!r}; give the same"
        )
    return {
        **head_config,
        "expert_state": spec.expert_state,
        "feature_dim": feature_dim(spec.base_model),
        "state_dim": schema.state_dim,
        "action_dim": schema.action_dim,
        "action_horizon": schema.action_horizon,
        "hidden": spec.head_hidden,
        "seed": spec.seed,
    }


#: The largest safetensors header read (a head's is a few KiB).
MAX_HEADER_BYTES = 16 << 20


#: safetensors dtypes and their sizes in bytes.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1}


def check_safetensors(data: bytes, *, what: str = "weights") -> None:
    """``data`` is well-formed safetensors: a bounded JSON header whose every
    tensor has a known dtype and a shape whose bytes are exactly its offsets,
    which lie inside the data and together cover it (InvalidSpec otherwise). The
    loader (strict ``load_state_dict``) then checks names and shapes against the head."""
    def bad(reason: str) -> InvalidSpec:
        return InvalidSpec(f"{what}: head.safetensors is not well-formed ({reason}); export it again")

    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if n < 2 or n > min(len(data) - 8, MAX_HEADER_BYTES):
        raise bad("header length")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        raise bad("header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("header")
    body = len(data) - 8 - n
    spans = []
    for key, t in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(t, dict) or t.get("dtype") not in _DTYPE_BYTES:
            raise bad(f"tensor {str(key)[:64]!r}: dtype")
        shape, offsets = t.get("shape"), t.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise bad(f"tensor {str(key)[:64]!r}: shape")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= body):
            raise bad(f"tensor {str(key)[:64]!r}: offsets")
        size = _DTYPE_BYTES[t["dtype"]]
        for d in shape:
            size *= d
        if offsets[1] - offsets[0] != size:
            raise bad(f"tensor {str(key)[:64]!r}: {size} bytes for its shape, offsets span "
                      f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1]))
    if not spans:
        raise bad("no tensors")
    end = 0
    for a, b in sorted(spans):
        if a != end:
            raise bad("tensors overlap or leave gaps")
        end = b
    if end != body:
        raise bad("bytes after the last tensor")


def read_export(path: str) -> tuple[bytes, dict[str, Any]]:
    """An exported head's weights and manifest (``path`` already resolved inside
    the tenant's space by the control plane: ``agents.datasets.resolve_export``)."""
    from pathlib import Path

    from joynexus.agents.datasets import EXPORT_FILES

    root = Path(path)
    try:
        manifest = json.loads((root / "manifest.json").read_bytes()[: EXPORT_FILES["manifest.json"]])
        with open(root / "head.safetensors", "rb") as f:
            data = f.read(EXPORT_FILES["head.safetensors"] + 1)
    except (OSError, ValueError) as e:
        raise InvalidSpec(
            f"the exported head {path!r} could not be read ({type(e).__name__}); export it again"
        ) from None
    if not isinstance(manifest, dict):
        raise InvalidSpec(f"the exported head {path!r}: manifest.json is not an object; export it again")
    if len(data) > EXPORT_FILES["head.safetensors"]:
        raise InvalidSpec(f"the exported head {path!r}: head.safetensors is too large")
    return data, manifest


def retag_safetensors(data: bytes, metadata: dict[str, str], *, what: str = "weights") -> bytes:
    """``data`` (safetensors bytes) with ``metadata`` merged into its header's
    ``__metadata__``; the tensors' bytes are kept as they are (their offsets count
    from the end of the header, which is padded to 8 bytes as safetensors writes it)."""
    try:
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 or n > min(len(data) - 8, MAX_HEADER_BYTES):
            raise ValueError("header length")
        header = json.loads(data[8 : 8 + n])
        if not isinstance(header, dict):
            raise ValueError("header")
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict):
            raise ValueError("metadata")
    except ValueError as e:
        raise InvalidSpec(f"{what}: the weights are not safetensors ({e}); republish them") from None
    header["__metadata__"] = {**meta, **metadata}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


# ---------------------------------------------------------------- fresh weights (torch)
async def publish_fresh(b: Broker, record: WorkloadRecord, schema: FeatureSchema, stats: Stats) -> None:
    """Build ``record``'s head with fresh weights and ``stats`` (its expert's from a LeRobot
    checkpoint: ``init_from_checkpoint``) and publish it as version 1 (a version 1 there
    already is a retried create). Imports torch."""
    from joynexus.agents.models.policyio import PolicyStore, fresh_module

    spec = record.spec
    module = fresh_module(record.tenant_id, spec, schema, stats)
    if spec.init_from_checkpoint:  # resolved inside the tenant's space by the control plane
        from joynexus.agents.models.families import init_expert_head

        await asyncio.to_thread(init_expert_head, module.head, spec.init_from_checkpoint)
    with contextlib.suppress(InvalidSpec):  # v1 exists: a retried create
        await PolicyStore(b).publish(
            record.tenant_id, spec.name, module, schema, spec.base_model, version=1
        )


class PolicyInitService:
    """The endpoint that publishes fresh version 1 weights (``<ns>.sched.init_policy``,
    micro service ``<ns>-init``, one queue group: any actor answers). The actor role
    serves it; the control plane asks (``PolicyInitializer(b, remote=True)``)."""

    def __init__(self, broker: Broker, *, instance: str) -> None:
        self.b = broker
        self.instance = instance
        self.rpc = Server(
            broker,
            "policy-init",
            error_reply=lambda code, message: InitReply(error=ErrorBody(code=code, message=message)),
            clip=None,
            internal="internal error: {error}",
        )
        self._service: Any = None
        self.served = 0

    async def start(self) -> None:
        from nats.micro import add_service

        n = self.b.names
        self._service = await add_service(
            self.b.nc,
            name=n.policy_init_service,
            version="0.1.0",
            description="JoyNexus policy initialisation: version 1 of a new workload's head",
            metadata={"instance": self.instance},
        )
        await self._service.add_endpoint(
            name="init_policy", subject=n.policy_init, handler=self._on_request
        )
        await sync_server(self.b.nc)  # on the server before start() returns

    async def _on_request(self, request: Any) -> None:
        self.rpc.serve(request, lambda: self._handle(request.data), span="policy.init")

    async def _handle(self, data: bytes) -> InitReply:
        req = decode(data or b"{}", InitRequest, what="InitRequest")
        schema = schema_from_spec(req.schema)
        await publish_fresh(self.b, req.record, schema, req.normalization)
        self.served += 1
        return InitReply(signature=schema.signature())

    async def stop(self) -> None:
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
            self._service = None
        await self.rpc.stop()


__all__ = [
    "INIT_RETRY",
    "InitReply",
    "InitRequest",
    "PolicyInitService",
    "PolicyInitializer",
    "check_eval_source",
    "check_safetensors",
    "copied_head_config",
    "publish_fresh",
    "read_export",
    "retag_safetensors",
]
