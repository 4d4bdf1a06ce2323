"""The control plane's pure checks (agents/control/checks.py) as tables: a
tenant's request against its quota and its own records, the door's decisions,
pages and slices. No server: each row is data in, a decision or an error out."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
from workload_specs import spec

from joynexus.agents.control import checks as c
from joynexus.schemas.errors import InvalidSpec, PayloadTooLarge, QuotaExceeded, ShapeMismatch
from joynexus.schemas.identities import TenantIdentity, TenantRequest
from joynexus.schemas.inference import FeatureSchemaSpec
from joynexus.schemas.jobs import JobState, TrainingJob
from joynexus.schemas.quotas import Quota
from joynexus.schemas.workloads import (
    PutData,
    ReadEvents,
    Scheduling,
    TensorBytes,
    VideoQuery,
    WorkloadRecord,
    WorkloadSpec,
)

Q = Quota()
HASH = "$2b$12$" + "a" * 53


def rec(s: WorkloadSpec, state: str = "active", **kw: Any) -> WorkloadRecord:
    return WorkloadRecord(tenant_id="acme", spec=s, state=state, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------ the door
@pytest.mark.parametrize(
    ("subject", "tenant"),
    [
        ("jnx.api.acme.open_job", "acme"),
        ("jnx.api.ACME.open_job", None),  # not a valid name
        ("jnx.api.*.open_job", None),  # a wildcard is no tenant
        ("jnx.api.acme", None),  # no verb
        ("jnx.api.acme.open_job.x", None),  # one token too many
        ("jnx.api..open_job", None),
        ("jnx.api." + "a" * 33 + ".usage", None),  # too long
    ],
)
def test_the_tenant_is_the_subjects(subject: str, tenant: str | None) -> None:
    assert c.tenant_of_subject(subject) == tenant


@pytest.mark.parametrize(
    ("verb", "size", "too_large"),
    [
        ("open_job", c.MAX_SMALL_REQUEST, False),
        ("open_job", c.MAX_SMALL_REQUEST + 1, True),
        ("put_data", c.MAX_SMALL_REQUEST + 1, False),  # a big verb: max_payload bounds it
        ("put_data", 1 << 20, False),
        ("put_data", (1 << 20) + 1, True),
        ("create_workload", (1 << 20) + 1, True),
        ("no_such_verb", c.MAX_SMALL_REQUEST + 1, True),
    ],
)
def test_request_size_is_decided_on_the_length(verb: str, size: int, too_large: bool) -> None:
    err = c.oversized(verb, size, max_payload=1 << 20)
    assert (err is not None) == too_large
    if err is not None:
        assert isinstance(err, PayloadTooLarge) and str(size) in str(err)


def test_verbs_map_to_request_types_and_unknown_ones_are_clipped() -> None:
    assert c.request_type("put_data") is PutData
    with pytest.raises(InvalidSpec, match="unknown API verb") as e:
        c.request_type("x" * 1000)
    assert len(str(e.value)) < 600
    c.check_admin_verb("tenant_add")
    with pytest.raises(InvalidSpec, match="unknown admin verb"):
        c.check_admin_verb("open_job")


# ------------------------------------------------------------ workload specs against the quota
@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"scheduling": Scheduling(max_in_flight=17)}, "scheduling.max_in_flight"),
        ({"scheduling": Scheduling(max_active_rollouts=5)}, "scheduling.max_active_rollouts"),
        ({"action_horizon": 65}, "action_horizon"),
        ({"num_envs": 64, "horizon": 65}, "num_envs x horizon"),
        ({"batch_size": 513}, "batch_size"),
        ({"instruction": "é" * 513}, "instruction bytes"),  # bytes, not characters
        ({"eval_every": 1, "eval_episodes": 501}, "eval_episodes"),
        ({"eval_videos": 5}, "eval_videos"),
        ({"eval_videos": 1, "video_frames": 201}, "video_frames"),
        ({"eval_videos": 1, "image_size": 129}, "video_size"),  # 0 = the camera's size
        ({"eval_videos": 1, "video_size": 129}, "video_size"),
    ],
)
def test_a_number_over_the_quota_is_refused(changes: dict[str, Any], what: str) -> None:
    with pytest.raises(QuotaExceeded, match=f"^{what} = "):
        c.bound_spec("acme", spec(**changes), Q)


def test_within_the_quota_the_spec_keeps_its_numbers_and_takes_the_class_priority() -> None:
    s = spec(scheduling=Scheduling(priority=99, max_in_flight=16), num_envs=64, horizon=64,
             eval_videos=4, video_frames=200)
    for q in (Q, Quota(priority_class="premium")):
        out = c.bound_spec("acme", s, q)
        assert out.scheduling.priority == q.priority != 99
        assert msgspec.structs.replace(out, scheduling=s.scheduling) == s
    assert c.bound_spec("acme", spec(task_type="eval", episodes=500), Q).episodes == 500
    with pytest.raises(QuotaExceeded, match=r"^episodes = 501"):
        c.bound_spec("acme", spec(task_type="eval", episodes=501), Q)
    assert c.bound_spec("acme", spec(episodes=501), Q).episodes == 501  # only eval runs episodes


# ------------------------------------------------------------ creating a workload
_RL, _SFT = spec("rl1"), spec("sft1", "sft")


@pytest.mark.parametrize(
    ("new", "held", "quota", "outcome"),
    [
        (spec("rl2"), [], Q, None),
        (_RL, [rec(_RL)], Q, "retried"),  # the same spec again: the record it made
        (spec("rl1", num_envs=3), [rec(_RL)], Q, "already has an active workload named"),
        # a name whose workload ended is created again: the next generation, its slot reused
        (spec("rl1", num_envs=3), [rec(_RL, state="done")], Q, 2),
        (_RL, [rec(_RL, state="cancelled", generation=4)], Quota(max_workloads=1), 5),
        (spec("p0", "eval"), [rec(spec("p0", "eval"), state="done", periodic=True)], Q,
         "periodic evaluations"),
        (spec("rl2"), [rec(_RL)], Q, "already runs an active rl workload"),
        (spec("rl2"), [rec(_RL, state="cancelled")], Q, None),
        (spec("rl2"), [rec(_SFT)], Q, None),  # one active workload per task type
        (spec("e2", "eval"), [rec(spec("e1", "eval"))], Q, None),  # evals are not exclusive
        (spec("rl2"), [rec(spec(f"s{i}", "sft"), state="completed") for i in range(2)],
         Quota(max_workloads=2), "max_workloads"),
        (spec("rl2"), [rec(_SFT)], Quota(max_active_workloads=1), "active workloads"),
        # the evaluator's periodic evaluations count while they run (issue 24) ...
        (spec("rl2"), [rec(spec(f"p{i}", "eval"), periodic=True) for i in range(3)],
         Quota(max_workloads=2, max_active_workloads=4), "max_workloads"),
        (spec("rl2"), [rec(spec("p0", "eval"), periodic=True)],
         Quota(max_active_workloads=1), "active workloads"),
        (spec("e3", "eval"), [rec(spec(f"e{i}", "eval")) for i in range(2)], Q, "evaluations running"),
        (spec("e3", "eval"), [rec(spec(f"e{i}", "eval"), periodic=True) for i in range(2)], Q,
         "evaluations running"),
        # ... ended, they are results with a bound of their own: no slot taken
        (spec("rl2"), [rec(spec(f"p{i}", "eval"), state="done", periodic=True) for i in range(3)],
         Quota(max_workloads=2, max_active_workloads=1), None),
    ],
)
def test_create_against_the_tenants_records(
    new: WorkloadSpec, held: list[WorkloadRecord], quota: Quota, outcome: str | int | None
) -> None:
    if outcome is None:
        assert c.check_create("acme", new, held, quota) == 1  # a new name: generation 1
    elif isinstance(outcome, int):
        assert c.check_create("acme", new, held, quota) == outcome
    elif outcome == "retried":
        assert c.check_create("acme", new, held, quota) is held[0]
    else:
        error = QuotaExceeded if outcome in ("max_workloads", "active workloads",
                                             "evaluations running") else InvalidSpec
        with pytest.raises(error, match=outcome):
            c.check_create("acme", new, held, quota)


@pytest.mark.parametrize(
    ("held", "quota", "waits"),
    [
        ([], Q, None),
        # the tenant's own evaluations and the periodic ones share max_concurrent_evals
        ([rec(spec("e1", "eval")), rec(spec("p1", "eval"), periodic=True)], Q, "2 evaluations running"),
        ([rec(spec("e1", "eval")), rec(spec("p1", "eval"), state="done", periodic=True)], Q, None),
        ([rec(_RL), rec(_SFT)], Quota(max_active_workloads=2), "2 active workloads"),
    ],
)
def test_a_periodic_evaluation_waits_within_the_quota(
    held: list[WorkloadRecord], quota: Quota, waits: str | None
) -> None:
    got = c.periodic_wait("acme", held, quota)
    assert got is None if waits is None else waits in (got or ""), got


def test_ended_periodic_evaluations_beyond_the_quota_are_forgotten_oldest_first() -> None:
    held = [
        msgspec.structs.replace(rec(spec(f"p{i}", "eval"), state="done", periodic=True),
                                finished_at=float(10 - i))
        for i in range(5)
    ] + [rec(spec("run", "eval"), periodic=True), rec(spec("own", "eval"), state="done")]
    # max_workloads 3: keep the 2 newest ended periodic ones, room for the one to add
    gone = c.periodic_to_forget(held, Quota(max_workloads=3))
    assert [r.spec.name for r in gone] == ["p4", "p3", "p2"]
    assert c.periodic_to_forget(held, Quota(max_workloads=64)) == []


@pytest.mark.parametrize("state", ["active", "cancelled", "completed", "failed"])
def test_cancel_changes_only_an_active_record(state: str) -> None:
    r = rec(_RL, state=state, created_at=5.0, schema_signature="sig")
    out = c.cancelled(r)
    assert out.state == ("cancelled" if state == "active" else state)
    assert (out.spec, out.created_at, out.schema_signature) == (_RL, 5.0, "sig")


@pytest.mark.parametrize(
    ("state", "generation", "end_state", "becomes"),
    [
        ("active", 2, "done", "done"),
        ("active", 2, "failed", "failed"),
        ("active", 1, "done", None),  # an earlier generation's end: not this record's
        ("cancelled", 2, "done", None),  # a cancel came first: it stays cancelled
        ("active", 2, "cancelled", None),  # the cancel wrote the record itself
    ],
)
def test_a_generations_end_becomes_its_records_state(
    state: str, generation: int, end_state: str, becomes: str | None
) -> None:
    from joynexus.schemas.jobs import WorkloadEnded

    r = rec(_SFT, state=state, generation=2, created_at=5.0)
    end = WorkloadEnded(tenant_id="acme", workload="sft1", generation=generation,
                        state=end_state, completed=20, failed=1, dropped=0, last_version=21,
                        reason="20 jobs completed", at=9.0)  # type: ignore[arg-type]
    out = c.ended(r, end)
    if becomes is None:
        assert out is None
        return
    assert out is not None and (out.state, out.finished_at, out.reason) == (
        becomes, 9.0, "20 jobs completed")
    assert out.result == {"completed": 20.0, "failed": 1.0, "dropped": 0.0, "last_version": 21.0}
    assert (out.spec, out.created_at, out.generation) == (_SFT, 5.0, 2)


# ------------------------------------------------------------ tenant submissions
_OWN = spec("own", source="tenant")


@pytest.mark.parametrize(
    ("record", "count", "opened", "quota", "error", "match"),
    [
        (rec(_OWN), 1, 0, Q, None, ""),
        (rec(_OWN), 4096, 15, Q, None, ""),
        (rec(spec("svc")), 1, 0, Q, InvalidSpec, "fed by the service"),
        (rec(spec("ev", "eval", source="tenant")), 1, 0, Q, InvalidSpec, "fed by the service"),
        (rec(_OWN, state="cancelled"), 1, 0, Q, InvalidSpec, "is cancelled; it takes no more"),
        (rec(_OWN), 1, 16, Q, QuotaExceeded, "16 jobs open"),
        (rec(_OWN), 0, 0, Q, QuotaExceeded, r"sample_count must be 1\.\.4096"),
        (rec(_OWN), 4097, 0, Q, QuotaExceeded, "sample_count"),
        (rec(_OWN), 600, 0, Quota(max_rollout_steps=100, max_batch_size=600), None, ""),
    ],
)
def test_open_job(
    record: WorkloadRecord, count: int, opened: int, quota: Quota,
    error: type[Exception] | None, match: str,
) -> None:
    if error is None:
        c.check_open_job("acme", record.spec.name, record, count, quota, opened)
    else:
        with pytest.raises(error, match=match):
            c.check_open_job("acme", record.spec.name, record, count, quota, opened)


def test_close_abort_and_expiry_decisions() -> None:
    assert c.closed_state("rl") is JobState.NEEDS_ADVANTAGES
    assert c.closed_state("sft") is JobState.READY
    assert c.abort_reason("") == "aborted by the tenant"
    assert c.abort_reason("oops") == "aborted by the tenant: oops"
    opened = {"a": 0.0, "b": 5.0, "c": 9.0}
    assert c.expired(opened, now=10.0, ttl_s=5.0) == [("a", 0.0), ("b", 5.0)]
    assert c.expired(opened, now=10.0, ttl_s=11.0) == []
    assert [c.expiry_period_s(t) for t in (0.1, 8.0, 600.0)] == [0.2, 2.0, 30.0]
    assert c.open_jobs_of({"j1": "acme", "j2": "bob", "j3": "acme"}, "acme") == 2


# ------------------------------------------------------------ the tenant's data
def _job(**kw: Any) -> TrainingJob:
    kw.setdefault("producer_role", "tenant")
    return TrainingJob(job_id="j", tenant_id="acme", task_type="sft", workload="w", **kw)


_ROW = {"x": TensorBytes(dtype="float32", shape=[1], data=b"\0" * 4)}


@pytest.mark.parametrize(
    ("job", "fields", "match"),
    [
        (_job(), _ROW, None),
        (_job(), {}, "got no fields"),
        (_job(state=JobState.READY), _ROW, "takes no data from you"),
        (_job(producer_role="producer"), _ROW, "takes no data from you"),
    ],
)
def test_put_data_goes_only_into_an_open_tenant_job(
    job: TrainingJob, fields: dict[str, TensorBytes], match: str | None
) -> None:
    req = PutData(job_id="j", fields=fields)
    if match is None:
        c.check_put_data(job, req)
    else:
        with pytest.raises(InvalidSpec, match=match):
            c.check_put_data(job, req)


@pytest.mark.parametrize(
    ("in_use", "size", "ok"), [(0, 100, True), (50, 50, True), (50, 51, False), (0, 101, False)]
)
def test_training_queue_bytes_are_bounded(in_use: int, size: int, ok: bool) -> None:
    q = Quota(tq_bytes=100)
    if ok:
        c.check_tq_room("acme", in_use, size, q)
    else:
        with pytest.raises(QuotaExceeded, match="close or abort open jobs"):
            c.check_tq_room("acme", in_use, size, q)


_FS = FeatureSchemaSpec(camera_slots=["base"], image_hw=[8, 6], state_dim=3, action_dim=2,
                        action_horizon=4, base_model="qwen2.5-vl-tiny")


def _rows(**shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    full = {"obs_image_base": (5, 3, 8, 6), "obs_state": (5, 3), "actions": (5, 4, 2)}
    full.update(shapes)
    return {k: np.zeros(v, np.float32) for k, v in full.items() if v}


@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        (_rows(), None, ""),
        (_rows(obs_state=()), InvalidSpec, "needs field 'obs_state' of shape \\[B, 3\\]"),
        (_rows(obs_image_base=()), InvalidSpec, "obs_image_base"),
        (_rows(obs_state=(5, 4)), ShapeMismatch, r"expected \[B, 3\], got \[5, 4\]"),
        (_rows(actions=(5, 2, 4)), ShapeMismatch, "'actions'"),
        (_rows(obs_image_base=(5, 3, 6, 8)), ShapeMismatch, "obs_image_base"),
    ],
)
def test_rows_fit_the_workloads_schema(
    rows: dict[str, np.ndarray], error: type[Exception] | None, match: str
) -> None:
    if error is None:
        c.check_rows(rows, _FS, "w")
    else:
        with pytest.raises(error, match=match):
            c.check_rows(rows, _FS, "w")


@pytest.mark.parametrize(
    ("req", "page"),
    [
        (ReadEvents(), (256, 0.0)),
        (ReadEvents(limit=0, wait_s=-3.0), (1, 0.0)),
        (ReadEvents(limit=10**6, wait_s=1e9), (c.MAX_EVENTS_PAGE, c.MAX_EVENTS_WAIT_S)),
        (ReadEvents(wait_s=math.nan), (256, 0.0)),  # NaN would park the poll forever
        (ReadEvents(wait_s=math.inf), (256, 0.0)),
        (ReadEvents(limit=7, wait_s=2.5), (7, 2.5)),
    ],
)
def test_read_events_pages_are_bounded(req: ReadEvents, page: tuple[int, float]) -> None:
    assert c.events_page(req) == page


@pytest.mark.parametrize(("seq", "ok"), [(0, True), (-1, True), (1 << 62, True),
                                          ((1 << 62) + 1, False), (1.5, False), ("3", False)])
def test_after_seq_is_a_stream_sequence(seq: object, ok: bool) -> None:
    if ok:
        c.check_after_seq(seq)
    else:
        with pytest.raises(InvalidSpec, match="after_seq"):
            c.check_after_seq(seq)


@pytest.mark.parametrize(
    ("offset", "limit", "part"),
    [(0, 10, slice(0, 10)), (5, 10**9, slice(5, 5 + 500)), (0, 500, slice(0, 500))],
)
def test_weights_slices_stay_under_the_payload(offset: int, limit: int, part: slice) -> None:
    assert c.weights_slice(offset, limit, max_payload=1000) == part


def test_negative_offsets_and_times_are_refused() -> None:
    with pytest.raises(InvalidSpec, match="offset must be >= 0"):
        c.weights_slice(-1, 10, 1000)
    for since in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidSpec, match="since"):
            c.check_since(since)
    c.check_since(0.0)


_VIDS = rec(spec("e", "eval"), videos=["v0", "v1"])


@pytest.mark.parametrize(
    ("query", "outcome"),
    [
        (VideoQuery(workload="e"), (0, slice(0, 500))),
        (VideoQuery(workload="e", index=1, offset=7, limit=3), (1, slice(7, 10))),
        (VideoQuery(workload="e", index=1, limit=10**6), (1, slice(0, 500))),
        (VideoQuery(workload="e", index=2), "index must be 0..1, got 2"),
        (VideoQuery(workload="e", index=-1), "index must be 0..1"),
        (VideoQuery(workload="e", offset=-1), "offset must be >= 0"),
    ],
)
def test_video_slices(query: VideoQuery, outcome: Any) -> None:
    if isinstance(outcome, str):
        with pytest.raises(InvalidSpec, match=outcome):
            c.video_slice(_VIDS, query, max_payload=1000)
    else:
        assert c.video_slice(_VIDS, query, max_payload=1000) == outcome


# ------------------------------------------------------------ the operator's
@pytest.mark.parametrize(
    ("tenant", "password_hash", "match"),
    [
        ("acme", HASH, None),
        ("acme", "$2a$04$" + "Z" * 53, None),
        ("cursor", HASH, "reserved"),
        ("admin", HASH, "reserved"),
        ("Acme", HASH, "not a valid name"),
        ("acme", "", "needs password_hash"),
        ("acme", "hunter2", "needs password_hash"),
        ("acme", "$2b$12$" + "a" * 52, "needs password_hash"),
    ],
)
def test_tenant_add_names_and_hashes(tenant: str, password_hash: str, match: str | None) -> None:
    req = TenantRequest(tenant=tenant, password_hash=password_hash)
    if match is None:
        assert c.check_new_tenant(req) == tenant
    else:
        with pytest.raises(InvalidSpec, match=match):
            c.check_new_tenant(req)


def test_issued_identity_new_rotated_and_refused() -> None:
    req = TenantRequest(tenant="acme", password_hash=HASH)
    new = c.issued_identity(req, "acme", "jnx-acme", None, now=10.0)
    assert (new.created_at, new.rotated_at, new.quota, new.password_hash) == (10.0, 0.0, None, HASH)
    old = TenantIdentity(tenant_id="acme", user="jnx-acme", password_hash="old", created_at=3.0,
                         quota=Quota(max_open_jobs=2))
    with pytest.raises(InvalidSpec, match="--rotate"):
        c.issued_identity(req, "acme", "jnx-acme", old, now=10.0)
    rot = c.issued_identity(msgspec.structs.replace(req, rotate=True), "acme", "jnx-acme", old, 10.0)
    assert (rot.created_at, rot.rotated_at, rot.quota, rot.password_hash) == (3.0, 10.0, old.quota, HASH)
    q = Quota(max_open_jobs=9)
    req_q = msgspec.structs.replace(req, rotate=True, quota=q)
    assert c.issued_identity(req_q, "acme", "jnx-acme", old, 10.0).quota == q


@pytest.mark.parametrize(
    ("applied", "now", "state"),
    [
        ({}, 0.0, None),
        ({}, 5.0, "off"),  # nobody answers for this namespace
        ({"applied.n1": 7}, 0.0, "yes"),
        ({"applied.n1": 8, "applied.n2": 7}, 0.0, "yes"),
        ({"applied.n1": 8, "applied.n2": 6}, 0.0, None),  # one node behind
        ({"applied.n1": 8, "applied.n2": 6}, 5.0, None),
        ({"applied.n1": 6}, 10.0, "pending"),
        ({}, 10.0, "off"),
    ],
)
def test_when_an_auth_change_counts_as_applied(
    applied: dict[str, int], now: float, state: str | None
) -> None:
    assert c.applied_state(applied, 7, now, discover_deadline=5.0, deadline=10.0) == state


@pytest.mark.parametrize("seed", [-1, 2**20 + 1, 2**63, True])
def test_a_seed_the_generators_refuse_is_refused_at_the_door(seed: Any) -> None:
    """seed=-1 was accepted and crashed the SFT producer in a loop (issue 24)."""
    with pytest.raises(InvalidSpec, match=r"seed must be an integer in 0\.\."):
        spec(seed=seed)


@pytest.mark.parametrize("seed", [0, 7, 2**20])
def test_every_accepted_seed_seeds_what_consumes_it(seed: int) -> None:
    import numpy as np

    from joynexus.agents.envs.maniskill.rollout import episode_seed

    s = spec(seed=seed)
    np.random.default_rng(s.seed)  # the SFT producer's batch order
    np.random.default_rng(s.seed * 7919 + 996)  # the RL producer's noise
    assert 0 <= episode_seed(s.seed * 100_003 + 10**6 + 996_000_000, 3, 10**6) < 2**31


def test_a_body_nested_too_deeply_is_a_clear_refusal() -> None:
    """msgspec raises RecursionError on a deep free-form (Any) value; decode makes it
    InvalidMessage, in JSON and in msgpack (issue 24 item 7)."""
    import msgspec

    from joynexus.schemas.base import decode
    from joynexus.schemas.errors import InvalidMessage
    from joynexus.schemas.inference import decode_msgpack

    class Free(msgspec.Struct):
        a: Any = None

    with pytest.raises(InvalidMessage, match="nested too deeply"):
        decode(b'{"a": ' + b"[" * 8000 + b"]" * 8000 + b"}", Free)
    with pytest.raises(InvalidMessage, match="nested too deeply"):
        decode_msgpack(b"\x81\xa1a" + b"\x91" * 8000 + b"\x90", Free)


@pytest.mark.parametrize(("asked", "waits"), [
    (0.0, 0.0), (-5.0, 0.0), (float("nan"), 0.0), (float("-inf"), 0.0),
    (3.5, 3.5), (10.0, 10.0), (1e9, 10.0), (float("inf"), 10.0),
])
def test_an_open_job_waits_at_most_the_schedulers_bound(asked: float, waits: float) -> None:
    from joynexus.agents.control.submissions import open_wait_s

    assert open_wait_s(asked) == waits


def test_half_a_tenants_requests_in_flight_may_wait_for_admission() -> None:
    from joynexus.agents.control.submissions import max_open_waits
    from joynexus.schemas.quotas import Quota

    assert max_open_waits(Quota()) == 16
    assert max_open_waits(Quota(max_requests_in_flight=1)) == 1
    assert max_open_waits(Quota(max_requests_in_flight=5)) == 2
