"""Every accepted spec runs (issue 24, item 6).

A property test draws workload specs within the schema's bounds (and the default
quota's, which the door applies), the edges included (min, max, one step inside),
and runs each through the code that consumes it, without a nats-server: the door
(``bound_spec``, the wire round trip), the sample layout (``workload_schema``), the
head as ``publish_fresh`` builds it, the producers' own decisions (the SFT batch
order and rows, the RL producer's env arguments, seeds and job extras), the
advantage stage and the actor's step (its ``_item`` and the grouped step, on the
real backbone), inference, the evaluator's episode seeds, videos and periodic
evaluations; a few drawn specs also roll out and evaluate in a real ManiSkill env.
The other direction: a value just outside a bound is refused at creation with an
``InvalidSpec`` that names the field.

The mismatches this found (each a row of
``test_a_value_the_consumer_cannot_take_is_refused_at_creation``):
image sizes the base's image processor resizes to another grid (every forward
failed), learning rates below the actor's 1e-9 and discounts below the advantage
stage's 1e-3 (silently replaced by the actor's / the stage's defaults), a GAE
lambda of 0 refused although the stage takes it, GRPO over a single env (every
advantage 0), and an ``init_from_workload`` that is no workload name.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import asdict
from functools import partial
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from workload_specs import spec as make_spec

from joynexus.agents.actor.agent import Actor
from joynexus.agents.actor.batch import StepKnobs
from joynexus.agents.actor.forward import gaussian_head
from joynexus.agents.actor.state import TenantState
from joynexus.agents.advantage import AdvantageAgent, gae
from joynexus.agents.control.checks import bound_spec
from joynexus.agents.envs.maniskill.rollout import episode_seed
from joynexus.agents.envs.maniskill.tasks import TASKS
from joynexus.agents.envs.pool import build_key
from joynexus.agents.envs.registry import task_spec
from joynexus.agents.envs.video import EpisodeVideos, decode_frames
from joynexus.agents.evaluator import MAX_PERIODIC_EVALS, Evaluator
from joynexus.agents.featureschema import FeatureSchema, schema_spec
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.features import canonicalize_request
from joynexus.agents.models.grouped import (
    ActRequest,
    encode_for,
    grouped_forward,
    grouped_train_step,
)
from joynexus.agents.models.heads.base import HEADS
from joynexus.agents.models.heads.gaussian import GaussianPolicy
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import fresh_module, module_from_weights
from joynexus.agents.producers.rl import RLProducer
from joynexus.agents.producers.schema import (
    chunk_targets,
    decision_lengths,
    normalization_stats,
    workload_schema,
)
from joynexus.agents.producers.sft import batch_indices, job_extra
from joynexus.broker.subjects import Names
from joynexus.schemas import catalog, samples
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import InvalidMessage, InvalidSpec, QuotaExceeded
from joynexus.schemas.inference import PolicyRecord
from joynexus.schemas.jobs import JobMetadata, TrainingJob
from joynexus.schemas.quotas import DEFAULT_QUOTA, Quota
from joynexus.schemas.workloads import (
    MAX_EVAL_VIDEOS,
    MAX_SEED,
    MIN_GAMMA,
    MIN_LEARNING_RATE,
    Scheduling,
    WorkloadRecord,
    WorkloadSpec,
)

Q = DEFAULT_QUOTA
TENANT = "acme"
#: Every image size the schema accepts (the base reads each at its own grid).
IMAGE_SIZES = [s for s in range(catalog.MIN_IMAGE_SIZE, catalog.MAX_IMAGE_SIZE + 1) if catalog.resized_side(s) == catalog.BASE_IMAGE_SIDE]
LIBERO_SAMPLE = ("LIBERO-spatial-0", "LIBERO-90-89", "LIBERO-10-9")
#: Rows of the actor's step and of inference per drawn spec (the batch size itself
#: is exercised by the SFT producer's rows; a step of 512 images per spec is slow).
ROWS = 3


# ------------------------------------------------------------------ drawing specs
def _int(rng: random.Random, lo: int, hi: int) -> int:
    """Within [lo, hi], the edges and the values just inside them often."""
    r = rng.random()
    if r < 0.15:
        return lo
    if r < 0.3:
        return hi
    if r < 0.37:
        return min(lo + 1, hi)
    if r < 0.44:
        return max(hi - 1, lo)
    if r < 0.7 and hi > max(lo, 1) * 4:  # log-uniform: small values as often as large
        return min(hi, max(lo, round(math.exp(rng.uniform(math.log(max(lo, 1)), math.log(hi))))))
    return rng.randint(lo, hi)


def _float(rng: random.Random, lo: float, hi: float, *, hi_open: bool = False, log: bool = False) -> float:
    top = math.nextafter(hi, -math.inf) if hi_open else hi
    r = rng.random()
    if r < 0.15:
        return lo
    if r < 0.3:
        return top
    if r < 0.37:
        return math.nextafter(lo, math.inf)
    if r < 0.44:
        return math.nextafter(top, -math.inf)
    if log:
        return min(top, max(lo, math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    return min(top, rng.uniform(lo, hi))


def _cameras_and_state(rng: random.Random, env: str) -> tuple[list[str], list[str]]:
    if env in TASKS:
        cams = list(TASKS[env].cameras)
        keys = ["proprio", "privileged", "agent/qpos"]
    else:
        from joynexus.agents.envs import libero_tasks

        cams = list(libero_tasks.CAMERAS)
        keys = ["proprio", "privileged"]
    cameras = rng.sample(cams, rng.randint(1, len(cams))) if rng.random() < 0.3 else []
    state = [rng.choice(keys)] if rng.random() < 0.3 else []
    return cameras, state


def draw_spec(rng: random.Random, task_type: str, dataset: str, *, envs: tuple[str, ...] = ()) -> WorkloadSpec:
    """A spec within the schema's bounds and the default quota's."""
    env = rng.choice(envs or (*catalog.RL_ENVS, *LIBERO_SAMPLE))
    advantage = rng.choice(["gae", "grpo"]) if task_type == "rl" else "gae"
    # num_envs within the quota's rows per inference request: see
    # test_num_envs_over_the_inference_rows_quota_is_accepted_at_the_door below.
    num_envs = _int(rng, 2 if advantage == "grpo" else 1, Q.max_infer_rows)
    kw: dict[str, Any] = dict(
        name=f"w{rng.randrange(10**6)}",
        task_type=task_type,
        base_model=rng.choice(sorted(catalog.BASE_MODELS)),
        # Modules for any base (this test hosts the Qwen bases; pi05_expert: tests/unit/test_pi05.py).
        action_module=rng.choice([m for m in catalog.ACTION_MODULES if m not in catalog.BASE_FAMILY_HEADS]),
        num_envs=num_envs,
        horizon=_int(rng, 1, Q.max_rollout_steps // num_envs),
        action_horizon=_int(rng, 1, Q.max_action_horizon),
        head_hidden=_int(rng, 8, 512),
        batch_size=_int(rng, 1, Q.max_batch_size),
        learning_rate=_float(rng, MIN_LEARNING_RATE, 1.0, hi_open=True, log=True),
        seed=_int(rng, 0, MAX_SEED),
        gamma=_float(rng, MIN_GAMMA, 1.0),
        gae_lambda=_float(rng, 0.0, 1.0),
        target_kl=_float(rng, 0.0, 1.0),
        exploration_std=None if rng.random() < 0.3 else _float(rng, 0.0, 1.0),
        critic_warmup=None if rng.random() < 0.3 else _int(rng, 0, 100_000),
        advantage=advantage,
        instruction=rng.choice(["", "pick up the cube", "é" * (Q.max_instruction_bytes // 2)]),
        scheduling=Scheduling(
            max_in_flight=_int(rng, 1, Q.max_in_flight),
            max_active_rollouts=_int(rng, 1, Q.max_active_rollouts),
            completion_target=None if rng.random() < 0.5 else _int(rng, 1, 10**6),
            max_policy_staleness=None if rng.random() < 0.5 else _int(rng, 0, 1000),
        ),
    )
    if task_type in ("rl", "eval") or rng.random() < 0.5:
        kw["env"] = env
    if task_type == "sft":
        kw["dataset"] = dataset
    else:
        kw["cameras"], kw["state"] = _cameras_and_state(rng, env)
    if task_type == "eval":
        kw["init_from_workload"] = rng.choice(["base", "a" * 32, "0-_z"])
        kw["init_from"] = None if rng.random() < 0.5 else _int(rng, 0, 10**6)
        kw["episodes"] = _int(rng, 1, Q.max_eval_episodes)
        episodes = kw["episodes"]
    elif "env" in kw and rng.random() < 0.6:
        kw["eval_every"] = _int(rng, 1, 1_000_000)
        kw["eval_episodes"] = episodes = _int(rng, 1, Q.max_eval_episodes)
    else:
        episodes = 0
    if episodes and rng.random() < 0.6:
        kw["eval_videos"] = _int(rng, 1, min(Q.max_eval_videos, MAX_EVAL_VIDEOS, episodes))
        kw["video_frames"] = _int(rng, 1, Q.max_video_frames)
        kw["video_size"] = 0 if rng.random() < 0.3 else _int(rng, 16, Q.max_video_size)
    # The image size: any the schema takes (the video quota bounds it when videos
    # are saved at the camera's own size).
    most = Q.max_video_size if kw.get("eval_videos") and not kw.get("video_size") else catalog.MAX_IMAGE_SIZE
    sizes = [s for s in IMAGE_SIZES if s <= most]
    r = rng.random()
    kw["image_size"] = sizes[0] if r < 0.15 else sizes[-1] if r < 0.3 else rng.choice(sizes)
    return WorkloadSpec(**kw)


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def backbones() -> dict[str, Backbone]:
    torch.set_num_threads(1)
    return {name: Backbone.build(BackboneConfig(size=size)) for name, size in catalog.BASE_MODELS.items()}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A LeRobot dataset's meta files (what the control plane and the SFT producer's
    schema read), recorded at 64 pixels from PickCube's default observation."""
    root = tmp_path_factory.mktemp("ds") / "demo"
    (root / "meta").mkdir(parents=True)
    feats = {
        "observation.images.base_camera": {"dtype": "video", "shape": [64, 64, 3]},
        "observation.state": {"dtype": "float32", "shape": [12]},
        "action": {"dtype": "float32", "shape": [4]},
    }
    (root / "meta" / "info.json").write_text(json.dumps({"features": feats}))
    stats = {"observation.state": {"mean": [0.1] * 12, "std": [0.5] * 12},
             "action": {"mean": [0.0] * 4, "std": [0.3] * 4}}
    (root / "meta" / "stats.json").write_text(json.dumps(stats))
    return str(root)


