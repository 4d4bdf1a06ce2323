"""Tenants fenced by the broker, on a real nats-server with authorization on.

One secured deployment per module (scheduler, control plane, inference
engine, actor in this process, all as the service identity; an operator
issues tenants their credentials through the admin API). Tenant ``acme``
tries everything it must not do to tenant ``bolt``: each attempt is refused,
reaches acme as a clear error, lands in the metrics stream as a security
event, and neither tenant's training stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest

from joynexus.agents.control import ControlPlane
from joynexus.agents.producers import PolicyInitializer
from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.broker.permissions import parse_refusal, render_authorization, tenant_permissions
from joynexus.broker.subjects import Names
from joynexus.ops.admin.tenants import add_tenant, list_tenants, remove_tenant
from joynexus.ops.isolation import SecuredDeployment
from joynexus.ops.runtime.deploy import embedded
from joynexus.schemas.errors import (
    InvalidSpec,
    PermissionDenied,
    ShapeMismatch,
    Unavailable,
    UnknownJob,
)
from joynexus.schemas.inference import InferRequest, Observation, TensorBytes, encode_msgpack
from joynexus.schemas.jobs import JobState
from joynexus.schemas.workloads import CloseJob, WorkloadSpec
from joynexus.sdk import Client

pytestmark = [pytest.mark.security, pytest.mark.timeout(300)]
NS = "jnx"
MODEL = "qwen2.5-vl-tiny"


# ---------------------------------------------------------------- pure parts
def test_tenant_permissions_name_only_its_own_subjects() -> None:
    p = tenant_permissions(Names("jnx"), "acme")
    assert p == {
        "publish": {"allow": ["jnx.api.acme.*", "jnx.infer.*.acme"]},
        "subscribe": {"allow": ["_INBOX.jnx.acme.>"]},
    }
    conf = render_authorization([])
    assert "authorization" in conf and "users = [" in conf


def test_server_refusal_lines_parse() -> None:
    pub = parse_refusal(
        '[ERR] 127.0.0.1:52604 - cid:6 - "v2.16.0:python3" - "$G/user:jnx.acme" - '
        'Publish Violation - Subject "jnx.api.bolt.x"'
    )
    assert pub is not None and (pub.user, pub.action, pub.subject) == (
        "jnx.acme",
        "publish",
        "jnx.api.bolt.x",
    )
    assert pub.tenant(Names("jnx")) == "acme"
    sub = parse_refusal(
        '[ERR] 1.2.3.4:5 - cid:6 - "x" - "$G/user:jnx.acme" - Subscription Violation - '
        'Subject "jnx.job.bolt.>", SID 2'
    )
    assert sub is not None and sub.action == "subscribe" and sub.subject == "jnx.job.bolt.>"
    auth = parse_refusal('[ERR] 127.0.0.1:5 - cid:7 - authentication error - User "jnx.cora"')
    assert auth is not None and auth.action == "connect" and auth.tenant(Names("jnx")) == "cora"
    assert parse_refusal("[INF] Server is ready") is None


# ---------------------------------------------------------------- a secured deployment
#: The deployment of these tests: joynexus.ops.isolation.SecuredDeployment (also the
#: adversarial suite's and `joynexus bench isolation`'s).
Secure = SecuredDeployment


@pytest.fixture(scope="module")
def datasets_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tenants' dataset spaces: <root>/<tenant>/<dataset>."""
    return tmp_path_factory.mktemp("datasets")


@pytest.fixture(scope="module")
def sft_dataset(datasets_root: Path) -> str:
    """The name of a dataset each tenant of these tests has in its own space."""
    import shutil

    from joynexus.agents.envs.lerobot_data import generate_dataset

    root = datasets_root / "acme" / "pick"
    generate_dataset("PickCube-v1", root, episodes=2, obs="rgb", image_size=64, seed=0)
    for tenant in ("bolt", "cora", "hana"):
        shutil.copytree(root, datasets_root / tenant / "pick")
    return "pick"


@pytest.fixture(scope="module")
async def secure(
    tmp_path_factory: pytest.TempPathFactory, datasets_root: Path
) -> AsyncIterator[Secure]:
    """Scheduler, control plane (as the control identity), inference engine and actor
    in this process as the service identity, on a fresh secured embedded server."""
    async with SecuredDeployment(tmp_path_factory.mktemp("secure"), namespace=NS,
                          datasets_root=datasets_root, prefetch_dataset=False) as dep:
        yield dep


