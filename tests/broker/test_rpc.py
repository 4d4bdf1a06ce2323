"""The request/reply layer (broker/rpc.py) against the real nats-server: typed errors,
retries within a policy, a handler that raises, the in-flight bound, hostile reply
subjects and bodies, the transport seam; and the job-lease keep-alive driven by the
TTL the scheduler's lease reply carries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.micro import add_service

from joynexus.agents.leases import MIN_TOUCH_EVERY_S, leases_kept, touch_every_s
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.agents.scheduler_client import SchedulerClient
from joynexus.broker import responder, rpc, slots
from joynexus.broker.connection import Broker
from joynexus.broker.headers import SERVICE_ERROR, SERVICE_ERROR_CODE
from joynexus.schemas.base import Wire, decode, encode
from joynexus.schemas.errors import (
    InvalidMessage,
    JoyNexusError,
    PayloadTooLarge,
    PermissionDenied,
    QuotaExceeded,
    RateLimited,
    Unavailable,
)
from joynexus.schemas.jobs import JobState, WorkloadPolicy
from joynexus.schemas.scheduler import DEFAULT_LEASE_TTL_S, ErrorBody, Reply


class Echo(Wire, kw_only=True):
    text: str
    #: what the handler does: "echo", "typed", "denied", "bug", "store_timeout", "hold"
    do: str = "echo"


class EchoReply(Wire, kw_only=True, omit_defaults=True):
    text: str = ""
    tenant: str = ""
    error: ErrorBody | None = None


class EchoService:
    """A micro service whose one endpoint answers through an responder.Server, as the
    control plane's tenant API does (the tenant from the subject)."""

    def __init__(self, b: Broker, *, limit: int = 32, total: int = responder.MAX_IN_FLIGHT_TOTAL,
                 slots: int | None = None) -> None:
        self.b = b
        self.release = asyncio.Event()
        self.handled = 0
        self._seen = asyncio.Condition()
        self.server = responder.Server(
            b,
            "echo",
            error_reply=lambda code, message: EchoReply(error=ErrorBody(code=code, message=message)),
            limit=lambda _t: limit,
            total=total,
            slots=None if slots is None else (lambda _t: slots),
        )
        self.service: Any = None

    def subject(self, tenant: str) -> str:
        return self.b.names.api(tenant, "echo")

    async def start(self) -> None:
        self.service = await add_service(self.b.nc, name=f"{self.b.names.namespace}-echo", version="0.1.0")
        await self.service.add_endpoint(name="echo", subject=self.subject("*"), handler=self.on_request)
        await self.b.nc.flush()

    async def on_request(self, request: Any) -> None:
        tenant = request.subject.split(".")[2]
        # Asked by the test's agent connection for a tenant (replies in the agents'
        # inboxes, as on the inference engine's agents' subject).
        if not self.server.allowed(request, tenant, service=True):
            return

        async def handle() -> EchoReply:
            req = decode(request.data, Echo, what="echo request")
            async with self._seen:
                self.handled += 1
                self._seen.notify_all()
            if req.do == "typed":
                raise QuotaExceeded(f"tenant {tenant} is over its bound: " + "x" * 5000)
            if req.do == "denied":
                raise PermissionDenied("not yours")
            if req.do == "bug":
                raise RuntimeError("a bug in the handler")
            if req.do == "store_timeout":  # a JetStream request that timed out (a failover)
                import nats.errors

                raise nats.errors.TimeoutError
            if req.do == "hold":
                await self.release.wait()
            if req.do == "poll":  # a long poll: waits without the tenant's slot
                async with slots.waiting():
                    await self.release.wait()
            return EchoReply(text=req.text, tenant=tenant)

        self.server.serve(request, handle, span="echo", tenant=tenant)

    async def handled_at_least(self, n: int) -> None:
        async with self._seen:
            await asyncio.wait_for(self._seen.wait_for(lambda: self.handled >= n), 10)

    async def stop(self) -> None:
        await self.service.stop()
        await self.server.stop()


@pytest.fixture
async def echo(broker: Broker) -> AsyncIterator[EchoService]:
    svc = EchoService(broker, limit=2)
    await svc.start()
    yield svc
    svc.release.set()
    await svc.stop()


DECODE = rpc.checked(EchoReply, "echo reply")


async def ask(b: Broker, tenant: str, req: Echo, **kw: Any) -> EchoReply:
    return await rpc.call(b, b.names.api(tenant, "echo"), encode(req), DECODE, timeout_s=5.0, **kw)