# ------------------------------------------------------------------ what consumes a spec
class FakeTQ:
    """The Training Queue as the stages read and write it: one partition's columns."""

    def __init__(self, data: dict[str, np.ndarray]) -> None:
        self.data = data
        self.put: dict[str, np.ndarray] = {}

    async def async_get_meta(self, fields: list[str], count: int, **_: Any) -> Any:
        missing = [f for f in fields if f not in self.data]
        assert not missing, f"the stage reads {missing}, which the producer does not write"
        return SimpleNamespace(rows=list(range(len(self.data[fields[0]]))), fields=fields)

    async def async_get_data(self, meta: Any) -> dict[str, np.ndarray]:
        return {f: self.data[f] for f in meta.fields}

    async def async_put(self, data: dict[str, np.ndarray], **_: Any) -> None:
        self.put.update(data)


async def _no_stage(*_: Any) -> None:
    raise LookupError("no actor_forward consumer in this deployment")


def rl_stub(spec: WorkloadSpec, *, stage: bool) -> Any:
    """What RLProducer's decisions read of it (``stage``: the deployment runs actor_forward)."""
    broker = SimpleNamespace(names=Names(), js=SimpleNamespace(consumer_info=_no_stage))
    return SimpleNamespace(spec=spec, gaussian=gaussian_head(spec.action_module), _stage_seen=stage, b=broker)


