"""The actor's pure decisions (``agents/actor/decisions.py``) in tables, and the
tensors of one tenant's step (``agents/actor/batch.py``) on a real head: no server."""

from __future__ import annotations

import errno

import nats.errors
import numpy as np
import pytest
import torch

from joynexus.agents.actor.batch import StepKnobs, train_item
from joynexus.agents.actor.decisions import (
    fields_to_read,
    form_group,
    infrastructure,
    is_ppo,
    load_failure,
    remember_applied,
    step_outcomes,
    tenant_rows,
)
from joynexus.agents.actor.forward import OLD_LOGP_FIELD
from joynexus.agents.models.features import FeatureSchema
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.producers.schema import feature_dim
from joynexus.schemas.errors import InvalidSpec, JoyNexusError, ShapeMismatch, Unavailable
from joynexus.schemas.jobs import JobMetadata, TrainingJob
from joynexus.schemas.samples import ACTIONS_FIELD, DECISION_FIELD, STATE_FIELD, image_field


def key(job: str) -> str:
    return job.split(":")[0]  # "tenant/policy:n"


@pytest.mark.parametrize(
    ("pending", "group", "rest"),
    [
        ([], [], []),
        (["a:1"], ["a:1"], []),
        (["a:1", "b:1"], ["a:1", "b:1"], []),
        # a tenant policy's second job waits for the version its first one makes
        (["a:1", "a:2"], ["a:1"], ["a:2"]),
        (["a:1", "b:1", "a:2", "c:1", "b:2"], ["a:1", "b:1", "c:1"], ["a:2", "b:2"]),
        (["a:1", "a:2", "a:3"], ["a:1"], ["a:2", "a:3"]),
        # the same tenant with another policy is another key
        (["a/x:1", "a/y:1", "a/x:2"], ["a/x:1", "a/y:1"], ["a/x:2"]),
        # lease order is kept on both sides
        (["c:1", "b:1", "c:2", "a:1"], ["c:1", "b:1", "a:1"], ["c:2"]),
    ],
)
def test_form_group_takes_one_job_per_tenant_policy_in_lease_order(
    pending: list[str], group: list[str], rest: list[str]
) -> None:
    assert form_group(pending, key) == (group, rest)


@pytest.mark.parametrize(
    ("task_type", "gaussian", "actor_forward", "ppo"),
    [
        ("rl", True, True, True),
        ("rl", True, False, False),  # no behaviour log-probabilities: AWR
        ("rl", False, True, False),  # flow matching: no tractable likelihood
        ("rl", False, False, False),
        ("sft", True, True, False),
        ("sft", False, False, False),
    ],
)
def test_ppo_needs_a_gaussian_head_and_the_actor_forward_stage(
    task_type: str, gaussian: bool, actor_forward: bool, ppo: bool
) -> None:
    assert is_ppo(task_type, gaussian=gaussian, actor_forward=actor_forward) is ppo


CAM = image_field("cam")
BASE_FIELDS = [STATE_FIELD, ACTIONS_FIELD]


@pytest.mark.parametrize(
    ("task_type", "cams", "ppo", "decisions", "fields"),
    [
        ("sft", (), False, False, BASE_FIELDS),
        ("sft", ("cam",), False, True, [*BASE_FIELDS, CAM]),  # decisions only matter to PPO
        ("rl", ("cam",), False, False, [*BASE_FIELDS, CAM, "advantages"]),
        ("rl", ("cam",), False, True, [*BASE_FIELDS, CAM, "advantages"]),
        ("rl", ("cam",), True, False, [*BASE_FIELDS, CAM, "advantages", "returns", OLD_LOGP_FIELD]),
        ("rl", (), True, True, [*BASE_FIELDS, "advantages", "returns", OLD_LOGP_FIELD, DECISION_FIELD]),
        (
            "rl",
            ("a", "b"),
            False,
            False,
            [*BASE_FIELDS, image_field("a"), image_field("b"), "advantages"],
        ),
    ],
)
def test_fields_a_step_reads(
    task_type: str, cams: tuple[str, ...], ppo: bool, decisions: bool, fields: list[str]
) -> None:
    got = fields_to_read(task_type, cams, ppo=ppo, decisions=decisions, old_logp_field=OLD_LOGP_FIELD)
    assert got == fields


@pytest.mark.parametrize(
    ("error", "becomes"),
    [
        (ShapeMismatch("rows"), ShapeMismatch),  # the job's own typed error, as it is
        (InvalidSpec("bad"), InvalidSpec),
        # typed errors come first, even one that is also an OSError (Unavailable)
        (Unavailable("later"), Unavailable),
        (KeyError("obs_state"), InvalidSpec),  # data that does not decode: that job fails
        (ValueError("cannot reshape"), InvalidSpec),
        (RuntimeError("torch.load: bad zip"), InvalidSpec),
        # the connection or the machine: the actor stops (None), the job is retried
        (nats.errors.TimeoutError(), None),
        (nats.errors.ConnectionClosedError(), None),
        (OSError(errno.ENOSPC, "no space"), None),
        (ConnectionResetError(), None),
        (MemoryError(), None),
    ],
)
def test_a_job_whose_data_does_not_load(error: Exception, becomes: type | None) -> None:
    got = load_failure(error)
    if not isinstance(error, JoyNexusError):
        assert infrastructure(error) is (becomes is None)
    if becomes is None:
        assert got is None
        return
    assert isinstance(got, becomes)
    if isinstance(error, JoyNexusError):
        assert got is error
    else:
        assert type(error).__name__ in str(got) and str(error) in str(got)


