"""What a workload needs besides the scheduler: its schema, its first policy
version, and the producers that turn it into jobs.

* ``workload_schema``: the feature layout of a workload (from its ManiSkill
  task, or from its LeRobot dataset's ``meta/info.json``).
* ``PolicyInitializer``: the control plane's hook; publishes version 1 of a
  new workload's action module (fresh weights, or a copy of a version of
  another of the tenant's workloads: SFT then RL).
* ``RLProducer`` (now in ``joynexus.agents.envworkers``): reserve, roll out
  in ManiSkill with actions from the Inference Queue pinned to that version
  plus Gaussian exploration, put num_envs x horizon samples into the
  partition, mark needs_advantages.
* ``SFTProducer``: reserve, put the next batch of demonstrations (action
  chunks of the head's horizon), mark ready; the admission policy's
  max_in_flight is its prefetch depth.
* ``ProducerAgent``: watches the workloads bucket and runs a producer per
  active workload of its kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from nats.js.errors import KeyNotFoundError
from opentelemetry import trace

from joynexus.agents.models.backbone import SIZES
from joynexus.agents.models.features import FeatureSchema
from joynexus.agents.models.heads import HeadConfig, TenantModule
from joynexus.agents.models.policyio import PolicyStore, feature_schema_of, module_from_weights
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import metrics, tracing
from joynexus.broker.connection import Broker
from joynexus.broker.subjects import CURSOR_KEYS, Names
from joynexus.broker.tq import TrainingQueue
from joynexus.schemas.base import decode
from joynexus.schemas.errors import InvalidSpec, JoyNexusError
from joynexus.schemas.jobs import JobMetadata, JobState
from joynexus.schemas.workloads import BASE_MODELS, WorkloadRecord, WorkloadSpec

log = logging.getLogger(__name__)

OBS_IMAGES = "observation.images"
OBS_STATE = "observation.state"
ACTION = "action"
EXPLORATION_STD = 0.1


def image_field(slot: str) -> str:
    """Training Queue field of a camera slot (the name rollouts use)."""
    from joynexus.agents.envs.maniskill import tq_field

    return tq_field(f"{OBS_IMAGES}.{slot}")


#: Training Queue fields of a training sample besides the images.
STATE_FIELD = "obs_state"
ACTIONS_FIELD = "actions"  # the action chunk to learn [M, horizon, A]
#: RL rows: how many steps of its chunk the policy's decision at this row executed
#: (int64 [M], 1..horizon); 0 on rows executed open loop from an earlier decision.
DECISION_FIELD = "decision_len"


def feature_dim(base_model: str) -> int:
    return int(SIZES[BASE_MODELS[base_model]]["text"]["hidden_size"])


def unusable_dataset(spec: WorkloadSpec) -> InvalidSpec:
    """The one error of a dataset that cannot be trained on (its contents and path unsaid)."""
    return InvalidSpec(
        f"the dataset of workload {spec.name!r} is not a usable LeRobot dataset: it needs "
        f"{OBS_IMAGES}.<camera>, {OBS_STATE} and {ACTION} features; ask your operator"
    )


#: meta/info.json larger than this is not read (a dataset's is a few KiB).
MAX_INFO_BYTES = 4 << 20


def _dataset_layout(root: Path) -> tuple[list[str], tuple[int, int], int, int]:
    """(cameras, image (h, w), state dim, action dim) from a LeRobot dataset's
    meta/info.json; any error if it is not one."""
    info_path = root / "meta" / "info.json"
    if not info_path.is_file() or info_path.stat().st_size > MAX_INFO_BYTES:
        raise ValueError("not a dataset")
    feats = json.loads(info_path.read_text())["features"]
    if not isinstance(feats, dict):
        raise ValueError("no features")
    cams = sorted(k.removeprefix(f"{OBS_IMAGES}.") for k in feats if k.startswith(f"{OBS_IMAGES}."))
    if not cams or OBS_STATE not in feats or ACTION not in feats:
        raise ValueError("missing features")
    h, w = feats[f"{OBS_IMAGES}.{cams[0]}"]["shape"][:2]
    dims = (int(h), int(w)), int(feats[OBS_STATE]["shape"][0]), int(feats[ACTION]["shape"][0])
    if min(*dims[0], dims[1], dims[2]) < 1:
        raise ValueError("bad shapes")
    return cams, dims[0], dims[1], dims[2]


def workload_schema(spec: WorkloadSpec) -> tuple[FeatureSchema, str]:
    """(schema, instruction) of a workload; a clear error if its env or dataset is unusable."""
    if spec.task_type in ("rl", "eval"):
        from joynexus.agents.envs.registry import task_spec

        env = task_spec(
            spec.env,
            obs="rgb",
            num_envs=spec.num_envs,
            image_size=spec.image_size,
            cameras=spec.cameras or None,
            state_keys=spec.state or None,
        )
        schema = FeatureSchema(
            camera_slots=env.cameras,
            image_hw=(env.image_size, env.image_size),
            state_dim=env.state_dim,
            action_dim=env.action_dim,
            action_horizon=spec.action_horizon,
            base_model=spec.base_model,
            state_keys=env.state_keys,
        )
        return schema, spec.instruction or env.instruction
    # spec.dataset is the path the control plane resolved inside the tenant's dataset
    # space (joynexus.agents.datasets); what is wrong with it is not echoed back.
    try:
        cams, hw, state_dim, action_dim = _dataset_layout(Path(spec.dataset))
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise unusable_dataset(spec) from None
    h, w = hw
    tasks_file = Path(spec.dataset) / "meta" / "tasks.parquet"
    instruction = ""
    try:
        if tasks_file.is_file():
            import pandas as pd

            tasks = pd.read_parquet(tasks_file)
            instruction = str(tasks.index[0]) if len(tasks) else ""
    except Exception:
        raise unusable_dataset(spec) from None
    state_keys = _dataset_state_keys(spec, state_dim)
    if spec.cameras and list(spec.cameras) != list(cams):
        raise InvalidSpec(
            f"workload {spec.name!r} names cameras {list(spec.cameras)} but its dataset recorded "
            f"{list(cams)}; drop cameras= (an SFT workload reads the dataset's) or generate a dataset with them"
        )
    schema = FeatureSchema(
        camera_slots=tuple(cams),
        image_hw=(int(h), int(w)),
        state_dim=state_dim,
        action_dim=action_dim,
        action_horizon=spec.action_horizon,
        base_model=spec.base_model,
        state_keys=state_keys,
    )
    return schema, spec.instruction or instruction


def _dataset_state_keys(spec: WorkloadSpec, state_dim: int) -> tuple[str, ...]:
    """The state keys a dataset recorded (generate_dataset's observation file), checked
    against the spec's ``state`` when it names one; () for a dataset made elsewhere."""
    from joynexus.agents.envs.lerobot_data import read_observation_meta
    from joynexus.agents.envs.maniskill import resolve_state_keys, state_key_dims

    meta = read_observation_meta(Path(spec.dataset)) or {}
    keys = meta.get("state_keys")
    task = meta.get("task")
    recorded: tuple[str, ...] = ()
    if isinstance(keys, list) and all(isinstance(k, str) for k in keys) and isinstance(task, str):
        try:
            dims = state_key_dims(task)
            if sum(dims[k] for k in keys) == state_dim:
                recorded = tuple(keys)
        except KeyError:
            recorded = ()
    if spec.state:
        try:
            wanted = resolve_state_keys(task, spec.state) if isinstance(task, str) else tuple(spec.state)
        except (InvalidSpec, KeyError):
            wanted = tuple(spec.state)
        if wanted != recorded:
            raise InvalidSpec(
                f"workload {spec.name!r} names state {list(spec.state)} but its dataset recorded "
                f"{list(recorded) or 'no state keys'}; drop state= (an SFT workload reads the "
                "dataset's) or generate a dataset with that state"
            )
    return recorded


def normalization_stats(spec: WorkloadSpec) -> dict[str, Any]:
    """Normalisation statistics for a new workload's head: an SFT dataset's LeRobot
    stats (meta/stats.json mean/std of state and action); {} otherwise (identity,
    or what ``init_from_workload``'s weights carry)."""
    if spec.task_type != "sft" or not spec.dataset:
        return {}
    from joynexus.agents.envs.lerobot_data import dataset_stats

    return dataset_stats(Path(spec.dataset))


class PolicyInitializer:
    """Publishes version 1 of a new workload's policy (the control plane's hook)."""

    def __init__(self, broker: Broker) -> None:
        self.store = PolicyStore(broker)

    async def __call__(self, record: WorkloadRecord) -> str:
        spec = record.spec
        schema, _ = await asyncio.to_thread(workload_schema, spec)
        if spec.task_type == "eval":  # evaluates an existing version: check it, publish nothing
            src = await self.store.get(record.tenant_id, spec.init_from_workload, spec.init_from)
            if feature_schema_of(src).backbone_key() != schema.backbone_key() or (
                src.feature_schema.state_dim,
                src.feature_schema.action_dim,
            ) != (schema.state_dim, schema.action_dim):
                raise InvalidSpec(
                    f"{spec.init_from_workload!r} v{src.version} ({src.schema_signature}) cannot act in "
                    f"{spec.env} ({schema.signature()}): cameras, image size, state and action dims must match"
                )
            return src.schema_signature
        cfg = HeadConfig(
            feature_dim=feature_dim(spec.base_model),
            state_dim=schema.state_dim,
            action_dim=schema.action_dim,
            action_horizon=schema.action_horizon,
            hidden=spec.head_hidden,
            seed=spec.seed,
        )
        module = TenantModule(record.tenant_id, spec.action_module, cfg, lr=spec.learning_rate)
        module.set_normalization(await asyncio.to_thread(normalization_stats, spec))
        if spec.init_from_workload:
            src = await self.store.get(record.tenant_id, spec.init_from_workload, spec.init_from)
            if (
                feature_schema_of(src).signature() != schema.signature()
                or src.head_type != spec.action_module
            ):
                raise InvalidSpec(
                    f"cannot start {spec.name!r} from {spec.init_from_workload!r} v{src.version}: its head "
                    f"({src.head_type}, {src.schema_signature}) differs from this workload's "
                    f"({spec.action_module}, {schema.signature()})"
                )
            loaded = module_from_weights(src, await self.store.load_weights(src))
            module.head.load_state_dict(loaded.head.state_dict())
        try:
            await self.store.publish(
                record.tenant_id, spec.name, module, schema, spec.base_model, version=1
            )
        except InvalidSpec:
            pass  # v1 exists: a retried create
        return schema.signature()


def chunk_targets(
    actions_M_A: np.ndarray,
    env_M: np.ndarray,
    episode_M: np.ndarray,
    frame_M: np.ndarray,
    horizon: int,
) -> np.ndarray:
    """For each executed step, the chunk of the next ``horizon`` actions of its episode
    [M, horizon, A] (past the episode's end the last action repeats, as LeRobot pads)."""
    m = len(actions_M_A)
    out_M_H_A = np.empty((m, horizon, actions_M_A.shape[1]), dtype=np.float32)
    order = np.lexsort((frame_M, episode_M, env_M))
    keys = (env_M.astype(np.int64) * 1_000_003 + episode_M)[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    for s, e in zip(starts, np.r_[starts[1:], m], strict=True):
        rows = order[s:e]
        idx_L_H = np.minimum(np.arange(e - s)[:, None] + np.arange(horizon)[None, :], e - s - 1)
        out_M_H_A[rows] = actions_M_A[rows][idx_L_H]
    return out_M_H_A


def decision_lengths(chunk_step_M: np.ndarray, env_M: np.ndarray, step_M: np.ndarray) -> np.ndarray:
    """Per row, the number of steps of its chunk that the decision taken there executed
    (rows with ``chunk_step`` 0), 0 on the other rows (pure).

    A decision's run is the row itself plus the rows of the same env that follow it
    with ``chunk_step`` 1, 2, ... (the chunk executed open loop until used up, the
    rollout's end or an episode's end)."""
    m = len(chunk_step_M)
    out_M = np.zeros(m, dtype=np.int64)
    if m == 0:
        return out_M
    order = np.lexsort((step_M, env_M))
    cs = np.asarray(chunk_step_M)[order]
    env = np.asarray(env_M)[order]
    starts = np.flatnonzero(np.r_[True, (cs[1:] == 0) | (env[1:] != env[:-1])])
    lengths = np.diff(np.r_[starts, m])
    is_decision = cs[starts] == 0
    out_M[order[starts[is_decision]]] = lengths[is_decision]
    return out_M


# RLProducer lives in joynexus.agents.envworkers (environment worker processes);
# ``from joynexus.agents.workloads import RLProducer`` still works (module __getattr__).


class SFTProducer:
    def __init__(self, broker: Broker, record: WorkloadRecord, *, instance: str) -> None:
        self.b = broker
        self.rec = record
        self.spec = record.spec
        self.tenant = record.tenant_id
        self.sched = SchedulerClient(broker, by=instance)
        self.tq = TrainingQueue(broker)

    async def _cursor_kv(self) -> Any:
        return await self.b.js.key_value(self.b.names.workloads_bucket)

    def _cursor_key(self) -> str:
        return Names.cursor_key(self.tenant, self.spec.name)

    async def run(self, stop: asyncio.Event) -> None:
        from joynexus.agents.envs.lerobot_data import load_dataset

        schema, instruction = await asyncio.to_thread(workload_schema, self.spec)
        try:
            ds = await asyncio.to_thread(
                load_dataset, Path(self.spec.dataset), action_horizon=self.spec.action_horizon
            )
        except Exception as e:  # lerobot's own errors name files and keys: logged, not replied
            log.warning(
                "sft %s/%s: dataset unusable: %s: %s", self.tenant, self.spec.name, type(e).__name__, e
            )
            raise unusable_dataset(self.spec) from None
        for orphan in await self.sched.list_jobs(
            self.tenant, policy_key=self.spec.name, states=[JobState.RESERVED]
        ):
            await self.sched.fail(orphan.job_id, "producer restarted before the batch was written")
        kv = await self._cursor_kv()
        try:
            cursor = int((await kv.get(self._cursor_key())).value)
        except KeyNotFoundError:
            cursor = 0
        n = len(ds)
        order = np.random.default_rng(self.spec.seed).permutation(n)
        backoff = 0.05
        while not stop.is_set():
            span, traceparent = tracing.start_job_trace(
                "sft.job", tenant=self.tenant, workload=self.spec.name
            )
            with trace.use_span(span, end_on_exit=False):
                job = await self.sched.reserve(
                    self.tenant,
                    "sft",
                    policy_key=self.spec.name,
                    domain=Path(self.spec.dataset).name,  # the name, not the service's path
                    sample_count=self.spec.batch_size,
                    metadata=JobMetadata(
                        schema_signature=schema.signature(),
                        extra={
                            "instruction": instruction,
                            "cursor": str(cursor),
                            "traceparent": traceparent,
                        },
                    ),
                )
            if job is None:
                if "completion target" in self.sched.last_refusal:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            span.set_attribute("job_id", job.job_id)
            backoff = 0.05
            idx = [int(order[(cursor + i) % n]) for i in range(self.spec.batch_size)]
            cursor += self.spec.batch_size
            await kv.put(self._cursor_key(), str(cursor).encode())
            with trace.use_span(span, end_on_exit=True):
                try:
                    items = await asyncio.to_thread(_take, ds, idx)
                    data = {
                        **{
                            image_field(c): np.stack(
                                [it[f"{OBS_IMAGES}.{c}"].numpy() for it in items]
                            )
                            for c in schema.camera_slots
                        },
                        STATE_FIELD: np.stack([it[OBS_STATE].numpy() for it in items]).astype(
                            np.float32
                        ),
                        ACTIONS_FIELD: np.stack(
                            [it[ACTION].numpy().reshape(schema.action_horizon, -1) for it in items]
                        ).astype(np.float32),
                    }
                    await self.tq.async_put(
                        data, tenant_id=self.tenant, partition_id=job.partition_id
                    )
                    await self.sched.mark(job.job_id, JobState.READY)
                except JoyNexusError as e:
                    await self.sched.fail(job.job_id, f"sft producer: {type(e).__name__}: {e}")


def _take(ds: Any, idx: list[int]) -> list[dict[str, Any]]:
    return [ds[i] for i in idx]


async def watch_workloads(
    b: Broker, stop: asyncio.Event, *, idle: Any = None
) -> AsyncIterator[tuple[str, WorkloadRecord]]:
    """Every workload record as it is written (the current ones first) until
    ``stop``; ``idle()`` is called whenever nothing changed for half a second."""
    kv = await b.js.key_value(b.names.workloads_bucket)
    watcher = await kv.watchall()
    try:
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=0.5)
            except Exception:  # nothing new within the timeout
                entry = None
            if entry is None or not entry.value or entry.key.startswith(CURSOR_KEYS):
                if idle is not None:
                    idle()
                continue
            try:
                rec = decode(entry.value, WorkloadRecord)
            except JoyNexusError as e:
                log.warning("workload %s: %s", entry.key, e)
                continue
            yield entry.key, rec
    finally:
        await watcher.stop()


class ProducerAgent:
    """Runs a producer for every active workload of ``task_type`` (rl or sft)."""

    def __init__(self, broker: Broker, task_type: str, *, instance: str) -> None:
        self.b = broker
        self.task_type = task_type
        self.instance = instance
        self.running: dict[str, tuple[asyncio.Task[None], asyncio.Event]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        if self.task_type == "rl":
            # The first rgb env of a process starts the CPU renderer (10-30 s): pay it
            # now, before taking workloads, not inside the first tenant's rollout.
            from joynexus.agents.envs.maniskill import make_env

            env = await asyncio.to_thread(
                make_env, "PickCube-v1", obs="rgb", num_envs=1, image_size=64
            )
            await asyncio.to_thread(env.reset, 0)
            await asyncio.to_thread(env.close)
        await metrics.emit(
            self.b,
            "system",
            service=f"producer-{self.task_type}",
            ready=True,
            instance=self.instance,
        )
        try:
            async for key, rec in watch_workloads(self.b, stop, idle=self._reap):
                if rec.spec.task_type != self.task_type or rec.spec.source != "service":
                    continue
                if rec.state == "active" and key not in self.running:
                    ev = asyncio.Event()
                    cls: Any = SFTProducer
                    if self.task_type == "rl":
                        from joynexus.agents.envworkers import RLProducer as cls
                    def make(cls: Any = cls, rec: WorkloadRecord = rec, ev: asyncio.Event = ev) -> Any:
                        return cls(self.b, rec, instance=f"{self.instance}-{rec.tenant_id}").run(ev)

                    self.running[key] = (asyncio.create_task(self._guard(make, key, ev)), ev)
                elif rec.state != "active" and key in self.running:
                    self.running[key][1].set()
        finally:
            for _task, ev in self.running.values():
                ev.set()
            await asyncio.gather(*(t for t, _ in self.running.values()), return_exceptions=True)

    async def _guard(self, make: Any, key: str, stop: asyncio.Event) -> None:
        """Run a workload's producer; one that crashes (the scheduler or NATS did not
        answer in time under load...) is started afresh while the workload is active,
        with backoff: it fails the job it left reserved and resumes from its cursor.
        (A producer that died here used to stay dead while its process kept beating, so
        its workload's training stopped for good: the PickCube SFT stall of issue 12.)"""
        delay = 1.0
        while not stop.is_set():
            try:
                await make()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("producer for %s crashed; starting it again in %.0f s", key, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 30.0)

    def _reap(self) -> None:
        for key in [k for k, (t, _) in self.running.items() if t.done()]:
            del self.running[key]


def __getattr__(name: str) -> Any:
    if name == "RLProducer":  # moved; imported lazily (envworkers imports this module)
        from joynexus.agents.envworkers import RLProducer

        return RLProducer
    raise AttributeError(name)


__all__ = [
    "PolicyInitializer",
    "ProducerAgent",
    "SFTProducer",
    "chunk_targets",
    "decision_lengths",
    "feature_dim",
    "image_field",
    "normalization_stats",
    "unusable_dataset",
    "workload_schema",
]