async def test_typed_errors_come_back_typed_with_the_service_error_headers(
    broker: Broker, echo: EchoService
) -> None:
    ok = await ask(broker, "acme", Echo(text="hi"))
    assert (ok.text, ok.tenant) == ("hi", "acme")
    with pytest.raises(QuotaExceeded, match="tenant acme is over its bound") as e:
        await ask(broker, "acme", Echo(text="x", do="typed"))
    assert len(str(e.value)) < 700  # clipped: the 5000 characters are not echoed back
    with pytest.raises(PermissionDenied, match="not yours"):
        await ask(broker, "acme", Echo(text="x", do="denied"))
    # The micro-service convention: the message and an HTTP-like status in headers.
    msg = await broker.nc.request(echo.subject("acme"), encode(Echo(text="x", do="denied")), timeout=5)
    assert msg.headers and msg.headers[SERVICE_ERROR_CODE] == "403"
    assert msg.headers[SERVICE_ERROR] == "not yours"
    msg = await broker.nc.request(echo.subject("acme"), encode(Echo(text="x", do="typed")), timeout=5)
    assert msg.headers and msg.headers[SERVICE_ERROR_CODE] == "400"
    assert decode(msg.data, EchoReply).error.code == "quota_exceeded"  # type: ignore[union-attr]
    assert echo.server.in_flight == {}


