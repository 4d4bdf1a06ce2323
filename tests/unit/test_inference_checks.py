"""The inference engine's other pure decisions as tables: the checks a request passes at
the door (agents/inference/admission.py) and which resident policy versions are evicted
(agents/inference/policies.py). No server, no model."""

from __future__ import annotations

import numpy as np
import pytest

from joynexus.agents.inference.admission import check_quota, subject_tenant, tenant_claim
from joynexus.agents.inference.policies import PolicyId, evictions
from joynexus.schemas.errors import QuotaExceeded, ShapeMismatch
from joynexus.schemas.inference import InferRequest, Observation, TensorBytes
from joynexus.schemas.quotas import Quota


def req(tenant: str = "acme", rows: int | None = 1, instruction: str | list[str] = "pick") -> InferRequest:
    state = np.zeros((3,) if rows is None else (rows, 3), np.float32)
    obs = Observation(images={}, instruction=instruction, state=TensorBytes.from_array(state))
    return InferRequest(tenant_id=tenant, schema_signature="s", observation=obs)


@pytest.mark.parametrize(
    ("subject", "tenant"),
    [
        ("jnx.infer.m.acme", "acme"),
        ("jnx.infer.m.*", None),  # a wildcard names nobody
        ("jnx.infer.m.ACME", None),
        ("jnx.infer.m." + "a" * 33, None),
        ("acme", "acme"),
    ],
)
def test_subject_tenant(subject: str, tenant: str | None) -> None:
    assert subject_tenant(subject) == tenant


@pytest.mark.parametrize(
    ("subject", "claims", "refused_as", "says"),
    [
        ("jnx.infer.m.acme", "acme", None, None),
        ("jnx.infer.m.acme", "bolt", "acme", "claims tenant 'bolt'"),
        ("jnx.infer.m.*", "acme", "_", "names no tenant"),
        ("jnx.infer.m.acme", "x" * 500, "acme", "claims tenant"),  # clipped, not echoed whole
    ],
)
def test_tenant_claim(subject: str, claims: str, refused_as: str | None, says: str | None) -> None:
    got = tenant_claim(subject, req(claims))
    if refused_as is None:
        assert got is None
        return
    assert got is not None
    tenant, reason = got
    assert tenant == refused_as
    assert says is not None and says in reason
    assert len(reason) < 300


Q = Quota(max_infer_rows=4, max_instruction_bytes=8)


@pytest.mark.parametrize(
    ("r", "error", "match"),
    [
        (req(rows=4), None, None),
        (req(rows=None), None, None),  # one unbatched row
        (req(rows=5), QuotaExceeded, "5 rows"),
        (req(rows=2, instruction=["a", "b", "c"]), ShapeMismatch, "3 instructions for 2 rows"),
        (req(rows=2, instruction=["a", "b"]), None, None),
        (req(instruction="12345678"), None, None),
        (req(instruction="123456789"), QuotaExceeded, "9 bytes"),
        (req(rows=2, instruction=["ok", "é" * 5]), QuotaExceeded, "10 bytes"),  # bytes, not chars
    ],
)
def test_check_quota(r: InferRequest, error: type[Exception] | None, match: str | None) -> None:
    if error is None:
        check_quota(r, Q)
    else:
        with pytest.raises(error, match=match):
            check_quota(r, Q)


def ids(*versions: int) -> list[PolicyId]:
    return [("acme", "default", v) for v in versions]


@pytest.mark.parametrize(
    ("resident", "latest", "used", "retain", "dropped"),
    [
        (ids(1, 2, 3), 3, {}, 4, []),
        # the latest stays; of the others the most recently used
        (ids(1, 2, 3, 4, 5), 5, {ids(1)[0]: 9, ids(2)[0]: 1, ids(3)[0]: 5, ids(4)[0]: 3}, 3, ids(4, 2)),
        (ids(1, 2, 3), 3, {ids(1)[0]: 2, ids(2)[0]: 1}, 1, ids(1, 2)),
        # the latest not resident (yet): retain counts only the others
        (ids(1, 2, 3), 4, {ids(1)[0]: 1, ids(2)[0]: 2, ids(3)[0]: 3}, 2, ids(1)),
        (ids(1, 2), None, {ids(1)[0]: 1, ids(2)[0]: 2}, 1, ids(1)),
        # never used sorts last
        (ids(1, 2, 3), 3, {ids(1)[0]: 1}, 2, ids(2)),
    ],
)
def test_evictions(
    resident: list[PolicyId], latest: int | None, used: dict[PolicyId, int], retain: int,
    dropped: list[PolicyId],
) -> None:
    assert evictions(resident, latest, used, retain) == dropped