def job_of(spec: WorkloadSpec, extra: dict[str, str], rows: int) -> TrainingJob:
    return TrainingJob(job_id="j1", tenant_id=TENANT, task_type=spec.task_type, workload=spec.name,
                       sample_count=rows, metadata=JobMetadata(extra=extra))


def observations(schema: FeatureSchema, rows: int, g: np.random.Generator) -> dict[str, np.ndarray]:
    h, w = schema.image_hw
    cols = {samples.image_field(c): g.integers(0, 256, (rows, 3, h, w), dtype=np.uint8) for c in schema.camera_slots}
    cols[samples.STATE_FIELD] = g.normal(size=(rows, schema.state_dim)).astype(np.float32)
    return cols


def advantage_columns(spec: WorkloadSpec, g: np.random.Generator) -> dict[str, np.ndarray]:
    """A whole rollout's scalar columns (num_envs x horizon rows), as the producer writes them."""
    n, t = spec.num_envs, spec.horizon
    return {
        samples.ENV_ID_FIELD: np.repeat(np.arange(n), t),
        samples.STEP_FIELD: np.tile(np.arange(t), n),
        samples.REWARDS_FIELD: g.random(n * t).astype(np.float32),
        samples.DONES_FIELD: g.random(n * t) < 0.05,
        samples.VALUES_FIELD: g.normal(size=n * t).astype(np.float32),
        samples.SUCCESS_FIELD: g.random(n * t) < 0.1,
        samples.TERMINATED_FIELD: g.random(n * t) < 0.05,
    }


