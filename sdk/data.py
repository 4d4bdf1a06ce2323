"""The tenant's own data and actions: :class:`DataCalls`, the verbs of
:class:`joynexus.sdk.Client` that hand a batch of demonstrations or a rollout to a
``source="tenant"`` workload (in requests under the payload limit) and ask a
workload's policy for action chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from joynexus.schemas.errors import InvalidSpec, QuotaExceeded, Timeout, Unavailable
from joynexus.schemas.inference import TensorBytes
from joynexus.schemas.jobs import TrainingJob
from joynexus.schemas.samples import IMAGE_FIELD_PREFIX, REQUIRED, STATE_FIELD
from joynexus.schemas.scheduler import FINAL_REFUSALS
from joynexus.schemas.workloads import ApiReply, CloseJob, OpenJob, PutData
from joynexus.sdk.base import ClientBase

#: The fields each task type's batch needs besides the images (the table:
#: schemas/samples.py's FIELDS and REQUIRED).
SFT_FIELDS = REQUIRED["sft"]
RL_FIELDS = REQUIRED["rl"]
IMAGE_PREFIX = IMAGE_FIELD_PREFIX
#: Raw bytes per put_data request at most (msgpack, under 3/4 of max_payload).
PUT_CHUNK_BYTES = 6 * 1024 * 1024
#: How long one open_job waits in the admission queue (the control plane's bound).
OPEN_WAIT_S = 10.0
#: How long a submission waits for admission in all, by default (then: Timeout).
ADMISSION_WAIT_S = 600.0
#: How long an idempotent request (a put at its offset, a close) is asked again while
#: the control plane does not answer (restarting, or its host lost and another taking over).
OUTAGE_WAIT_S = 120.0

log = logging.getLogger(__name__)


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
        [B, S] (or [S]). One shared backbone forward serves many tenants' requests.
        A batch over the server's message limit is asked in parts of its rows, all
        served by one policy version."""

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
                    instruction=instruction or rec.policy_instruction(),
                    state=state,
                    session_id=session_id,
                    timeout_s=timeout_s,
                    base_model=rec.spec.base_model,
                ),
            )

        return self._future(go())

    # ------------------------------------------------------------ your own data
    def submit_sft_batch(
        self, workload: str, batch: Mapping[str, Any], *,
        admission_wait_s: float = ADMISSION_WAIT_S,
    ) -> asyncio.Future[TrainingJob]:
        """Hand a batch of demonstrations to a ``source="tenant"`` SFT workload.

        ``batch``: ``obs_image_<camera>`` uint8 [B, 3, H, W] per camera slot,
        ``obs_state`` float32 [B, S], ``actions`` float32 [B, horizon, A]. Resolves once the job is
        ready for training. Admission may make it wait (``max_in_flight``, the
        rollout slots), in the scheduler's admission queue, served fairly between
        tenants, up to ``admission_wait_s`` (then :class:`Timeout`, saying why and
        its place); past the tenant's queue bound: :class:`QuotaExceeded`.
        """
        return self._future(self._submit(workload, batch, SFT_FIELDS, behavior_policy_version=0,
                                         admission_wait_s=admission_wait_s))

    def submit_rollout(
        self, workload: str, rollout: Mapping[str, Any], *, behavior_policy_version: int,
        admission_wait_s: float = ADMISSION_WAIT_S,
    ) -> asyncio.Future[TrainingJob]:
        """Hand a rollout from an environment you run yourself to a ``source="tenant"``
        RL workload: the SFT fields plus ``env_id`` and ``step`` int64 [M], ``rewards``
        and ``dones`` float32 [M] (one row per env step). ``actions`` is the chunk
        [M, horizon, A] as in an SFT batch, never the executed action [M, A] (send
        that, if at all, as ``action``); schemas/samples.py's FIELDS lists them all.
        ``behavior_policy_version`` is the version whose actions you executed
        (staleness is judged by it). Admission waits as in :meth:`submit_sft_batch`."""
        return self._future(
            self._submit(
                workload, rollout, RL_FIELDS, behavior_policy_version=behavior_policy_version,
                admission_wait_s=admission_wait_s,
            )
        )

    async def _open(
        self, workload: str, rows: int, behavior_policy_version: int, wait_s: float
    ) -> TrainingJob:
        """open_job, waiting for admission up to ``wait_s`` in all: each call waits in
        the scheduler's admission queue (a long poll of up to :data:`OPEN_WAIT_S`,
        admitted in fair order between tenants) and is asked again at once when its
        wait ends. Raises :class:`Timeout` past ``wait_s`` (saying why it waits and
        its place), :class:`QuotaExceeded` at once when the tenant's admission queue
        is full, :class:`InvalidSpec` when the workload takes no more jobs."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(wait_s, 0.0)
        delay, place = 0.05, 0
        async with self._open_slots:  # a few of this client's submissions wait at once
            while True:
                wait = min(OPEN_WAIT_S, max(0.0, deadline - loop.time()))
                reply = await self._api(
                    "open_job",
                    OpenJob(workload=workload, sample_count=rows,
                            behavior_policy_version=behavior_policy_version, wait_s=wait),
                    timeout_s=self.timeout_s + wait,
                )
                if reply.job is not None:
                    return reply.job
                if reply.refusal in FINAL_REFUSALS:
                    raise InvalidSpec(f"workload {workload!r} takes no more jobs: {reply.refused}")
                if wait >= 1.0 and reply.refusal and not reply.position:
                    raise QuotaExceeded(reply.refused)  # not queued: the tenant's queue is full
                if reply.position and reply.position != place:
                    place = reply.position  # its last place (a last short wait may not queue)
                    log.info("open_job on %s waits for admission: %s (place %d)",
                             workload, reply.refused, place)
                left = deadline - loop.time()
                if left <= 0:
                    raise Timeout(
                        f"open_job on {workload!r} not admitted within {wait_s:.0f}s: "
                        f"{reply.refused or 'admission refused it'}"
                        + (f" (place {place} in the admission queue)" if place else "")
                    )
                if not reply.position:  # it did not wait (a control plane without a queue)
                    await asyncio.sleep(min(delay, left))
                    delay = min(delay * 2, 1.0)

    async def _submit(
        self,
        workload: str,
        data: Mapping[str, Any],
        required: tuple[str, ...],
        *,
        behavior_policy_version: int,
        admission_wait_s: float,
    ) -> TrainingJob:
        missing = [f for f in required if f not in data]
        if not any(k.startswith(IMAGE_PREFIX) for k in data):
            missing.append(f"{IMAGE_PREFIX}<camera>")
        if missing:
            raise InvalidSpec(
                f"batch lacks fields {missing}; it needs {IMAGE_PREFIX}<camera>, {', '.join(required)}"
            )
        rows = len(data[STATE_FIELD])
        job = await self._open(workload, rows, behavior_policy_version, admission_wait_s)
        return await self._send_rows(job, data)

    async def _again(self, verb: str, req: Any, *, binary: bool = False) -> ApiReply:
        """An idempotent request, asked again while the control plane does not answer
        (restarting, or its host lost and another taking over) for ``OUTAGE_WAIT_S``."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        while True:
            try:
                return await self._api(verb, req, binary=binary)
            except Unavailable:
                if loop.time() - since > OUTAGE_WAIT_S:
                    raise
                await asyncio.sleep(0.5)

    async def _send_rows(self, job: TrainingJob, data: Mapping[str, Any]) -> TrainingJob:
        """Put ``data``'s rows into the open ``job`` (requests under the payload
        limit) and close it; on any failure the job is aborted (it holds no slot)."""
        rows = len(data[STATE_FIELD])
        arrays = {k: np.ascontiguousarray(v) for k, v in data.items()}
        row_bytes = sum(a[0].nbytes for a in arrays.values() if len(a)) or 1
        step = max(1, min(PUT_CHUNK_BYTES, self._b.max_payload * 3 // 4) // row_bytes)
        try:
            for start in range(0, rows, step):  # rows in requests under the payload limit
                fields = {
                    k: TensorBytes.from_array(a[start : start + step]) for k, a in arrays.items()
                }
                # At its offset: asked again across a control-plane outage, a put whose
                # reply was lost adds nothing (and a repeated close_job answers the job).
                await self._again("put_data", PutData(job_id=job.job_id, fields=fields, offset=start),
                                  binary=True)
            closed = await self._again("close_job", CloseJob(job_id=job.job_id))
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