async def test_a_handler_that_raises_answers_an_error_and_the_server_keeps_serving(
    broker: Broker, echo: EchoService, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(JoyNexusError, match=r"internal error \(reference [0-9a-f]{12}") as e:
        await ask(broker, "acme", Echo(text="x", do="bug"))
    assert type(e.value) is JoyNexusError and "a bug in the handler" not in str(e.value)
    ref = str(e.value).split("reference ")[1][:12]
    assert any(ref in r.getMessage() for r in caplog.records)  # the traceback is logged, not sent
    # An undecodable body fails that request only.
    msg = await broker.nc.request(echo.subject("acme"), b"\xff not json", timeout=5)
    bad = decode(msg.data, EchoReply)
    assert bad.error is not None and bad.error.code == InvalidMessage.code
    assert (await ask(broker, "acme", Echo(text="still here"))).text == "still here"
    assert echo.server.in_flight == {}


async def test_a_message_store_timeout_answers_unavailable_not_an_internal_error(
    broker: Broker, echo: EchoService
) -> None:
    """A handler's JetStream request that timed out (a host lost, its cluster electing)
    is the machine's: Unavailable, which callers retry; an internal error ended a
    training client's call in the host-loss drill."""
    with pytest.raises(Unavailable, match="timed out waiting for the message store"):
        await ask(broker, "acme", Echo(text="x", do="store_timeout"))
    assert (await ask(broker, "acme", Echo(text="after"))).text == "after"


async def test_a_hostile_reply_subject_is_dropped_and_reported_and_others_are_served(
    broker: Broker, echo: EchoService
) -> None:
    seen: list[Any] = []
    target = "$JS.API.STREAM.PURGE.JNX_JOBS"

    async def record(m: Any) -> None:
        seen.append(m)

    sub = await broker.nc.subscribe(target, cb=record)
    for reply in (target, f"{broker.names.inbox_prefix('other')}.x", "_INBOX.>", ""):
        if reply:
            await broker.nc.publish(echo.subject("acme"), encode(Echo(text="x")), reply=reply)
    await broker.nc.flush()
    assert (await ask(broker, "acme", Echo(text="fine"))).text == "fine"
    await asyncio.sleep(0.2)
    assert seen == [] and echo.server.refused == 3 and echo.handled == 1
    await sub.unsubscribe()


async def test_the_in_flight_bound_holds_and_rate_limited_is_retried_by_policy(
    broker: Broker, echo: EchoService
) -> None:
    held = [asyncio.create_task(ask(broker, "acme", Echo(text=str(i), do="hold"))) for i in range(2)]
    await echo.handled_at_least(2)
    assert echo.server.in_flight == {"acme": 2}
    # Past the tenant's bound: rate_limited at once, not spawned.
    t0 = time.monotonic()
    with pytest.raises(RateLimited, match="'acme' has 2 requests being served by echo"):
        await ask(broker, "acme", Echo(text="x"))
    assert time.monotonic() - t0 < 2.0
    # Another tenant is not held up by acme's bound.
    assert (await ask(broker, "beta", Echo(text="b"))).tenant == "beta"
    # With a policy that retries rate_limited, the call gets through once a slot frees.
    retrying = rpc.RetryPolicy("test", attempts=50, base_s=0.02, cap_s=0.05, retry_on=(RateLimited,))
    retried: list[BaseException] = []
    later = asyncio.create_task(
        ask(broker, "acme", Echo(text="later"), retry=retrying, on_retry=lambda e, _s: retried.append(e))
    )
    await asyncio.sleep(0.2)
    assert not later.done() and retried and all(isinstance(e, RateLimited) for e in retried)
    echo.release.set()
    assert [r.text for r in await asyncio.gather(*held)] == ["0", "1"]
    assert (await later).text == "later"
    assert echo.server.in_flight == {} and echo.server.rate_limited >= 2


async def _burst(broker: Broker, tenant: str, n: int, tag: str) -> tuple[list[str], asyncio.Event]:
    """``n`` fire-and-forget echo requests of ``tenant``: the codes of their answers
    as they arrive (an event set once all ``n`` came)."""
    codes: list[str] = []
    done = asyncio.Event()

    async def got(m: Any) -> None:
        r = decode(m.data, EchoReply)
        codes.append(r.error.code if r.error else "ok")
        if len(codes) >= n:
            done.set()

    prefix = f"{broker.names.service_inbox_prefix}.{tag}"
    await broker.nc.subscribe(f"{prefix}.>", cb=got, pending_msgs_limit=100_000)
    body = encode(Echo(text="flood"))
    for i in range(n):
        await broker.nc.publish(broker.names.api(tenant, "echo"), body, reply=f"{prefix}.{i}")
    return codes, done


async def test_a_burst_of_refusals_does_not_queue_ahead_of_another_tenants_request(
    broker: Broker, echo: EchoService
) -> None:
    """2,000 requests of acme past its bound, then one of beta: beta is answered
    after a few of acme's refusals, not after all of them (a task per refusal ran
    them in arrival order: issue 24's request_flood), and every refusal is sent."""
    held = [asyncio.create_task(ask(broker, "acme", Echo(text=str(i), do="hold"))) for i in range(2)]
    await echo.handled_at_least(2)
    codes, done = await _burst(broker, "acme", 2000, "burst")
    beta = await ask(broker, "beta", Echo(text="b"))
    before_beta = len(codes)
    await asyncio.wait_for(done.wait(), 20)
    assert beta.tenant == "beta"
    assert before_beta < 500, f"beta answered after {before_beta} of acme's 2000 refusals"
    assert codes == ["rate_limited"] * 2000 and echo.server.refusals_dropped == 0
    echo.release.set()
    assert [r.text for r in await asyncio.gather(*held)] == ["0", "1"]


async def test_refusals_past_the_queue_bound_are_dropped_and_others_still_served(
    broker: Broker, echo: EchoService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(responder, "MAX_QUEUED_REFUSALS", 50)
    held = [asyncio.create_task(ask(broker, "acme", Echo(text=str(i), do="hold"))) for i in range(2)]
    await echo.handled_at_least(2)
    codes, _done = await _burst(broker, "acme", 600, "bound")
    assert (await ask(broker, "beta", Echo(text="b"))).tenant == "beta"
    await asyncio.sleep(1.0)
    assert echo.server.refusals_dropped > 0
    assert 50 <= len(codes) == 600 - echo.server.refusals_dropped
    assert set(codes) == {"rate_limited"} and echo.server._to_refuse == {}
    echo.release.set()
    await asyncio.gather(*held)


async def test_a_tenant_works_in_its_slots_and_another_is_served_meanwhile(
    broker: Broker,
) -> None:
    """Of a tenant's admitted requests at most ``slots`` work at once, the rest wait
    their turn (answered, in the end, not refused); another tenant's request is
    served at once; a long poll gives its slot back while it waits."""
    svc = EchoService(broker, limit=10, slots=2)
    await svc.start()
    try:
        held = [asyncio.create_task(ask(broker, "acme", Echo(text=str(i), do="hold")))
                for i in range(6)]
        await svc.handled_at_least(2)
        await asyncio.sleep(0.3)  # the other four had time to start, if they could
        assert svc.handled == 2 and svc.server.in_flight == {"acme": 6}
        t0 = time.monotonic()
        assert (await ask(broker, "beta", Echo(text="b"))).tenant == "beta"
        assert time.monotonic() - t0 < 2.0
        svc.release.set()
        assert [r.text for r in await asyncio.gather(*held)] == [str(i) for i in range(6)]
        assert svc.server.peak_working["acme"] == 2
        assert svc.server.in_flight == {} and svc.server._slots == {}
        # Long polls hold no slot: with both of beta's polls waiting, its call works.
        svc.release.clear()
        polls = [asyncio.create_task(ask(broker, "beta", Echo(text="p", do="poll")))
                 for _ in range(3)]
        await svc.handled_at_least(6 + 1 + 3)  # all three inside, with 2 slots
        assert (await ask(broker, "beta", Echo(text="now"))).text == "now"
        svc.release.set()
        assert [r.text for r in await asyncio.gather(*polls)] == ["p"] * 3
        assert svc.server._slots == {}
    finally:
        svc.release.set()
        await svc.stop()


async def test_the_total_bound_counts_every_tenant(broker: Broker) -> None:
    svc = EchoService(broker, limit=10, total=1)
    await svc.start()
    try:
        held = asyncio.create_task(ask(broker, "acme", Echo(text="a", do="hold")))
        await svc.handled_at_least(1)
        with pytest.raises(RateLimited):
            await ask(broker, "beta", Echo(text="b"))
        svc.release.set()
        assert (await held).text == "a"
    finally:
        svc.release.set()
        await svc.stop()


async def test_no_responders_is_retried_then_fails_within_the_policy_deadline(broker: Broker) -> None:
    policy = rpc.RetryPolicy("test", attempts=0, deadline_s=0.8, base_s=0.05, cap_s=0.2,
                             retry_on=(rpc.NoResponders, rpc.NoReply))
    tries: list[float] = []
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="nobody serves") as e:
        await ask(broker, "acme", Echo(text="x"), retry=policy, on_retry=lambda _e, s: tries.append(s))
    took = time.monotonic() - t0
    assert isinstance(e.value, rpc.NoResponders)
    assert 0.8 <= took < 0.8 + 1.0, took
    assert len(tries) >= 4 and max(tries) <= 0.2  # backoff capped, last sleep cut to the deadline
    # The caller words the error; a policy that does not retry it fails at once.
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="is the echo service up"):
        await ask(broker, "acme", Echo(text="x"),
                  unanswered=lambda e: Unavailable(f"is the echo service up? ({type(e.__cause__).__name__})"))
    assert time.monotonic() - t0 < 0.5
    # attempts bound it too: three tries, two sleeps.
    sleeps: list[float] = []
    with pytest.raises(rpc.NoResponders):
        await ask(broker, "acme", Echo(text="x"), on_retry=lambda _e, s: sleeps.append(s),
                  retry=rpc.RetryPolicy("three", attempts=3, base_s=0.01, retry_on=(rpc.NoResponders,)))
    assert sleeps == [0.01, 0.02]