def run_advantages(spec: WorkloadSpec, extra: dict[str, str], g: np.random.Generator) -> None:
    """The advantage stage on the job: it applies the spec's gamma and lambda."""
    data = advantage_columns(spec, g)
    tq = FakeTQ(data)
    job = job_of(spec, extra, len(data[samples.STEP_FIELD]))
    rows = asyncio.run(AdvantageAgent.work(SimpleNamespace(tq=tq, gamma=0.5, lam=0.5), job))  # type: ignore[arg-type]
    assert rows == spec.num_envs * spec.horizon
    adv = tq.put[samples.ADVANTAGES_FIELD]
    assert adv.shape == (rows,) and np.isfinite(adv).all() and np.isfinite(tq.put[samples.RETURNS_FIELD]).all()
    if spec.advantage == "grpo":
        assert np.abs(adv).max() > 0, "GRPO over this rollout's envs learns nothing"
    elif extra.get("actor_forward") != "1":  # values 0: the plain GAE of the rewards
        r = data[samples.REWARDS_FIELD].reshape(spec.num_envs, spec.horizon)
        d = data[samples.DONES_FIELD].reshape(spec.num_envs, spec.horizon)
        want, _ = gae(r, np.zeros_like(r), d, gamma=spec.gamma, lam=spec.gae_lambda)
        np.testing.assert_allclose(adv, want.reshape(-1), rtol=1e-5, atol=1e-5)


def actor_step(
    spec: WorkloadSpec, schema: FeatureSchema, module: TenantModule, backbone: Backbone,
    extra: dict[str, str], data: dict[str, np.ndarray],
) -> None:
    """The actor's ``_item`` (which fields it reads, the learning rate it applies, the
    PPO batch) and the grouped step on the real backbone, on version 1 loaded as the
    actor loads it (its weights, the actor's default rate); then inference."""
    from safetensors.torch import save

    rec = PolicyRecord(tenant_id=TENANT, workload=spec.name, version=1, head_type=spec.action_module,
                       head_config=asdict(module.cfg), schema_signature=schema.signature(),
                       feature_schema=schema_spec(schema), base_model=spec.base_model, object_name="x")
    weights = save({k: v.contiguous() for k, v in module.head.state_dict().items()})
    module = module_from_weights(rec, weights)
    st = TenantState(module=module, record=rec)
    job = job_of(spec, extra, len(data[samples.STATE_FIELD]))
    actor = SimpleNamespace(tq=FakeTQ(data), knobs=StepKnobs())
    item = asyncio.run(Actor._item(actor, job, st))  # type: ignore[arg-type]
    assert module.lr == spec.learning_rate, "the actor trains at another rate than the spec's"
    before = module.version
    (loss,) = grouped_train_step(backbone, [item])
    assert math.isfinite(loss) and module.version == before + 1 and module.finite()
    (actions,) = grouped_forward(backbone, [ActRequest(module, item.batch)])
    assert actions.shape == (len(data[samples.STATE_FIELD]), schema.action_horizon, schema.action_dim)
    assert torch.isfinite(actions).all()
    if isinstance(module.head, GaussianPolicy):  # the RL producer samples with this std
        floor = float(spec.exploration_std or 0.0)
        assert torch.isfinite(module.head.action_std_A(floor)).all()


def rl_rows(spec: WorkloadSpec, schema: FeatureSchema, module: TenantModule, backbone: Backbone,
            ppo: bool, g: np.random.Generator) -> dict[str, np.ndarray]:
    """ROWS rows of a rollout as the actor reads them (chunks, decisions, old log-probs)."""
    data = observations(schema, ROWS, g)
    h = schema.action_horizon
    data[samples.ACTIONS_FIELD] = chunk_targets(
        g.uniform(-1, 1, (ROWS, schema.action_dim)).astype(np.float32),
        np.zeros(ROWS, np.int64), np.zeros(ROWS, np.int64), np.arange(ROWS), h,
    )
    data[samples.ADVANTAGES_FIELD] = g.normal(size=ROWS).astype(np.float32)
    if ppo:
        chunk_step = np.array([0, min(1, h - 1), 0])
        data[samples.DECISION_FIELD] = decision_lengths(chunk_step, np.zeros(ROWS, np.int64), np.arange(ROWS))
        data[samples.RETURNS_FIELD] = g.normal(size=ROWS).astype(np.float32)
        batch = canonicalize_request(schema, {c: data[samples.image_field(c)] for c in schema.camera_slots},
                                     "x", data[samples.STATE_FIELD])
        head = module.head
        assert isinstance(head, GaussianPolicy)
        with torch.no_grad():
            x = encode_for(backbone, batch, module)
            data[samples.OLD_LOGP_FIELD] = head.log_prob(
                x, batch.state_B_S, torch.from_numpy(data[samples.ACTIONS_FIELD]), float(spec.exploration_std or 0.0)
            ).numpy()
    return data


