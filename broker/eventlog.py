"""The job event log: compare-and-append on JetStream.

A job's current state is the last message on ``<ns>.job.<tenant>.<job>.*``,
and every append names that message's sequence, so two writers can never
both move a job (the loser gets 10071). The one subtlety: a retried append
whose first try landed also meets 10071; the log then reads the job's last
message and, if its unique ``Nats-Msg-Id`` is ours, reports success.

See docs/ARCHITECTURE.md, "The job lifecycle is an event log".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, PubAck
from nats.js.errors import APIError, NotFoundError

from joynexus.broker import tracing
from joynexus.broker.connection import Broker
from joynexus.broker.errcodes import WRONG_LAST_SEQUENCE, WRONG_LAST_SEQUENCE_IN_FLIGHT
from joynexus.broker.headers import (
    EXPECTED_LAST_SUBJECT_SEQ,
    EXPECTED_LAST_SUBJECT_SEQ_SUBJECT,
    MSG_ID,
)
from joynexus.broker.subjects import is_workload_end, parse_job_subject
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import Conflict, InvalidMessage, JoyNexusError, Unavailable
from joynexus.schemas.jobs import JobEvent, WorkloadEnded

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Appended:
    seq: int
    #: True when this was a retry of an append that had already landed.
    duplicate: bool = False


@dataclass(frozen=True)
class Stored:
    event: JobEvent
    seq: int
    subject: str
    headers: dict[str, str]


class Fenced(Unavailable):
    """An admission append refused by the fence: this writer no longer holds the lease."""


def new_op_id() -> str:
    return secrets.token_hex(6)


class JobEventLog:
    def __init__(self, broker: Broker) -> None:
        self.b = broker
        self.n = broker.names

    async def append(
        self,
        event: JobEvent,
        *,
        expected_last_seq: int,
        op_id: str,
        fence: tuple[str, int] | None = None,
    ) -> Appended:
        """Append ``event`` if the job's last event is still ``expected_last_seq`` (0: no event).

        Raises Conflict if another writer moved the job first. Retrying with
        the same ``op_id`` is safe: an append that already landed is reported
        as ours (``duplicate=True``), never applied twice.

        ``fence`` = (subject, sequence), for a new job's first event (an admission):
        append only while ``subject``'s last message is still ``sequence`` (the
        scheduler lease's epoch, ``agents.leases``), else raise :class:`Fenced`.
        """
        job = event.job
        subject = self.n.job_subject(job.tenant_id, job.job_id, job.state)
        msg_id = f"{job.job_id}:{job.state.value}:{job.attempt}:{op_id}"
        if fence is not None and expected_last_seq != 0:
            raise ValueError("a fence guards a new job's first event only")
        guard_subject, guard_seq = fence or (
            self.n.job_filter(job.tenant_id, job.job_id),
            expected_last_seq,
        )
        headers = tracing.inject(
            {
                EXPECTED_LAST_SUBJECT_SEQ: str(guard_seq),
                EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: guard_subject,
                MSG_ID: msg_id,
            }
        )
        try:
            ack = await self._publish_expecting(subject, encode(event), headers)
        except APIError as e:
            if e.err_code != WRONG_LAST_SEQUENCE:
                raise
            last = await self.last_raw(job.tenant_id, job.job_id)
            if last is not None and (last.headers or {}).get(MSG_ID) == msg_id:
                return Appended(seq=last.seq or 0, duplicate=True)
            if fence is not None:
                raise Fenced(
                    f"admission of job {job.job_id} refused: {fence[0]} moved past "
                    f"sequence {fence[1]} (another scheduler holds the lease)"
                ) from e
            now = (
                parse_job_subject(last.subject)[2] if last is not None and last.subject else "none"
            )
            raise Conflict(
                f"job {job.job_id} of {job.tenant_id} moved to {now!r} before this "
                f"{job.state.value!r} event could be appended"
            ) from e
        return Appended(seq=ack.seq, duplicate=bool(ack.duplicate))

    async def append_workload_end(self, end: WorkloadEnded) -> int:
        """Append a workload generation's end; its ``Nats-Msg-Id`` names the generation,
        so a retried or second append of the same end (a scheduler restarted between
        writing it and noting it, a cancel racing a completion) lands once."""
        ack = await self._publish_expecting(
            self.n.workload_end_subject(end.tenant_id, end.workload),
            encode(end),
            {MSG_ID: f"end:{end.tenant_id}:{end.workload}:{end.generation}"},
        )
        return ack.seq

    async def workload_ends(self) -> list[WorkloadEnded]:
        """The newest end of every workload name in the log (oldest first)."""
        out: list[WorkloadEnded] = []
        async for m in self._pull(self.n.all_workload_ends, DeliverPolicy.LAST_PER_SUBJECT):
            try:
                out.append(decode(m.data, WorkloadEnded))
            except JoyNexusError as e:
                log.warning("skipping workload end at seq %s: %s", m.metadata.sequence.stream, e)
        return out

    async def _publish_expecting(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> PubAck:
        """Publish with expectations. A clustered stream refuses an expectation while
        another message it covers is still being replicated (10164): not a conflict,
        so try again, briefly (the same Nats-Msg-Id: one that landed after all is
        reported as a duplicate, not appended twice)."""
        delay = 0.002
        while True:
            try:
                return await self.b.js.publish(subject, payload, headers=headers)
            except APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE_IN_FLIGHT or delay > 0.5:
                    raise
            await asyncio.sleep(delay)
            delay *= 2

    async def last_raw(self, tenant_id: str, job_id: str):  # -> RawStreamMsg | None
        try:
            return await self.b.js.get_msg(
                self.n.jobs_stream, subject=self.n.job_filter(tenant_id, job_id), direct=True
            )
        except NotFoundError:
            return None

    async def last(self, tenant_id: str, job_id: str) -> Stored | None:
        raw = await self.last_raw(tenant_id, job_id)
        if raw is None:
            return None
        return Stored(
            event=decode(raw.data or b"", JobEvent, what="job event"),  # type: ignore[arg-type]
            seq=raw.seq or 0,
            subject=raw.subject or "",
            headers=dict(raw.headers or {}),
        )

    async def history(self, tenant_id: str, job_id: str) -> list[Stored]:
        """Every event of one job, oldest first (for tests and `status --job`)."""
        return [
            s async for s in self._read(self.n.job_filter(tenant_id, job_id), DeliverPolicy.ALL)
        ]

    async def latest_per_job(self) -> tuple[list[Stored], list[tuple[int, str]]]:
        """The last event of every job, plus (seq, why) for messages that do not decode.

        Reads one message per (job, state) subject and keeps the newest per job.
        """
        latest: dict[str, Stored] = {}
        bad: list[tuple[int, str]] = []
        async for item in self._read(self.n.all_jobs, DeliverPolicy.LAST_PER_SUBJECT, bad):
            key = f"{item.event.job.tenant_id}/{item.event.job.job_id}"
            cur = latest.get(key)
            if cur is None or item.seq > cur.seq:
                latest[key] = item
        return sorted(latest.values(), key=lambda s: s.seq), bad

    async def _pull(self, subject: str, policy: DeliverPolicy) -> AsyncIterator[Any]:
        """Every message on ``subject`` in the log from ``policy``, through an ephemeral
        consumer deleted at the end (it would show up in `nats consumer ls`)."""
        sub = await self.b.js.pull_subscribe(
            subject,
            stream=self.n.jobs_stream,
            config=ConsumerConfig(
                deliver_policy=policy,
                ack_policy=AckPolicy.NONE,
                inactive_threshold=30.0,
                mem_storage=True,
            ),
        )
        info = await sub.consumer_info()
        try:
            remaining = info.num_pending or 0
            while remaining > 0:
                for m in await sub.fetch(min(remaining, 2000), timeout=5.0):
                    remaining = m.metadata.num_pending
                    yield m
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
                await self.b.js.delete_consumer(self.n.jobs_stream, info.name)

    async def _read(
        self,
        subject: str,
        policy: DeliverPolicy,
        bad: list[tuple[int, str]] | None = None,
    ) -> AsyncIterator[Stored]:
        async for m in self._pull(subject, policy):
            if is_workload_end(m.subject):
                continue  # a workload's end, not a job's event
            try:
                ev: JobEvent = decode(m.data, JobEvent, what=f"job event {m.subject}")  # type: ignore[arg-type]
                tenant, job_id, state = parse_job_subject(m.subject)
                if (tenant, job_id, state) != (
                    ev.job.tenant_id,
                    ev.job.job_id,
                    ev.job.state.value,
                ):
                    raise InvalidMessage(
                        f"event on {m.subject} describes job {ev.job.job_id} of "
                        f"{ev.job.tenant_id} in state {ev.job.state.value}"
                    )
            except JoyNexusError as e:
                log.warning("skipping stream seq %s: %s", m.metadata.sequence.stream, e)
                if bad is not None:
                    bad.append((m.metadata.sequence.stream, str(e)))
                continue
            yield Stored(
                event=ev,
                seq=m.metadata.sequence.stream,
                subject=m.subject,
                headers=dict(m.headers or {}),
            )
