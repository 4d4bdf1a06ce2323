"""Bad data fails only its own job (issue 11, point 4).

* At the door: ``check_values`` refuses rows the trainer cannot use, naming the
  field and what is allowed.
* In the trainer: whatever goes wrong with one tenant's item inside a grouped
  step fails that tenant's job, with the reason; the others in the group step,
  complete and advance; the bad tenant's weights and optimizer are untouched;
  the actor keeps running. On a real nats-server with the tiny backbone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch

from joynexus.agents.actor.agent import Actor
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.features import FeatureSchema, canonicalize_request
from joynexus.agents.models.grouped import TrainItem, isolated_train_step
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import PolicyStore, schema_spec
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker.connection import Broker
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.errors import InvalidSpec, ShapeMismatch
from joynexus.schemas.jobs import JobMetadata, JobState, TrainingJob, WorkloadPolicy
from joynexus.schemas.rows import MAX_ROWS_PER_CALL, check_values

pytestmark = pytest.mark.timeout(180)

S = JobState
CAM = "base_camera"
SCHEMA = FeatureSchema((CAM,), (56, 56), state_dim=4, action_dim=2, action_horizon=2)
FS = schema_spec(SCHEMA)
POLICY = "pick"


def rows(n: int, seed: int, *, nan: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = {
        f"obs_image_{CAM}": rng.integers(0, 256, (n, 3, 56, 56), dtype=np.uint8),
        "obs_state": rng.standard_normal((n, 4), dtype=np.float32),
        "actions": rng.uniform(-1, 1, (n, 2, 2)).astype(np.float32),
    }
    if nan:
        data["actions"][1, 0, 1] = np.nan
    return data


# -- the door: pure value checks ------------------------------------------------


def test_check_values_accepts_what_producers_and_the_sdk_send() -> None:
    check_values(rows(4, 0), FS, "w")
    rollout = {
        **rows(6, 1),
        "rewards": np.linspace(0, 1, 6, dtype=np.float32),
        "dones": np.array([0, 0, 1, 0, 0, 1], dtype=bool),
        "terminated": np.zeros(6, bool),
        "success": np.zeros(6, np.float32),  # "float32 [M]" per the SDK docstring
        "env_id": np.zeros(6, np.int64),
        "step": np.arange(6, dtype=np.int64),
        "episode_index": np.zeros(6, np.int64),
        "frame_index": np.arange(6, dtype=np.int64),
        "episode_seed": np.full(6, 12345, np.int64),
        "my_extra": np.ones((6, 3), np.float64),
    }
    check_values(rollout, FS, "w")


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (lambda d: d["actions"].__setitem__((1, 0, 1), np.nan), InvalidSpec, ["'actions'", "non-finite", "row 1"]),
        (lambda d: d["obs_state"].__setitem__((2, 0), np.inf), InvalidSpec, ["'obs_state'", "non-finite"]),
        (lambda d: d["actions"].__setitem__((0, 0, 0), 1e6), InvalidSpec, ["'actions'", "|x| <= 10"]),
        (lambda d: d["obs_state"].__setitem__((0, 0), 1e9), InvalidSpec, ["'obs_state'", "|x| <= 1"]),
        (lambda d: d.update(obs_image_base_camera=d["obs_image_base_camera"] / 255.0), InvalidSpec, ["uint8"]),
        (lambda d: d.update(actions=d["actions"].astype(np.int32)), InvalidSpec, ["'actions'", "float32"]),
        (lambda d: d.update(rewards=np.array([0, np.nan, 0, 0], np.float32)), InvalidSpec, ["'rewards'"]),
        (lambda d: d.update(dones=np.array([0, 2, 0, 0], np.int64)), InvalidSpec, ["'dones'", "0/1"]),
        (lambda d: d.update(step=np.array([0, -1, 2, 3], np.int64)), InvalidSpec, ["'step'", "from 0"]),
        (lambda d: d.update(env_id=np.zeros(4, np.float32)), InvalidSpec, ["'env_id'", "integer"]),
        (lambda d: d.update(rewards=np.zeros(3, np.float32)), ShapeMismatch, ["same number of rows"]),
        (lambda d: d.update(rewards=np.zeros((4, 2), np.float32)), ShapeMismatch, ["'rewards'", "[B]"]),
    ],
)
def test_check_values_refuses_naming_the_field(change, error, words) -> None:  # type: ignore[no-untyped-def]
    data = rows(4, 0)
    change(data)
    with pytest.raises(error) as e:
        check_values(data, FS, "pick")
    for w in [*words, "'pick'"]:
        assert w in str(e.value), str(e.value)


def test_check_values_bounds_rows_per_call() -> None:
    n = MAX_ROWS_PER_CALL + 1
    with pytest.raises(ShapeMismatch, match=f"at most {MAX_ROWS_PER_CALL}"):
        check_values({"obs_state": np.zeros((n, 4), np.float32)}, FS, "pick")
    with pytest.raises(ShapeMismatch, match="no rows"):
        check_values({"obs_state": np.zeros((0, 4), np.float32)}, FS, "pick")


# -- the trainer: one item's failure stays its own ------------------------------


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    torch.manual_seed(0)
    return Backbone.build(BackboneConfig(size="tiny"))


def module(tenant: str, feature_dim: int, seed: int, loss: str = "l1") -> TenantModule:
    cfg = HeadConfig(feature_dim, SCHEMA.state_dim, SCHEMA.action_dim, SCHEMA.action_horizon, seed=seed, loss=loss)  # type: ignore[arg-type]
    return TenantModule(tenant, "oft_mlp", cfg)


def item(m: TenantModule, data: dict[str, np.ndarray]) -> TrainItem:
    batch = canonicalize_request(SCHEMA, {CAM: data[f"obs_image_{CAM}"]}, "pick", data["obs_state"])
    return TrainItem(m, batch, torch.from_numpy(data["actions"].copy()))


def snapshot(m: TenantModule) -> dict[str, torch.Tensor]:
    sd = {f"head.{k}": v.clone() for k, v in m.head.state_dict().items()}
    for i, s in enumerate(m.optimizer.state.values()):
        sd.update({f"opt.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return sd


def test_isolated_step_fails_only_the_bad_item_and_leaves_it_untouched(backbone: Backbone) -> None:
    d = backbone.feature_dim
    good, nan, huge, wrong = (module(t, d, i, loss="mse") for i, t in enumerate(("good", "nan", "huge", "wrong")))
    items = [item(good, rows(4, 0)), item(nan, rows(4, 1)), item(huge, rows(4, 2)), item(wrong, rows(4, 3))]
    isolated_train_step(backbone, items)  # every module has optimizer state now
    before = {m.tenant: snapshot(m) for m in (nan, huge, wrong)}
    bad_nan = rows(4, 1, nan=True)
    bad_huge = rows(4, 2)
    bad_huge["actions"][:] = 3e38  # finite, but the squared error overflows
    items = [
        item(good, rows(4, 10)),
        item(nan, bad_nan),
        item(huge, bad_huge),
        TrainItem(wrong, items[3].batch, torch.zeros(4, 3, 2)),  # its loss raises (shape)
    ]
    out = isolated_train_step(backbone, items)
    assert isinstance(out[0], float) and good.version == 2
    assert isinstance(out[1], InvalidSpec) and "non-finite" in str(out[1]) and "targets (actions)" in str(out[1])
    assert isinstance(out[2], InvalidSpec) and "non-finite" in str(out[2])
    assert isinstance(out[3], ShapeMismatch)
    for m in (nan, huge, wrong):
        assert m.version == 1 and m.finite()
        after = snapshot(m)
        assert after.keys() == before[m.tenant].keys()
        assert all(torch.equal(after[k], before[m.tenant][k]) for k in after), m.tenant
    # A bad item no longer has a say: the next step of that tenant trains normally.
    assert isinstance(isolated_train_step(backbone, [item(nan, rows(4, 5))])[0], float) and nan.version == 2


# -- the actor on a real broker ---------------------------------------------------


@pytest.fixture
async def sched(broker: Broker) -> AsyncIterator[SchedulerAgent]:
    agent = SchedulerAgent(broker, instance="sched", lease_ttl_s=30.0, expire_every_s=0.2)
    await agent.start()
    yield agent
    await agent.stop()


async def ready_job(c: SchedulerClient, tq: TrainingQueue, tenant: str, data: dict[str, np.ndarray]) -> TrainingJob:
    """A job whose rows are in the Training Queue, as the service writes them (no door check)."""
    job = await c.reserve(
        tenant,
        "sft",
        workload=POLICY,
        sample_count=len(data["obs_state"]),
        metadata=JobMetadata(schema_signature=SCHEMA.signature(), extra={"instruction": "pick the cube"}),
    )
    assert job is not None, c.last_refusal
    await tq.async_put(data, tenant_id=tenant, partition_id=job.partition_id)
    await c.mark(job.job_id, S.READY)
    return job


async def ended(c: SchedulerClient, jobs: list[TrainingJob], within: float = 90.0) -> list[TrainingJob]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        now = [await c.get_job(j.job_id) for j in jobs]
        if all(j.state in (S.COMPLETED, S.FAILED) for j in now):
            return now
        if loop.time() > deadline:
            raise AssertionError(f"jobs did not end: {[(j.job_id, j.state) for j in now]}")
        await asyncio.sleep(0.2)


async def test_nan_rows_fail_only_their_job_and_the_actor_keeps_training(
    broker: Broker, sched: SchedulerAgent, backbone: Backbone, tmp_path: Path
) -> None:
    c = SchedulerClient(broker, by="test")
    for t in ("acme", "bolt"):
        await c.set_policy(WorkloadPolicy(tenant_id=t, task_type="sft", workload=POLICY, max_in_flight=8))
    policies = PolicyStore(broker)
    first = {}
    for i, t in enumerate(("acme", "bolt")):
        m = module(t, backbone.feature_dim, seed=i)
        first[t] = {k: v.clone() for k, v in m.head.state_dict().items()}
        await policies.publish(t, POLICY, m, SCHEMA, version=1)
    tq = TrainingQueue(broker)
    good = await ready_job(c, tq, "acme", rows(4, 0))
    bad = await ready_job(c, tq, "bolt", rows(4, 1, nan=True))  # past the door: written directly

    # Both jobs are ready before the actor starts: it leases them into one group.
    actor = Actor(broker, backbone, instance="actor", out_dir=tmp_path / "actor", lease_wait_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(actor.run(stop))
    try:
        g, b = await ended(c, [good, bad])
        assert actor.steps == 1  # one grouped step for both tenants
        assert b.state is S.FAILED, b
        assert "non-finite" in b.reason and "actions" in b.reason, b.reason
        assert g.state is S.COMPLETED and g.result_version == 2, g
        assert (await policies.latest("acme", POLICY)).version == 2
        assert (await policies.latest("bolt", POLICY)).version == 1  # nothing published for it
        assert not task.done()
        bolt = actor.tenants[("bolt", POLICY)].module
        assert bolt.version == 1 and bolt.finite()
        assert all(torch.equal(v, first["bolt"][k]) for k, v in bolt.head.state_dict().items())

        # The actor goes on: the next jobs of both tenants train (grouped or not:
        # it may lease the first before the second is ready).
        jobs = [await ready_job(c, tq, "acme", rows(4, 2)), await ready_job(c, tq, "bolt", rows(4, 3))]
        g2, b2 = await ended(c, jobs)
        assert (g2.state, g2.result_version) == (S.COMPLETED, 3), g2
        assert (b2.state, b2.result_version) == (S.COMPLETED, 2), b2
        assert actor.steps in (2, 3) and not task.done()
        rec = await policies.latest("bolt", POLICY)
        assert rec.version == 2
        published = await policies.load_module(rec)
        assert published.finite() and all(bool(torch.isfinite(p).all()) for p in published.head.parameters())
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