def periodic_specs(spec: WorkloadSpec, signature: str) -> list[WorkloadSpec]:
    """The evaluations ``eval_every`` makes of it (the evaluator's ``_periodic``)."""
    made: dict[str, bytes] = {}

    async def create(key: str, value: bytes) -> None:
        made[key] = value

    ev = SimpleNamespace(b=SimpleNamespace(names=Names()), _kv=SimpleNamespace(create=create),
                         records={}, created=[])
    for version in (spec.eval_every, spec.eval_every * MAX_PERIODIC_EVALS):
        assert asyncio.run(Evaluator._periodic(ev, TENANT, spec, version, signature))  # type: ignore[arg-type]
    return [decode(v, WorkloadRecord).spec for v in made.values()]


def check_videos(spec: WorkloadSpec, image_size: int, g: np.random.Generator) -> None:
    if not spec.eval_videos:
        return
    rec = EpisodeVideos(spec.eval_videos, "observation.images.cam", max_frames=spec.video_frames,
                        size=spec.video_size)
    for _ in range(2):
        obs = {"observation.images.cam": g.integers(0, 256, (1, 3, image_size, image_size), dtype=np.uint8)}
        rec.observe([0], obs, np.ones(1, bool))
    (_, data), *_ = rec.encoded()
    frames = decode_frames(data)
    assert frames and max(frames[0].shape[:2]) <= (spec.video_size or image_size)


def run_spec(spec: WorkloadSpec, backbones: dict[str, Backbone], rng: random.Random) -> None:
    """Everything that consumes ``spec``, short of a broker and a simulator."""
    g = np.random.default_rng(rng.randrange(2**32))
    # The door: the quota, and the wire (a decode validates again).
    assert bound_spec(TENANT, spec, Q).scheduling.priority == Q.priority
    assert decode(encode(spec), WorkloadSpec) == spec
    schema, instruction = workload_schema(spec)
    assert schema.action_horizon == spec.action_horizon
    backbone = backbones[spec.base_model]
    if spec.task_type == "rl":
        build = RLProducer._build_args(rl_stub(spec, stage=True), schema)  # type: ignore[arg-type]
        env_spec = task_spec(build.pop("name"), **{k: v for k, v in build.items() if k != "seed"})
        assert (env_spec.cameras, env_spec.state_dim) == (schema.camera_slots, schema.state_dim)
        build_key(spec.env, **{k: v for k, v in build.items() if k != "seed"})
        for salt in (0, 996):  # the producer's noise and rollout seeds, one worker and several
            np.random.default_rng(spec.seed * 7919 + salt)
            assert 0 <= episode_seed(spec.seed * 100_003 + 10**6 + salt * 1_000_000, spec.num_envs - 1, 10**6) < 2**31
        for stage in (False, True):
            extra = {"instruction": instruction, "advantage": spec.advantage,  # as _reserve writes them
                     **asyncio.run(RLProducer._route_extra(rl_stub(spec, stage=stage)))}  # type: ignore[arg-type]
            run_advantages(spec, extra, g)
            module = fresh_module(TENANT, spec, schema, normalization_stats(spec))
            ppo = extra.get("actor_forward") == "1"
            actor_step(spec, schema, module, backbone, extra, rl_rows(spec, schema, module, backbone, ppo, g))
    elif spec.task_type == "sft":
        for n in (1, 7):  # dataset lengths: the batch wraps around a short one
            order = np.random.default_rng(spec.seed).permutation(n)
            for cursor in (0, 10**9):
                idx = batch_indices(order, cursor, spec.batch_size)
                assert len(idx) == spec.batch_size and all(0 <= i < n for i in idx)
        extra = job_extra(instruction, 0, "", spec.learning_rate)
        data = observations(schema, ROWS, g)
        data[samples.ACTIONS_FIELD] = g.normal(size=(ROWS, spec.action_horizon, schema.action_dim)).astype(np.float32)
        actor_step(spec, schema, fresh_module(TENANT, spec, schema, normalization_stats(spec)), backbone, extra, data)
    else:  # eval: the evaluated policy is one trained in this env with this layout
        for e in (0, spec.episodes - 1):
            assert 0 <= episode_seed(spec.seed, 0, e) < 2**31 and 0 <= episode_seed(spec.seed, 1, e) < 2**31
        module = fresh_module(TENANT, spec, schema, normalization_stats(spec))
        obs = observations(schema, ROWS, g)
        batch = canonicalize_request(schema, {c: obs[samples.image_field(c)] for c in schema.camera_slots},
                                     instruction, obs[samples.STATE_FIELD])
        (actions,) = grouped_forward(backbone, [ActRequest(module, batch)])
        assert torch.isfinite(actions).all()
        check_videos(spec, schema.image_hw[0], g)
    if spec.eval_every:
        for p in periodic_specs(spec, schema.signature()):
            workload_schema(p)  # the evaluator's first step (its instruction)
            check_videos(p, schema.image_hw[0], g)


