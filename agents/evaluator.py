"""The evaluator: runs eval workloads, pinned to one policy version throughout.

It watches the workloads bucket for active ``eval`` workloads, runs N
episodes in the workload's ManiSkill task with actions from the Inference
Queue pinned to the evaluated version (no exploration noise, nothing in the
Training Queue), and writes the result into the workload record (state
``done``), which the SDK's ``evaluate`` future waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
import numpy as np

from joynexus.broker import metrics
from joynexus.broker.connection import Broker
from joynexus.broker.policy import PolicyStore, feature_schema_of
from joynexus.schemas.base import encode
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.workloads import WorkloadRecord

log = logging.getLogger(__name__)


async def evaluate_record(b: Broker, rec: WorkloadRecord) -> dict[str, float]:
    from joynexus.agents.envs.maniskill import evaluate, make_env
    from joynexus.agents.inference import InferenceClient
    from joynexus.agents.workloads import OBS_IMAGES, OBS_STATE, workload_schema

    spec = rec.spec
    src = await PolicyStore(b).get(rec.tenant_id, spec.init_from_workload, spec.init_from)
    schema = feature_schema_of(src)
    _, instruction = workload_schema(spec)
    infer = InferenceClient(b, base_model=src.base_model, timeout_s=15.0, retry_for_s=90.0)

    async def act(obs: dict[str, Any]) -> np.ndarray:
        return await infer.act(
            rec.tenant_id,
            schema=schema,
            policy_key=spec.init_from_workload,
            policy_version=src.version,
            images={c: obs[f"{OBS_IMAGES}.{c}"] for c in schema.camera_slots},
            instruction=instruction,
            state=obs[OBS_STATE],
        )

    def factory() -> Any:
        return make_env(
            spec.env,
            obs="rgb",
            num_envs=spec.num_envs,
            image_size=schema.image_hw[0],
            seed=spec.seed,
        )

    result = await evaluate(factory, act, episodes=spec.episodes, seed=spec.seed)
    return {**{k: float(v) for k, v in result.items()}, "version": float(src.version)}


class Evaluator:
    def __init__(self, broker: Broker, *, instance: str) -> None:
        self.b = broker
        self.instance = instance
        self.done = 0

    async def run(self, stop: asyncio.Event) -> None:
        from joynexus.agents.workloads import watch_workloads

        kv = await self.b.js.key_value(self.b.names.workloads_bucket)
        async for key, rec in watch_workloads(self.b, stop):
            if rec.spec.task_type != "eval" or rec.state != "active":
                continue
            try:
                result = await evaluate_record(self.b, rec)
                state = "done"
            except JoyNexusError as e:
                result, state = {"error_code": 1.0}, "cancelled"
                log.warning("eval %s failed: %s", key, e)
            finished = msgspec.structs.replace(
                rec, state=state, result=result, finished_at=time.time()
            )
            await kv.put(key, encode(finished))
            self.done += 1
            await metrics.emit(
                self.b,
                "learning",
                rec.tenant_id,
                workload=rec.spec.init_from_workload,
                eval_success=result.get("success_rate", 0.0),
                version=result.get("version", 0.0),
            )
