"""The tenant's own data and actions: :class:`DataCalls`, the verbs of
:class:`joynexus.sdk.Client` that hand a batch of demonstrations or a rollout to a
``source="tenant"`` workload (in requests under the payload limit) and ask a
workload's policy for action chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.inference import TensorBytes
from joynexus.schemas.jobs import TrainingJob
from joynexus.schemas.samples import IMAGE_FIELD_PREFIX, REQUIRED, STATE_FIELD
from joynexus.schemas.workloads import CloseJob, OpenJob, PutData
from joynexus.sdk.base import ClientBase

#: The fields each task type's batch needs besides the images (the table:
#: schemas/samples.py's FIELDS and REQUIRED).
SFT_FIELDS = REQUIRED["sft"]
RL_FIELDS = REQUIRED["rl"]
IMAGE_PREFIX = IMAGE_FIELD_PREFIX
#: Raw bytes per put_data request at most (msgpack, under 3/4 of max_payload).
PUT_CHUNK_BYTES = 6 * 1024 * 1024


class DataCalls(ClientBase):
    """Your own data and actions (the verbs of :class:`joynexus.sdk.Client`)."""

    # ------------------------------------------------------------ rollout as a service
    def act(
        self,
        workload: str,
        *,
        images: Mapping[str, Any],
        state: Any,
        instruction: str | Sequence[str] = "",
        version: int | None = None,
        session_id: str = "",
        timeout_s: float = 10.0,
    ) -> asyncio.Future[np.ndarray]:
        """Action chunks [B, horizon, A] for observations of an environment you run
        yourself, from the workload's policy (``version`` pinned, or the latest).

        ``images``: camera slot -> uint8 [B, 3, H, W] (or one [3, H, W]); ``state``
        [B, S] (or [S]). One shared backbone forward serves many tenants' requests."""

        async def go() -> np.ndarray:
            rec = await self._workload_cache(workload)
            return await self._guarded(
                self._b.names.infer(rec.spec.base_model, self.tenant),
                self._infer.act(
                    self.tenant,
                    schema=rec.schema_signature,
                    workload=workload,
                    policy_version=version,
                    images=images,
                    instruction=instruction or rec.spec.instruction,
                    state=state,
                    session_id=session_id,
                    timeout_s=timeout_s,
                    base_model=rec.spec.base_model,
                ),
            )

        return self._future(go())

    # ------------------------------------------------------------ your own data
    def submit_sft_batch(
        self, workload: str, batch: Mapping[str, Any]
    ) -> asyncio.Future[TrainingJob]:
        """Hand a batch of demonstrations to a ``source="tenant"`` SFT workload.

        ``batch``: ``obs_image_<camera>`` uint8 [B, 3, H, W] per camera slot,
        ``obs_state`` float32 [B, S], ``actions`` float32 [B, horizon, A]. Resolves once the job is
        ready for training (admission may make it wait: see ``max_in_flight``).
        """
        return self._future(self._submit(workload, batch, SFT_FIELDS, behavior_policy_version=0))

    def submit_rollout(
        self, workload: str, rollout: Mapping[str, Any], *, behavior_policy_version: int
    ) -> asyncio.Future[TrainingJob]:
        """Hand a rollout from an environment you run yourself to a ``source="tenant"``
        RL workload: the SFT fields plus ``env_id`` and ``step`` int64 [M], ``rewards``
        and ``dones`` float32 [M] (one row per env step). ``actions`` is the chunk
        [M, horizon, A] as in an SFT batch, never the executed action [M, A] (send
        that, if at all, as ``action``); schemas/samples.py's FIELDS lists them all.
        ``behavior_policy_version`` is the version whose actions you executed
        (staleness is judged by it)."""
        return self._future(
            self._submit(
                workload, rollout, RL_FIELDS, behavior_policy_version=behavior_policy_version
            )
        )

    async def _submit(
        self,
        workload: str,
        data: Mapping[str, Any],
        required: tuple[str, ...],
        *,
        behavior_policy_version: int,
    ) -> TrainingJob:
        missing = [f for f in required if f not in data]
        if not any(k.startswith(IMAGE_PREFIX) for k in data):
            missing.append(f"{IMAGE_PREFIX}<camera>")
        if missing:
            raise InvalidSpec(
                f"batch lacks fields {missing}; it needs {IMAGE_PREFIX}<camera>, {', '.join(required)}"
            )
        rows = len(data[STATE_FIELD])
        delay = 0.05
        while True:
            reply = await self._api(
                "open_job",
                OpenJob(
                    workload=workload,
                    sample_count=rows,
                    behavior_policy_version=behavior_policy_version,
                ),
            )
            if reply.job is not None:
                break
            await asyncio.sleep(delay)  # admission: this workload's jobs in flight are at the limit
            delay = min(delay * 2, 1.0)
        job = reply.job
        arrays = {k: np.ascontiguousarray(v) for k, v in data.items()}
        row_bytes = sum(a[0].nbytes for a in arrays.values() if len(a)) or 1
        step = max(1, min(PUT_CHUNK_BYTES, self._b.max_payload * 3 // 4) // row_bytes)
        try:
            for start in range(0, rows, step):  # rows in requests under the payload limit
                fields = {
                    k: TensorBytes.from_array(a[start : start + step]) for k, a in arrays.items()
                }
                await self._api("put_data", PutData(job_id=job.job_id, fields=fields), binary=True)
            closed = await self._api("close_job", CloseJob(job_id=job.job_id))
        except BaseException as e:
            # Give the job up so it holds no admission slot (the control plane also
            # fails jobs left open too long, should this process die here).
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self._api("abort_job", CloseJob(job_id=job.job_id, reason=repr(e)[:200]))
                )
            raise
        assert closed.job is not None
        return closed.job