# ------------------------------------------------------------------ the property
@pytest.mark.parametrize(("task_type", "n"), [("rl", 50), ("sft", 40), ("eval", 40)])
def test_every_drawn_spec_runs_through_what_consumes_it(
    task_type: str, n: int, backbones: dict[str, Backbone], dataset: str
) -> None:
    rng = random.Random(f"issue-24-{task_type}")
    for _ in range(n):
        spec = draw_spec(rng, task_type, dataset)
        try:
            run_spec(spec, backbones, rng)
        except Exception as e:
            raise AssertionError(f"{type(e).__name__}: {e}\nspec: {msgspec.json.encode(spec).decode()}") from e


def test_the_edges_run(backbones: dict[str, Backbone], dataset: str) -> None:
    """Every bound at once, both ends (the draws above reach them one at a time)."""
    low = dict(num_envs=1, horizon=1, action_horizon=1, head_hidden=8, batch_size=1, seed=0,
               learning_rate=MIN_LEARNING_RATE, gamma=MIN_GAMMA, gae_lambda=0.0, target_kl=0.0,
               exploration_std=0.0, critic_warmup=0, image_size=IMAGE_SIZES[0])
    high = dict(num_envs=Q.max_infer_rows, horizon=Q.max_rollout_steps // Q.max_infer_rows,
                action_horizon=Q.max_action_horizon, head_hidden=512, batch_size=Q.max_batch_size,
                seed=MAX_SEED, learning_rate=math.nextafter(1.0, 0.0), gamma=1.0, gae_lambda=1.0,
                target_kl=1.0, exploration_std=1.0, critic_warmup=100_000, image_size=IMAGE_SIZES[-1])
    rng = random.Random(24)
    for bounds in (low, high):
        for module in (m for m in catalog.ACTION_MODULES if m not in catalog.BASE_FAMILY_HEADS):
            for base in catalog.BASE_MODELS:
                common = dict(bounds, action_module=module, base_model=base)
                run_spec(WorkloadSpec(name="rl", task_type="rl", env="PushCube-v1", **common), backbones, rng)
                run_spec(WorkloadSpec(name="sft", task_type="sft", dataset=dataset, **common), backbones, rng)
        run_spec(WorkloadSpec(name="ev", task_type="eval", env="LIBERO-90-89", init_from_workload="b",
                              episodes=Q.max_eval_episodes, eval_videos=Q.max_eval_videos,
                              video_frames=Q.max_video_frames, video_size=16, **bounds), backbones, rng)


def policy(spec: WorkloadSpec, schema: FeatureSchema, instruction: str, module: TenantModule,
           backbone: Backbone, g: np.random.Generator) -> Any:
    """The RL producer's act: the policy's chunk (inference on the real backbone) plus
    Gaussian exploration of the spec's std, clipped to the env's action range."""

    async def act(obs: dict[str, Any]) -> np.ndarray:
        batch = canonicalize_request(schema, {c: obs[f"{samples.OBS_IMAGES}.{c}"] for c in schema.camera_slots},
                                     instruction, obs[samples.OBS_STATE])
        (chunk,) = grouped_forward(backbone, [ActRequest(module, batch)])
        noise = g.normal(size=chunk.shape).astype(np.float32) * (spec.exploration_std or 0.1)
        return np.clip(chunk.numpy() + noise, -1.0, 1.0)

    return act