def batch(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs_image_base_camera": rng.integers(0, 255, (rows, 3, 64, 64), dtype=np.uint8),
        "obs_state": rng.standard_normal((rows, 12), dtype=np.float32),
        "actions": rng.uniform(-1, 1, (rows, 2, 4)).astype(np.float32),
    }


async def raw_tenant(s: Secure, tenant: str) -> tuple[nats.NATS, list[str]]:
    """A bare nats-py connection with the tenant's credentials, collecting server errors."""
    raw = await s.raw(tenant)
    return raw.nc, raw.errors


def claimed(user: str) -> Any:
    """A security event of a refused login that claimed ``user``."""
    return lambda e: e["action"] == "connect" and (
        e.get("claimed_user") == user or user in e.get("claimed_users", [])
    )


async def until(pred: Any, within: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- the tests
async def test_anonymous_and_wrong_password_connections_are_refused(secure: Secure) -> None:
    with pytest.raises(PermissionDenied, match="refused the credentials"):
        await Broker.connect(secure.url, name="anon", credentials=None, initial_timeout_s=5)
    with pytest.raises(PermissionDenied, match=r"refused the credentials of 'jnx\.nobody'"):
        await Broker.connect(
            secure.url,
            name="guess",
            credentials=Credentials(user="jnx.nobody", password="guess"),
            initial_timeout_s=5,
        )
    # Filed under "_" with the user it claimed: a failed login is not that tenant's doing.
    await secure.wait_security("_", claimed("jnx.nobody"), "the failed login of jnx.nobody")


async def test_tenant_cannot_reach_another_tenants_data_and_both_keep_training(
    secure: Secure, sft_dataset: str, datasets_root: Path
) -> None:
    n = Names(NS)
    acme_creds, bolt_creds = await secure.issue("acme"), await secure.issue("bolt")
    assert acme_creds.user == "jnx.acme" and acme_creds.password
    acme = await Client.connect(credentials=acme_creds)
    bolt = await Client.connect(credentials=bolt_creds)
    spec = WorkloadSpec(name="pick", task_type="sft", dataset=sft_dataset, source="tenant",
                        action_horizon=2)
    await acme.create_workload(spec)
    await bolt.create_workload(spec)
    # acme names bolt's dataset every way it can: one answer, and nothing of bolt's
    (datasets_root / "acme" / "stolen").symlink_to(datasets_root / "bolt" / "pick")
    for sneaky in ("../bolt/pick", str(datasets_root / "bolt" / "pick"), "stolen", "/etc"):
        with pytest.raises(InvalidSpec, match="tenant 'acme' has no dataset"):
            await acme.create_workload(
                WorkloadSpec(name="steal", task_type="sft", dataset=sneaky, source="tenant")
            )
    # bolt watches its own events through the control plane (no JetStream access).
    bolt_events: list[Any] = []

    async def watch() -> None:
        async for ev in bolt.events("pick"):
            bolt_events.append(ev)

    watcher = asyncio.create_task(watch())
    bolt_job = await bolt.submit_sft_batch("pick", batch(4, 1))
    acme_job = await acme.submit_sft_batch("pick", batch(4, 2))
    await until(lambda: any(e.job.state is JobState.COMPLETED for e in bolt_events), 120,
                "bolt's first job to be trained")
    assert await acme.latest_version("pick") >= 1
    wrong = batch(4, 9)
    wrong["obs_state"] = wrong["obs_state"][:, :9]
    with pytest.raises(ShapeMismatch, match=r"obs_state.*expected \[B, 12\], got \[4, 9\]"):
        await acme.submit_sft_batch("pick", wrong)

    nc, errors = await raw_tenant(secure, "acme")
    try:
        # 1. Publish a job event for bolt: refused, the log has nothing from acme.
        forged = n.job_subject("bolt", bolt_job.job_id, "completed")
        await nc.publish(forged, b'{"forged": true}')
        # 1b. End bolt's workload by forging its end in the log: refused the same way.
        forged_end = n.workload_end_subject("bolt", "pick")
        await nc.publish(forged_end, b'{"event": "workload_ended", "tenant_id": "bolt", '
                                     b'"workload": "pick", "state": "done"}')
        # 2. Subscribe to bolt's job events: refused, nothing arrives.
        spied: list[Any] = []

        async def on_spied(msg: Any) -> None:
            spied.append(msg)

        await nc.subscribe(n.tenant_jobs("bolt"), cb=on_spied)
        # 3. Read bolt's Training Queue partition and weights through the JetStream API.
        get = json.dumps({"seq": 1, "next_by_subj": n.tq_partition("bolt", bolt_job.partition_id)})
        await nc.publish(n.direct_get(n.tq_stream), get.encode(), reply=nc.new_inbox())
        with pytest.raises(Exception):  # noqa: B017 (refused: no JetStream API at all)
            await nc.jetstream().object_store(n.weights_store)
        # 4. Register a workload as bolt.
        await nc.publish(n.api("bolt", "create_workload"), b"{}")
        await nc.flush()
        await until(lambda: len(errors) >= 6, 10, "the server's refusals")
        text = "\n".join(errors)
        for subject in (forged, forged_end, n.tenant_jobs("bolt"), n.direct_get(n.tq_stream),
                        n.api("bolt", "create_workload")):
            assert f'"{subject.lower()}"' in text, (subject, text)
        assert "$js.api.stream.info.obj_jnx_weights" in text
        assert nc.is_connected  # a refusal does not cost the connection
        assert (await bolt.get_workload("pick")).record.state == "active"  # bolt goes on
        # 5. An inference request claiming to be bolt: on bolt's subject it is refused by
        # the server; on acme's own subject with bolt in the payload, by the engine.
        obs = Observation(
            images={"base_camera": TensorBytes.from_array(np.zeros((1, 3, 64, 64), np.uint8))},
            instruction="pick",
            state=TensorBytes.from_array(np.zeros((1, 12), np.float32)),
        )
        wl = (await acme.get_workload("pick")).record
        claim = encode_msgpack(InferRequest(tenant_id="bolt", workload="pick",
                                            schema_signature=wl.schema_signature,
                                            observation=obs))
        await nc.publish(n.infer(MODEL, "bolt"), claim, reply=nc.new_inbox())
        reply = await nc.request(n.infer(MODEL, "acme"), claim, timeout=10)
        assert b"permission_denied" in reply.data and b"bolt" in reply.data
        await until(lambda: f'"{n.infer(MODEL, "bolt")}"' in "\n".join(errors), 10,
                    "the refusal of bolt's inference subject")
        # bolt's job events go on; acme's refused subscription sees none of them.
        seen = len(bolt_events)
        bolt2 = await bolt.submit_sft_batch("pick", batch(4, 3))
        await until(lambda: len(bolt_events) > seen, 10, "bolt's new events")
        await nc.flush()
        assert spied == []
    finally:
        await nc.close()

    # Through the SDK every attempt is a clear, immediate error.
    as_bolt = Client(acme._b, "bolt")  # acme's connection pretending to be bolt
    with pytest.raises(PermissionDenied, match=r"jnx\.api\.bolt\.create_workload"):
        await as_bolt.create_workload(WorkloadSpec(name="x", task_type="sft",
                                                   dataset=sft_dataset))
    with pytest.raises(InvalidSpec, match="credentials are tenant 'acme'"):
        await Client.connect(tenant="bolt", credentials=acme_creds)
    with pytest.raises(UnknownJob):  # bolt's job through acme's own API: not revealed
        await acme._api("close_job", CloseJob(job_id=bolt_job.job_id))
    assert await bolt.latest_version("pick") >= 2  # acme's API never reaches bolt's policy

    # Every refusal is a security event of acme in the metrics stream.
    for action, subject, source in (
        ("publish", forged, "nats-server"),
        ("subscribe", n.tenant_jobs("bolt"), "nats-server"),
        ("publish", n.api("bolt", "create_workload"), "nats-server"),
        ("claim_tenant", n.infer(MODEL, "acme"), "inference"),
        ("close_job", n.api("acme", "close_job"), "control"),
    ):
        await secure.wait_security(
            "acme",
            lambda e, a=action, sj=subject, so=source: (
                e["action"] == a and e["target"].lower() == sj.lower() and e["source"] == so
            ),
            f"{action} {subject} by {source}",
        )
    assert not await secure.security_events("bolt")  # bolt did nothing wrong

    # Nothing of acme's reached bolt's job log, and both tenants keep training.
    async with asyncio.timeout(5):
        js_msg = await secure.admin.js.get_last_msg(n.jobs_stream, n.job_filter("bolt", bolt_job.job_id))
    assert b"forged" not in js_msg.data
    acme2 = await acme.submit_sft_batch("pick", batch(4, 4))
    await until(
        lambda: {e.job.job_id for e in bolt_events if e.job.state is JobState.COMPLETED}
        >= {bolt_job.job_id, bolt2.job_id},
        120,
        "bolt's jobs after the attacks",
    )
    assert all(e.job.tenant_id == "bolt" for e in bolt_events)
    acme_done: set[str] = set()

    async def acme_trained() -> None:
        async for ev in acme.events("pick"):
            if ev.job.state is JobState.COMPLETED:
                acme_done.add(ev.job.job_id)
            if {acme_job.job_id, acme2.job_id} <= acme_done:
                return

    await asyncio.wait_for(acme_trained(), 120)
    assert await acme.latest_version("pick") == 3 and await bolt.latest_version("pick") == 3
    watcher.cancel()
    await acme.close()
    await bolt.close()


async def test_revoked_tenant_loses_access(secure: Secure, sft_dataset: str) -> None:
    creds = await secure.issue("cora")
    cora = await Client.connect(credentials=creds)
    await cora.create_workload(WorkloadSpec(name="pick", task_type="sft",
                                            dataset=sft_dataset, source="tenant",
                                            action_horizon=2))
    assert [w.name for w in await cora.list_workloads()] == ["pick"]
    assert "cora" in [t.tenant_id for t in await list_tenants(secure.admin)]

    reply = await remove_tenant(secure.admin, "cora")
    assert reply.applied == "yes" and reply.cancelled == ["pick"]
    # The live connection is closed by the server's reload; the next call says why.
    with pytest.raises(PermissionDenied, match="revoked"):
        for _ in range(50):
            await cora.list_workloads()
            await asyncio.sleep(0.1)
    with pytest.raises(PermissionDenied, match=r"refused the credentials of 'jnx\.cora'"):
        await Client.connect(credentials=creds)
    assert "cora" not in [t.tenant_id for t in await list_tenants(secure.admin)]
    await secure.wait_security("_", claimed("jnx.cora"), "the refused login of the revoked tenant")
    # A new slot issues new credentials; the revoked password stays refused.
    fresh = await secure.issue("cora")
    assert fresh.password != creds.password
    again = await Client.connect(credentials=fresh)
    assert [w.record.state for w in await again.list_workloads()] == ["cancelled"]
    await again.close()
    with pytest.raises(PermissionDenied):
        await Client.connect(credentials=creds)


async def test_rotation_and_the_operator_api(secure: Secure) -> None:
    old = await secure.issue("dora")
    with pytest.raises(InvalidSpec, match="--rotate"):
        await add_tenant(secure.admin, "dora", url=secure.url)
    new, reply = await add_tenant(secure.admin, "dora", url=secure.url, rotate=True)
    assert reply.applied == "yes" and reply.tenant is not None and reply.tenant.rotated_at > 0
    with pytest.raises(PermissionDenied):
        await Client.connect(credentials=old)
    dora = await Client.connect(credentials=new)
    # The service identity may not use the operator API (tenants have no way to it at all).
    svc_errors: list[str] = []

    async def on_error(e: Exception) -> None:
        svc_errors.append(str(e))

    assert secure.ep.service is not None
    svc = await nats.connect(secure.url, user=secure.ep.service.user,
                             password=secure.ep.service.password, error_cb=on_error)
    await svc.publish(Names(NS).admin("tenant_add"), b'{"tenant": "evil"}')
    await svc.flush()
    await until(lambda: any("jnx.admin.tenant_add" in e for e in svc_errors), 10,
                "the service identity's refusal on the operator API")
    await svc.close()
    assert "evil" not in [t.tenant_id for t in await list_tenants(secure.admin)]
    await dora.close()


async def test_status_shows_refused_attempts(secure: Secure) -> None:
    from joynexus.ops.admin.status import collect, render

    await secure.issue("erin")
    nc, errors = await raw_tenant(secure, "erin")
    await nc.publish(Names(NS).api("someone", "list_workloads"), b"{}")
    await nc.flush()
    await until(lambda: bool(errors), 10, "the refusal")
    await nc.close()
    await secure.wait_security("erin", lambda e: e["action"] == "publish", "erin's refusal")
    s = await collect(secure.admin)
    erin = [r for r in s["security"] if r["tenant"] == "erin"]
    assert erin and erin[0]["refusals"] == 1
    assert erin[0]["last"]["target"] == "jnx.api.someone.list_workloads"
    text = render(s)
    assert "Refused attempts" in text and "jnx.api.someone.list_workloads" in text


async def test_operator_cli_issues_lists_and_revokes(secure: Secure, tmp_path: Path) -> None:
    """`joynexus tenant add/ls/rm` as an operator runs them, against the live server."""
    import os
    import sys

    assert secure.ep.admin_path is not None

    async def cli(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "joynexus.ops.cli", "tenant", *args, "--nats", secure.url,
            "--creds", str(secure.ep.admin_path), "--data-dir", str(tmp_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(), err.decode()

    rc, out, err = await cli("add", "gina")
    assert rc == 0, err
    path = tmp_path / "tenants" / NS / "gina.json"
    assert str(path) in out and oct(os.stat(path).st_mode & 0o777) == "0o600"
    creds = Credentials.load(path)
    assert (creds.kind, creds.tenant, creds.url) == ("tenant", "gina", secure.url)
    gina = await Client.connect(credentials=path)  # the file is all a tenant needs
    assert await gina.list_workloads() == []
    rc, out, _ = await cli("ls")
    assert rc == 0 and "gina" in out and "jnx.gina" in out
    rc, _, err = await cli("add", "gina")
    assert rc == 2 and "--rotate" in err  # a clear error, not a traceback
    rc, out, err = await cli("rm", "gina")
    assert rc == 0 and "revoked" in out, err
    with pytest.raises(PermissionDenied):
        for _ in range(50):
            await gina.list_workloads()
            await asyncio.sleep(0.1)


async def test_jobs_a_tenant_leaves_open_are_failed(secure: Secure, sft_dataset: str) -> None:
    """A client that dies between open_job and close_job must not hold an admission
    slot forever; one that gives up (an exception mid-submit) aborts at once."""
    from joynexus.agents.scheduler_client import SchedulerClient
    from joynexus.schemas.workloads import OpenJob

    hana = await Client.connect(credentials=await secure.issue("hana"))
    await hana.create_workload(WorkloadSpec(name="pick", task_type="sft", source="tenant",
                                            dataset=sft_dataset, action_horizon=2))
    sched = SchedulerClient(secure.service, by="test")
    left = (await hana._api("open_job", OpenJob(workload="pick", sample_count=4))).job
    given_up = (await hana._api("open_job", OpenJob(workload="pick", sample_count=4))).job
    assert left is not None and given_up is not None
    aborted = (await hana._api("abort_job", CloseJob(job_id=given_up.job_id, reason="oops"))).job
    assert aborted is not None and aborted.state is JobState.FAILED and "oops" in aborted.reason

    async def expired() -> bool:
        return (await sched.get_job(left.job_id)).state is JobState.FAILED

    deadline = asyncio.get_running_loop().time() + 30
    while not await expired():
        assert asyncio.get_running_loop().time() < deadline, "the open job was never failed"
        await asyncio.sleep(0.5)
    assert "did not close it within 8s" in (await sched.get_job(left.job_id)).reason
    # A control plane that starts later adopts the jobs opened before it.
    orphan = (await hana._api("open_job", OpenJob(workload="pick", sample_count=4))).job
    assert orphan is not None
    later = ControlPlane(secure.service, init_policy=PolicyInitializer(secure.service),
                         instance="control-later", open_job_ttl_s=2.0)
    await later.start()
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while (await sched.get_job(orphan.job_id)).state is not JobState.FAILED:
            assert asyncio.get_running_loop().time() < deadline, "the adopted job was never failed"
            await asyncio.sleep(0.3)
        assert "within 2s" in (await sched.get_job(orphan.job_id)).reason
    finally:
        await later.stop()
    # The slots are free again: a whole submission goes through.
    job = await hana.submit_sft_batch("pick", batch(4, 5))
    assert job.state is JobState.READY
    await hana.close()


@pytest.mark.timeout(180)
async def test_secured_cluster_applies_tenants_on_every_node(tmp_path: Path) -> None:
    """Three nodes with authorization on and the same bootstrap identities (copied
    from the first): a tenant issued through one node can connect to every node
    as soon as tenant_add answers, and a revocation reaches every node."""
    import contextlib
    import shutil
    import socket

    from joynexus.ops.runtime.bootstrap import CREDS_DIR, bootstrap
    from joynexus.ops.runtime.natsconfig import ClusterOptions
    from joynexus.schemas.identities import APPLIED_KEY

    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    names = Names(NS)
    dirs = [tmp_path / f"n{i}" for i in range(3)]
    bootstrap(dirs[0], names)
    for d in dirs[1:]:
        shutil.copytree(dirs[0] / CREDS_DIR, d / CREDS_DIR)

    async def no_init(record: object) -> str:
        raise AssertionError("no workload is created here")

    with contextlib.ExitStack() as stack:
        eps = [
            stack.enter_context(
                embedded(
                    dirs[i],
                    name=f"jnx-n{i}",
                    cluster=ClusterOptions(
                        name="jnxsec",
                        port=ports[i],
                        routes=tuple(
                            f"nats-route://127.0.0.1:{p}" for j, p in enumerate(ports) if j != i
                        ),
                    ),
                    act_as_admin=False,
                )
            )
            for i in range(3)
        ]
        assert eps[0].admin and eps[1].admin and eps[0].service
        assert eps[1].admin.password == eps[0].admin.password  # one set of identities
        service = await Broker.connect(eps[0].url, name="svc", credentials=eps[0].control)
        admin = await Broker.connect(eps[1].url, name="op", credentials=eps[1].admin)
        control = ControlPlane(service, init_policy=no_init)  # type: ignore[arg-type]
        clients: list[Client] = []
        try:
            deadline = asyncio.get_running_loop().time() + 90

            async def every_node_syncing() -> bool:
                try:
                    kv = await admin.js.key_value(names.identities_bucket)
                    keys = await kv.keys()
                except Exception:
                    return False  # the cluster's JetStream is still forming
                return len([k for k in keys if k.startswith(f"{APPLIED_KEY}.")]) == 3

            while not await every_node_syncing():
                assert asyncio.get_running_loop().time() < deadline, "auth syncs never applied"
                await asyncio.sleep(0.5)
            await control.start()
            while True:  # the control plane's interest reaches the other nodes shortly
                try:
                    creds, reply = await add_tenant(admin, "acme", url=eps[2].url)
                    break
                except Unavailable:
                    assert asyncio.get_running_loop().time() < deadline, "no control plane"
                    await asyncio.sleep(0.2)
            assert reply.applied == "yes"
            for ep in eps:  # no retry: applied means applied on every node
                c = await Client.connect(ep.url, credentials=creds)
                clients.append(c)
                assert await c.list_workloads() == []
            reply = await remove_tenant(admin, "acme")
            assert reply.applied == "yes"
            for c in clients:
                with pytest.raises(PermissionDenied):
                    for _ in range(50):
                        await c.list_workloads()
                        await asyncio.sleep(0.1)
            for ep in eps:
                with pytest.raises(PermissionDenied):
                    await Client.connect(ep.url, credentials=creds)
        finally:
            for c in clients:
                with contextlib.suppress(Exception):
                    await c.close()
            await control.stop()
            await service.close()
            await admin.close()


async def test_events_end_when_the_client_closes(secure: Secure) -> None:
    """A tenant's event stream (a long-poll through the control plane) ends when
    its client closes, instead of retrying forever."""
    c = await Client.connect(credentials=await secure.issue("ivy"))
    got: list[Any] = []

    async def consume() -> None:
        async for ev in c.events():
            got.append(ev)

    task = asyncio.create_task(consume())
    await asyncio.sleep(1.0)  # a read_events long-poll is in flight
    await c.close()
    await asyncio.wait_for(task, 15)
    assert got == [] and task.done() and task.exception() is None


async def test_operator_quota_and_priority_class(secure: Secure) -> None:
    """An operator sets a tenant's quota and class (`tenant set`); the tenant's own
    priority number is ignored, its bounds hold, status shows usage against quota,
    and only the control identity may write identities."""
    from joynexus.ops.admin.status import collect, render
    from joynexus.ops.admin.tenants import NotApplied, check_applied, set_tenant
    from joynexus.schemas.errors import QuotaExceeded
    from joynexus.schemas.identities import AdminReply
    from joynexus.schemas.quotas import PRIORITY_CLASSES, Quota, parse_quota_args
    from joynexus.schemas.workloads import Scheduling

    creds = await secure.issue("quin")
    quota = parse_quota_args(["priority_class=premium", "max_active_workloads=1",
                              "max_in_flight=3"])
    reply = await set_tenant(secure.admin, "quin", quota)
    assert reply.tenant is not None and reply.tenant.quota == quota
    quin = await Client.connect(credentials=creds)
    try:
        spec = WorkloadSpec(name="one", task_type="rl", env="PickCube-v1", source="tenant",
                            action_horizon=2,
                            scheduling=Scheduling(priority=10**18, max_in_flight=3))
        wl = await quin.create_workload(spec)
        assert wl.record.spec.scheduling.priority == PRIORITY_CLASSES["premium"]
        with pytest.raises(QuotaExceeded, match="active workloads"):
            await quin.create_workload(WorkloadSpec(
                name="two", task_type="eval", env="PickCube-v1", init_from_workload="one"))
        with pytest.raises(QuotaExceeded, match="max_in_flight"):
            await quin.create_workload(WorkloadSpec(
                name="three", task_type="rl", env="PushCube-v1", source="tenant",
                scheduling=Scheduling(max_in_flight=4)))
        s = await collect(secure.admin)
        row = next(t for t in s["tenants"] if t["tenant"] == "quin")
        assert row["class"] == "premium" and row["active_workloads"] == [1, 1]
        assert "Tenants (in use / quota" in render(s)
        await quin.cancel_workload("one")
    finally:
        await quin.close()
    # A change no server confirmed is an error the operator sees.
    with pytest.raises(NotApplied, match="NOT be in force"):
        check_applied(AdminReply(applied="pending"), "revoking tenant x")
    with pytest.raises(InvalidSpec):
        Quota(priority_class="root")
    # Names that would collide with the service's own keys are not tenant names.
    for reserved in ("cursor", "version"):
        with pytest.raises(InvalidSpec, match="reserved"):
            await add_tenant(secure.admin, reserved, url=secure.url)
    # The service identity may not write tenant identities (only the control plane may).
    assert secure.ep.service is not None
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    svc = await nats.connect(secure.url, user=secure.ep.service.user,
                             password=secure.ep.service.password, error_cb=on_error)
    await svc.publish(f"$KV.{Names(NS).identities_bucket}.evil", b"{}")
    await svc.flush()
    await until(lambda: any("identities" in e.lower() for e in errors), 10,
                "the service identity's refusal on the identities bucket")
    await svc.close()


async def test_a_tenants_connections_are_capped_and_others_keep_theirs(secure: Secure) -> None:
    """A tenant past its ``max_connections`` quota: its newest connections are closed
    within seconds (the ones it had first stay), a security event says so, and another
    tenant's connections, the service's and the victim's calls are untouched (issue 24:
    300 extra connections from one tenant were all accepted)."""
    from joynexus.ops.admin.tenants import set_tenant
    from joynexus.schemas.quotas import Quota

    creds = await secure.issue("conn")
    await secure.issue("conv")
    await set_tenant(secure.admin, "conn", Quota(max_connections=3))
    sync = secure.ep.sync.sync  # the auth sync (in its thread)
    assert sync.conncap is not None

    def capped() -> bool:
        cap = sync.caps().get(creds.user or "")
        return cap is not None and cap.cap == 3

    await until(capped, 10, "the cap applied")
    other = [await secure.raw("conv") for _ in range(5)]
    first = [await secure.raw("conn") for _ in range(3)]
    await asyncio.sleep(1.5)
    assert all(c.nc.is_connected for c in first + other)
    flood = []
    for _ in range(12):
        with contextlib.suppress(Exception):
            flood.append(await secure.raw("conn"))
    try:
        await until(lambda: sum(c.nc.is_connected for c in flood) == 0, 15,
                    "the excess connections closed")
        assert all(c.nc.is_connected for c in first), "the tenant's first connections stay"
        assert all(c.nc.is_connected for c in other), "another tenant's connections stay"
        await secure.wait_security("conn", lambda e: "max_connections" in e.get("reason", ""),
                                   "the excess filed", within=15)
        conv = await secure.client("conv")
        assert isinstance(await conv.list_workloads(), list)
    finally:
        for c in first + other + flood:
            await c.close()