BAD = ShapeMismatch("tenant b's rows")


@pytest.mark.parametrize(
    ("losses", "actions"),
    [
        ([0.5], ["commit"]),
        ([BAD], ["fail"]),
        # all-or-nothing per tenant: one tenant's failed item fails only its job
        ([0.5, BAD, 0.25], ["commit", "fail", "commit"]),
        ([BAD, BAD], ["fail", "fail"]),
        ([0.0, 1e9], ["commit", "commit"]),
    ],
)
def test_step_outcomes_each_tenant_on_its_own(losses: list[float | JoyNexusError], actions: list[str]) -> None:
    out = step_outcomes(losses)
    assert [s.action for s in out] == actions
    for s, x in zip(out, losses, strict=True):
        if s.action == "fail":
            assert s.error is x and s.loss is None
        else:
            assert s.error is None and s.loss == x


@pytest.mark.parametrize(
    ("rows", "per_tenant"),
    [
        ([], {}),
        ([("a", 16)], {"a": 16}),
        ([("a", 16), ("b", 4)], {"a": 16, "b": 4}),
        ([("a", 16), ("b", 4), ("a", 8)], {"a": 24, "b": 4}),  # two policies of one tenant
    ],
)
def test_tenant_rows(rows: list[tuple[str, int]], per_tenant: dict[str, int]) -> None:
    assert tenant_rows(rows) == per_tenant


def test_applied_jobs_are_bounded_oldest_first() -> None:
    applied: dict[str, int] = {}
    for v in range(1, 8):
        remember_applied(applied, f"j{v}", v, keep=3)
    assert applied == {"j5": 5, "j6": 6, "j7": 7}
    remember_applied(applied, "j6", 9, keep=3)  # re-applied: its version updated, none forgotten
    assert applied == {"j5": 5, "j6": 9, "j7": 7}


SDIM, ADIM, H, M = 5, 3, 2, 6
BASE = "qwen2.5-vl-tiny"
SCHEMA = FeatureSchema(
    camera_slots=("cam",), image_hw=(32, 32), state_dim=SDIM, action_dim=ADIM,
    action_horizon=H, base_model=BASE,
)


def module(head: str = "oft_mlp") -> TenantModule:
    cfg = HeadConfig(feature_dim=feature_dim(BASE), state_dim=SDIM, action_dim=ADIM,
                     action_horizon=H, hidden=16)
    return TenantModule("acme", head, cfg)


def job(task_type: str, **extra: str) -> TrainingJob:
    return TrainingJob(job_id="j", tenant_id="acme", task_type=task_type, workload="p",  # type: ignore[arg-type]
                       metadata=JobMetadata(extra={"instruction": "pick", **extra}))


def columns(*, per_step: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (M, ADIM) if per_step else (M, H, ADIM))
    return {
        CAM: rng.integers(0, 255, (M, 3, 32, 32), dtype=np.uint8),
        STATE_FIELD: rng.normal(size=(M, SDIM)).astype(np.float64),  # converted to float32
        ACTIONS_FIELD: actions,
        "advantages": np.linspace(-1, 1, M).astype(np.float32),
        "returns": np.ones((M, 1), dtype=np.float32),
        OLD_LOGP_FIELD: np.full(M, -2.0, dtype=np.float32),
        DECISION_FIELD: np.array([1, 2, 2, 1, 2, 2], dtype=np.int64),
    }


def test_sft_item_targets_the_chunks_unweighted() -> None:
    m = module()
    item = train_item(job("sft"), m, SCHEMA, columns(), ppo=False, knobs=StepKnobs())
    assert item.target.shape == (M, H, ADIM) and item.target.dtype == torch.float32
    assert item.weight_B is None and item.tenant is m and item.batch.batch_size == M


def test_per_step_actions_are_chunks_of_one() -> None:
    item = train_item(job("sft"), module(), SCHEMA, columns(per_step=True), ppo=False, knobs=StepKnobs())
    assert item.target.shape == (M, 1, ADIM)


def test_awr_item_weighs_rows_by_their_advantage() -> None:
    item = train_item(job("rl"), module(), SCHEMA, columns(), ppo=False, knobs=StepKnobs(awr_beta=0.5))
    assert item.weight_B is not None and item.weight_B.shape == (M,)
    w = item.weight_B.numpy()
    assert np.all(np.diff(w) >= 0) and w[-1] > w[0]  # higher advantage, more weight


def test_ppo_item_stages_the_batch_on_its_module() -> None:
    m = module()
    knobs = StepKnobs(ppo_clip=0.1, vf_coef=0.25, ent_coef=0.01, ppo_epochs=3)
    j = job("rl", actor_forward="1", decisions="1", critic_warmup="5", target_kl="0.05")
    item = train_item(j, m, SCHEMA, columns(), ppo=True, knobs=knobs)
    assert item.weight_B is None
    staged = m._ppo  # what stage_ppo holds for the next step
    assert staged is not None
    assert staged.clip == 0.1 and staged.vf_coef == 0.25 and staged.epochs == 3
    assert staged.target_kl == 0.05
    assert staged.policy_coef == 0.0  # version 0 <= critic_warmup: only the critic trains
    assert staged.old_logp_B.shape == staged.adv_B.shape == staged.returns_B.shape == (M,)
    assert staged.mask_B_H is not None and staged.mask_B_H.shape == (M, H)
    m.stage_ppo(None)
    assert m._ppo is None
