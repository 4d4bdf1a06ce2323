"""The checks a request passes before it joins a batch, as pure functions.

Tenants are hostile to each other (issue 11): the tenant is the subject's last
token (the broker fences who may publish there) and a payload that claims another
is refused; each request stays within its quota's ``max_infer_rows`` and
``max_instruction_bytes``; and it is validated against its policy (schema
signature, shapes, NaN/inf) on its own, so a bad one gets an error reply and never
touches its batch-mates. See docs/ARCHITECTURE.md ("The Inference Queue").
"""

from __future__ import annotations

import numpy as np
import torch

from joynexus.agents.inference.policies import LoadedPolicy
from joynexus.agents.models.features import (
    FeatureBatch,
    FeatureSchema,
    canonicalize_request,
    wire_view,
)
from joynexus.broker import metrics
from joynexus.broker.subjects import SVC_INFER, check_token
from joynexus.schemas.errors import InvalidSpec, QuotaExceeded, ShapeMismatch
from joynexus.schemas.inference import IncompatibleSchema, InferRequest, Observation
from joynexus.schemas.quotas import Quota


def subject_tenant(subject: str) -> str | None:
    """The tenant a request's subject names (its last token); None if it names none."""
    tenant = subject.rsplit(".", 1)[-1]
    try:
        check_token("tenant", tenant)
    except InvalidSpec:
        return None
    return tenant


def service_subject(subject: str) -> bool:
    """A request on the agents' inference subject (``<ns>.isvc.<model>.<tenant>``),
    which only the service may publish to."""
    parts = subject.split(".")
    return len(parts) == 4 and parts[1] == SVC_INFER


def check_quota(req: InferRequest, q: Quota) -> None:
    """Rows and instruction bytes within the tenant's quota (before any decoding)."""
    obs = req.observation
    shape = obs.state.shape
    rows = int(shape[0]) if len(shape) == 2 else 1
    if rows > q.max_infer_rows:
        raise QuotaExceeded(
            f"{rows} rows in one inference request; tenant {req.tenant_id!r}'s quota is "
            f"{q.max_infer_rows}: split the batch"
        )
    texts = [obs.instruction] if isinstance(obs.instruction, str) else obs.instruction
    if len(texts) > max(rows, 1):
        raise ShapeMismatch(f"{len(texts)} instructions for {rows} rows")
    longest = max((len(t.encode()) for t in texts), default=0)
    if longest > q.max_instruction_bytes:
        raise QuotaExceeded(
            f"an instruction of {longest} bytes; tenant {req.tenant_id!r}'s quota is "
            f"{q.max_instruction_bytes} bytes"
        )


def tenant_claim(subject: str, req: InferRequest) -> tuple[str, str] | None:
    """None if the payload's tenant is the subject's; else (the subject's tenant, or
    ``"_"`` when it names none, and why the request is refused)."""
    tenant = subject_tenant(subject)
    if tenant is not None and req.tenant_id == tenant:
        return None
    if tenant is None:  # no tenant's subject (a literal wildcard token): nobody to serve
        return "_", (
            f"request on {metrics.clip(subject, 80)} names no tenant (claims tenant "
            f"{metrics.clip(req.tenant_id, 40)!r})"
        )
    return tenant, (
        f"request on {subject} claims tenant {metrics.clip(req.tenant_id, 40)!r}: a tenant may ask only "
        f"for its own policies (this subject is tenant {tenant!r}'s)"
    )


def canonical(schema: FeatureSchema, obs: Observation) -> FeatureBatch:
    """The request's tensors, read from the wire bytes. Images (nearly all the bytes) stay
    read-only views of the message (``np.frombuffer``, no copy): canonicalisation and the
    batch's preparation only read them. State and history (a few floats) are copied, so a
    head owns what it is given."""
    images = {slot: wire_view(t.to_array(f"images[{slot!r}]")) for slot, t in obs.images.items()}
    state = obs.state.to_array("state").copy()
    history = None if obs.history is None else obs.history.to_array("history").copy()
    return canonicalize_request(schema, images, obs.instruction, state, history)


def validate(req: InferRequest, lp: LoadedPolicy) -> tuple[FeatureBatch, torch.Tensor | None]:
    """One request against its tenant's policy: its rows and noise (raises on bad input)."""
    rec = lp.record
    if req.schema_signature != rec.schema_signature:
        raise IncompatibleSchema(
            f"request schema {req.schema_signature!r} does not match tenant {req.tenant_id!r} "
            f"policy {req.workload!r} v{rec.version}, trained on {rec.schema_signature!r}; "
            "send observations in the policy's schema"
        )
    batch = canonical(lp.schema, req.observation)
    noise = None
    if req.noise is not None:
        noise = torch.from_numpy(req.noise.to_array("noise").astype(np.float32))
        want = (batch.batch_size, lp.schema.action_horizon, lp.schema.action_dim)
        if tuple(noise.shape) != want:
            raise ShapeMismatch(f"noise: expected {list(want)}, got {list(noise.shape)}")
        if not bool(torch.isfinite(noise).all()):
            raise InvalidSpec("noise contains NaN/inf: send finite numbers only")
    return batch, noise