def test_drawn_specs_roll_out_and_evaluate_in_a_real_simulator(backbones: dict[str, Backbone], dataset: str) -> None:
    """A few drawn specs, small enough to run: a real ManiSkill env built from the
    producer's arguments, a rollout with the spec's policy, its advantages and the
    actor's step; an evaluation round with videos (the first env costs ~10 s)."""
    from joynexus.agents.envs.maniskill import rollout, run_episodes
    from joynexus.agents.envs.registry import make_env

    rng = random.Random("issue-24-sim-4")  # a GAE and a GRPO rollout, an evaluation with a video
    g = np.random.default_rng(24)
    for task_type in ("rl", "rl", "eval"):
        spec = draw_spec(rng, task_type, dataset, envs=("PickCube-v1", "PushCube-v1"))
        spec = msgspec.structs.replace(  # a rollout and an episode short enough for a test
            spec, num_envs=min(spec.num_envs, 2) if spec.advantage == "gae" else 2,
            horizon=min(spec.horizon, 3), episodes=min(spec.episodes, 2),
            eval_videos=min(spec.eval_videos, 1, spec.episodes),
        )
        schema, instruction = workload_schema(spec)
        backbone = backbones[spec.base_model]
        module = fresh_module(TENANT, spec, schema, normalization_stats(spec))
        act = policy(spec, schema, instruction, module, backbone, g)
        if task_type == "rl":
            build = RLProducer._build_args(rl_stub(spec, stage=False), schema)  # type: ignore[arg-type]
            env = make_env(build.pop("name"), **build)
            try:
                out = asyncio.run(rollout(env, act, horizon=spec.horizon, seed=spec.seed * 100_003))
            finally:
                env.close()
            assert len(out[samples.STATE_FIELD]) == spec.num_envs * spec.horizon
            extra = {"instruction": instruction, "advantage": spec.advantage,  # as _reserve writes them
                     **asyncio.run(RLProducer._route_extra(rl_stub(spec, stage=False)))}  # type: ignore[arg-type]
            run_advantages(spec, extra, g)
            out[samples.ACTIONS_FIELD] = chunk_targets(out.pop(samples.EXECUTED_ACTION_FIELD), out[samples.ENV_ID_FIELD],
                                               out[samples.EPISODE_INDEX_FIELD], out[samples.FRAME_INDEX_FIELD],
                                               schema.action_horizon)
            out[samples.ADVANTAGES_FIELD] = g.normal(size=len(out[samples.STATE_FIELD])).astype(np.float32)
            actor_step(spec, schema, module, backbone, extra, out)
        else:
            rec = EpisodeVideos(spec.eval_videos, f"{samples.OBS_IMAGES}.{schema.camera_slots[0]}",
                                max_frames=spec.video_frames, size=spec.video_size)

            # The evaluator's factory (evaluate_record): the policy's own observation.
            factory = partial(make_env, spec.env, obs="rgb", num_envs=spec.num_envs,
                              image_size=schema.image_hw[0], seed=spec.seed, cameras=schema.camera_slots,
                              state_keys=schema.state_keys or spec.state or None)
            result, finished = asyncio.run(run_episodes(factory, act, episodes=spec.episodes, max_steps=3,
                                                        seed=spec.seed, recorder=rec))
            assert finished and result["episodes"] == spec.episodes
            if spec.eval_videos:
                assert len(rec.encoded()) == spec.eval_videos


# ------------------------------------------------------------------ the other direction
@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"name": ""}, "workload name"),
        ({"name": "a" * 33}, "workload name"),
        ({"task_type": "rlx"}, "task_type"),
        ({"base_model": "qwen2.5-vl-huge"}, "base_model"),
        ({"action_module": "value"}, "action_module"),
        ({"env": "PickCube-v2"}, "env"),
        ({"env": "LIBERO-spatial-10"}, "env"),
        ({"task_type": "sft", "dataset": ""}, "dataset"),
        ({"task_type": "eval", "init_from_workload": ""}, "init_from_workload"),
        ({"init_from": -1}, "init_from"),
        ({"init_from_export": "x" * 1025}, "init_from_export"),
        ({"num_envs": 0}, "num_envs"),
        ({"horizon": 0}, "horizon"),
        ({"batch_size": 0}, "batch_size"),
        ({"action_horizon": 0}, "action_horizon"),
        ({"image_size": catalog.MIN_IMAGE_SIZE - 1}, "image_size"),
        ({"image_size": catalog.MAX_IMAGE_SIZE + 1}, "image_size"),
        ({"head_hidden": 7}, "head_hidden"),
        ({"head_hidden": 513}, "head_hidden"),
        ({"learning_rate": 1.0}, "learning_rate"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": math.nan}, "learning_rate"),
        ({"seed": -1}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"gamma": 1.0 + 1e-9}, "gamma"),
        ({"gae_lambda": 1.0 + 1e-9}, "gae_lambda"),
        ({"gae_lambda": -1e-9}, "gae_lambda"),
        ({"target_kl": -1e-9}, "target_kl"),
        ({"target_kl": 1.0 + 1e-9}, "target_kl"),
        ({"exploration_std": -1e-9}, "exploration_std"),
        ({"exploration_std": 1.0 + 1e-9}, "exploration_std"),
        ({"critic_warmup": -1}, "critic_warmup"),
        ({"critic_warmup": 100_001}, "critic_warmup"),
        ({"episodes": 0}, "episodes"),
        ({"eval_every": -1}, "eval_every"),
        ({"eval_every": 1_000_001}, "eval_every"),
        ({"eval_episodes": 0}, "eval_episodes"),
        ({"eval_videos": MAX_EVAL_VIDEOS + 1, "eval_episodes": 100}, "eval_videos"),
        ({"eval_videos": 3, "eval_episodes": 2}, "eval_videos"),
        ({"video_frames": 0}, "video_frames"),
        ({"video_size": 15}, "video_size"),
        ({"video_size": 257}, "video_size"),
        ({"state": ["x"] * 2}, "state"),
        ({"cameras": ["a b"]}, "cameras"),
        ({"cameras": [f"c{i}" for i in range(5)]}, "cameras"),
        ({"scheduling": {"max_in_flight": 0}}, "scheduling.max_in_flight"),
        ({"scheduling": {"completion_target": 0}}, "scheduling.completion_target"),
        ({"scheduling": {"max_policy_staleness": -1}}, "scheduling.max_policy_staleness"),
    ],
)
def test_a_value_just_outside_a_bound_is_refused_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.")):
        make_spec(**changes)