async def test_no_reply_within_the_timeout_is_typed(broker: Broker) -> None:
    async def ignore(_m: Any) -> None:
        return None

    sub = await broker.nc.subscribe(broker.names.api("acme", "echo"), cb=ignore)
    t0 = time.monotonic()
    with pytest.raises(rpc.NoReply, match="no reply on"):
        await rpc.call(broker, broker.names.api("acme", "echo"), b"{}", DECODE, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    await sub.unsubscribe()


async def test_a_request_over_the_servers_max_payload_is_payload_too_large(
    broker: Broker, echo: EchoService
) -> None:
    """Refused before it is sent, typed, with what to do; the next call is served."""
    with pytest.raises(PayloadTooLarge, match=f"at most {broker.max_payload}.*fewer rows"):
        await ask(broker, "acme", Echo(text="x" * (broker.max_payload + 1)))
    assert (await ask(broker, "acme", Echo(text="small"))).text == "small"


async def test_the_transport_is_a_seam(broker: Broker, echo: EchoService) -> None:
    sent: list[str] = []

    async def counting(subject: str, payload: bytes, *, timeout: float, headers: Any) -> Any:  # noqa: ASYNC109
        sent.append(subject)
        return await broker.nc.request(subject, payload, timeout=timeout, headers=headers)

    assert (await ask(broker, "acme", Echo(text="via seam"), request=counting)).text == "via seam"
    assert sent == [echo.subject("acme")]
    await ask(broker, "acme", Echo(text="direct"))
    assert len(sent) == 1
    # The serving side: the raw respond of a Server can be replaced as well.
    answered: list[bytes] = []

    async def respond(request: Any, data: bytes, headers: dict[str, str] | None) -> None:
        answered.append(data)
        await request.respond(data, headers=headers)

    echo.server.respond = respond
    assert (await ask(broker, "acme", Echo(text="seam"))).text == "seam"
    assert len(answered) == 1 and b"seam" in answered[0]


def test_retry_policies_are_data_and_bounded() -> None:
    assert rpc.ONCE.attempts == 1 and not rpc.ONCE.retry_on
    assert rpc.SCHEDULER.within(5.0).deadline_s == rpc.SCHEDULER.deadline_s + 5.0
    assert rpc.SCHEDULER.within(0.0) is rpc.SCHEDULER
    assert rpc.inference_policy(0.0) is rpc.ONCE
    assert rpc.inference_policy(90.0).deadline_s == 90.0
    assert rpc.TENANT_API.attempts == 6 and rpc.TENANT_API.retry_on == (RateLimited,)
    with pytest.raises(ValueError, match="neither attempts nor a deadline"):
        rpc.RetryPolicy("forever", attempts=0, retry_on=(Unavailable,))
    with pytest.raises(ValueError, match="negative"):
        rpc.RetryPolicy("bad", deadline_s=-1.0)


@pytest.mark.parametrize(
    ("ttl", "every", "expected"),
    [(30.0, None, 10.0), (30.0, 3.0, 3.0), (1.5, None, MIN_TOUCH_EVERY_S), (6.0, 10.0, 2.0)],
)
def test_touch_period_follows_the_lease_ttl(ttl: float, every: float | None, expected: float) -> None:
    assert touch_every_s(ttl, every) == expected


async def test_the_keep_alive_follows_the_ttl_the_scheduler_replies(broker: Broker) -> None:
    agent = SchedulerAgent(broker, lease_ttl_s=2.4, expire_every_s=0.1, sweep_every_s=3600)
    await agent.start()
    try:
        c = SchedulerClient(broker, by="actor-1")
        assert c.lease_ttl_s == DEFAULT_LEASE_TTL_S  # nothing said yet
        await c.set_policy(WorkloadPolicy(tenant_id="acme", task_type="sft", max_in_flight=2))
        job = await c.reserve("acme", "sft")
        assert job is not None
        await c.mark(job.job_id, JobState.READY)
        assert c.lease_ttl_s == DEFAULT_LEASE_TTL_S  # a mark holds no lease: no TTL in it
        leased = await c.lease_next("actor")
        assert leased is not None and c.lease_ttl_s == 2.4
        # Kept alive (a touch every 1 s: a third of 2.4 s, at least 1 s) past twice the TTL.
        async with leases_kept(c, [leased]):
            await asyncio.sleep(5.0)
            assert (await c.get_job(leased.job_id)).state is JobState.LEASED
        done = await c.complete(leased)
        assert done.state is JobState.COMPLETED and done.attempt == leased.attempt
        # A reply without the field (an older scheduler) leaves the client's value.
        assert Reply().lease_ttl_s == 0.0
    finally:
        await agent.stop()


@pytest.mark.parametrize(
    ("reply", "tenant", "service", "ok"),
    [
        # a tenant's own subject: only its own inboxes (issue 24: the agents' and the
        # operators' inbox space were accepted too, so the control plane wrote a
        # tenant-chosen subject into the agents' private inboxes)
        ("_INBOX.jnx.acme.x1", "acme", False, True),
        ("_INBOX.jnx._svc.x1", "acme", False, False),
        ("_INBOX.jnx._admin.x1", "acme", False, False),
        ("_INBOX.jnx.bolt.x1", "acme", False, False),
        ("_INBOX.jnx.acme", "acme", False, False),  # the prefix alone is no inbox
        # the agents' subject for a tenant (only the service may publish there)
        ("_INBOX.jnx._svc.x1", "acme", True, True),
        ("_INBOX.jnx.acme.x1", "acme", True, False),
        # no tenant's subject: the agents' and the operators'
        ("_INBOX.jnx._svc.x1", None, False, True),
        ("_INBOX.jnx._admin.x1", None, False, True),
        ("_INBOX.jnx.acme.x1", None, False, False),
        ("jnx.api.bolt.create_workload", "acme", False, False),
        ("_INBOX.jnx.acme.>", "acme", False, False),
        ("", "acme", False, False),
    ],
)
def test_a_reply_goes_only_where_its_subject_promises(
    reply: str, tenant: str | None, service: bool, ok: bool
) -> None:
    from joynexus.broker.subjects import Names

    assert responder.reply_allowed(Names("jnx"), reply, tenant, service=service) is ok