@pytest.mark.parametrize(
    ("changes", "field", "why"),
    [
        # The base's image processor (Qwen2-VL's smart_resize pinned to 56x56) sends
        # these to a 28 or 84 pixel grid: the backbone then refused every forward
        # ("8 image tokens but 2 image embeddings"), rollouts, training and evaluations.
        ({"image_size": 72}, "image_size", "choose 71 or 73"),
        ({"image_size": 96}, "image_size", "choose 95 or 97"),
        ({"image_size": 19}, "image_size", "choose 18 or 20"),
        ({"image_size": 192}, "image_size", "multiple of 28"),
        # The actor ignores a job's learning rate below 1e-9 and trains at its own.
        ({"learning_rate": 1e-10}, "learning_rate", "the actor applies no smaller rate"),
        ({"learning_rate": math.nextafter(MIN_LEARNING_RATE, 0.0)}, "learning_rate", r"\[1e-09, 1\)"),
        # The advantage stage replaces a gamma below 1e-3 by its default (0.99).
        ({"gamma": 1e-4}, "gamma", r"\[0\.001, 1\]"),
        ({"gamma": math.nextafter(MIN_GAMMA, 0.0)}, "gamma", r"\[0\.001, 1\]"),
        # GRPO's advantage is each env's return against the rollout's others: with one
        # env every advantage is 0 and nothing is learnt.
        ({"advantage": "grpo", "num_envs": 1}, "num_envs", "num_envs >= 2"),
        # A workload to start from (or evaluate) is named like one.
        ({"init_from_workload": "../other"}, "init_from_workload", "not a valid name"),
        ({"task_type": "eval", "init_from_workload": "A" * 40}, "init_from_workload", "not a valid name"),
    ],
)
def test_a_value_the_consumer_cannot_take_is_refused_at_creation(
    changes: dict[str, Any], field: str, why: str
) -> None:
    with pytest.raises(InvalidSpec, match=field) as e:
        make_spec(**changes)
    assert e.match(why)
    # ... and so is it where a spec arrives: the wire (the SDK's JSON; the decode's
    # error, InvalidMessage, carries the spec's message).
    raw = msgspec.json.encode(
        {"name": "w", "task_type": "rl", "env": "PickCube-v1", **msgspec.to_builtins(changes)}
    )
    if "task_type" not in changes and not any(isinstance(v, float) and math.isnan(v) for v in changes.values()):
        with pytest.raises((InvalidSpec, InvalidMessage), match=field):
            decode(raw, WorkloadSpec)


@pytest.mark.parametrize(
    "changes",
    [
        {"gae_lambda": 0.0},  # one-step TD: the advantage stage takes it (was refused)
        {"gamma": MIN_GAMMA},
        {"learning_rate": MIN_LEARNING_RATE},
        {"advantage": "grpo", "num_envs": 2},
        {"advantage": "grpo", "num_envs": 1, "source": "tenant"},  # the tenant's rollouts group
        {"image_size": 71},
        {"image_size": 73},
        {"init_from_workload": "base"},
    ],
)
def test_the_values_next_to_the_fixed_bounds_are_accepted(changes: dict[str, Any]) -> None:
    make_spec(**changes)


def test_the_schema_s_image_rounding_is_the_base_s() -> None:
    """``resized_side`` is transformers' ``smart_resize`` as the base's image
    processor runs it, and the base reads ``BASE_IMAGE_SIDE``."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    bb = Backbone.build(BackboneConfig(size="tiny"))
    assert bb.config.image_size == catalog.BASE_IMAGE_SIDE == BackboneConfig().image_size
    ip = bb.image_processor
    for side in (catalog.BASE_IMAGE_SIDE, 28, 84, 112):
        for s in range(1, 600):
            assert smart_resize(s, s, ip.patch_size * ip.merge_size, side * side, side * side) == (
                catalog.resized_side(s, side),
            ) * 2, s
    assert 64 in IMAGE_SIZES and all(s in IMAGE_SIZES for s in range(28, catalog.MAX_IMAGE_SIZE + 1, 28))
    assert set(catalog.ACTION_MODULES) == set(HEADS) - {"value"}


def test_num_envs_over_the_inference_rows_quota_is_refused_at_the_door() -> None:
    spec = make_spec(num_envs=Q.max_infer_rows + 1, horizon=1)
    with pytest.raises(QuotaExceeded, match="num_envs"):
        bound_spec(TENANT, spec, Quota())
