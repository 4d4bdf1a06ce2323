"""The training client on a real nats-server: calls are jobs, applied in order and
exactly once by the actor, a client-side loss matches the built-in one, hostile
calls fail at the door while another tenant's calls go on (issue 28)."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from joynexus.agents.actor.agent import Actor
from joynexus.agents.control import ControlPlane
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.policyio import PolicyStore
from joynexus.agents.producers import PolicyInitializer
from joynexus.agents.scheduler import SchedulerAgent
from joynexus.broker.connection import Broker
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas.base import decode
from joynexus.schemas.errors import InvalidSpec, JoyNexusError, QuotaExceeded, UnknownTenant
from joynexus.schemas.jobs import JobState
from joynexus.schemas.workloads import ApiReply
from joynexus.sdk import Client, SyncClient

pytestmark = [pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def _example(name: str = "custom_bc") -> Any:
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))  # the RL examples share pushcube_rl from there
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bc = _example()
rf = _example("reinforce_pushcube")
gp = _example("grpo_pushcube")


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    torch.manual_seed(0)
    return Backbone.build(BackboneConfig(size="tiny"))


class Deployment:
    def __init__(self, b: Broker, backbone: Backbone, out: Path) -> None:
        self.b, self.backbone, self.out = b, backbone, out
        self.actor_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.sched = SchedulerAgent(self.b, instance="sched", lease_ttl_s=5.0, expire_every_s=0.2)
        await self.sched.start()
        self.control = ControlPlane(self.b, init_policy=PolicyInitializer(self.b), instance="control",
                                    datasets_root=self.out / "datasets")
        await self.control.start()
        self.start_actor()

    def start_actor(self) -> Actor:
        self.actor_stop = asyncio.Event()
        self.actor = Actor(self.b, self.backbone, instance="actor", out_dir=self.out / "actor",
                           lease_wait_s=0.2)
        self.actor_task = asyncio.create_task(self.actor.run(self.actor_stop))
        return self.actor

    async def stop_actor(self) -> None:
        self.actor_stop.set()
        assert self.actor_task is not None
        await asyncio.wait_for(self.actor_task, 30)

    async def close(self) -> None:
        await self.stop_actor()
        await self.control.stop()
        await self.sched.stop()


@pytest.fixture
async def dep(broker: Broker, backbone: Backbone, tmp_path: Path) -> AsyncIterator[Deployment]:
    d = Deployment(broker, backbone, tmp_path)
    await d.start()
    yield d
    await d.close()


async def connect(nats_server: EmbeddedNats, broker: Broker, tenant: str) -> Client:
    return await Client.connect(nats_server.url, tenant=tenant, namespace=broker.names.namespace)


async def with_algo(nats_server: EmbeddedNats, broker: Broker, *tenants: str) -> list[Client]:
    """Clients of ``tenants``, each with a custom workload ``algo``."""
    out = []
    for t in tenants:
        c = await connect(nats_server, broker, t)
        await c.create_workload(bc.spec("algo"))
        out.append(c)
    return out


async def weights(broker: Broker, tenant: str, workload: str) -> tuple[int, torch.Tensor]:
    store = PolicyStore(broker)
    rec = await store.latest(tenant, workload)
    module = await store.load_module(rec)
    return rec.version, torch.cat([p.detach().reshape(-1) for p in module.head.parameters()])


async def test_client_side_mse_ends_at_the_builtin_bc_weights(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    a = await connect(nats_server, broker, "acme")
    b = await connect(nats_server, broker, "bolt")
    await a.create_workload(bc.spec("bc-custom"))
    await b.create_workload(bc.spec("bc-builtin"))
    _, start = await weights(broker, "acme", "bc-custom")
    la, lb = await asyncio.gather(bc.train(a, "bc-custom", custom=True, steps=20),
                                  bc.train(b, "bc-builtin", custom=False, steps=20))
    va, wa = await weights(broker, "acme", "bc-custom")
    vb, wb = await weights(broker, "bolt", "bc-builtin")
    assert va == vb == 21  # one version per optim_step, from version 1
    assert float((wa - start).abs().max()) > 1e-3  # it trained
    diff = float((wa - wb).abs().max())
    print(f"custom vs bc_mse after 20 steps: max abs weight difference {diff:.3g}")
    assert diff <= 1e-5
    assert np.allclose(la, lb, atol=1e-5) and la[-1] < la[0]
    await a.close()
    await b.close()


async def test_client_side_l1_ends_at_the_sft_workloads_weights(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """The same batches, once as training-client steps with an L1 written on the client
    and once as jobs of a tenant-fed sft workload (whose heads train with L1)."""
    from joynexus.ops.bench.primitives import write_layout
    from joynexus.schemas.workloads import WorkloadSpec

    write_layout(dep.out / "datasets" / "acme" / "layout")
    a = await connect(nats_server, broker, "acme")
    common = {"dataset": "layout", "action_horizon": 2, "head_hidden": 16, "instruction": "push"}
    await a.create_workload(WorkloadSpec(name="cust", task_type="custom", **common))  # type: ignore[arg-type]
    await a.create_workload(WorkloadSpec(name="demo", task_type="sft", source="tenant", **common))  # type: ignore[arg-type]
    _, start = await weights(broker, "acme", "cust")
    await bc.train(a, "cust", custom=True, steps=20, loss=bc.l1)
    schema = (await a.training_client("cust")).schema
    assert await bc.train_sft(a, "demo", schema, steps=20) == 21
    (vc, wc), (vs, ws) = await weights(broker, "acme", "cust"), await weights(broker, "acme", "demo")
    diff = float((wc - ws).abs().max())
    print(f"custom L1 vs sft after 20 steps: max abs weight difference {diff:.3g}")
    assert vc == vs == 21 and float((wc - start).abs().max()) > 1e-3
    assert diff <= 1e-5
    await a.close()


async def test_calls_apply_in_order_and_once_across_an_actor_restart(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    a = await connect(nats_server, broker, "acme")
    await a.create_workload(bc.spec("algo"))
    tc = await a.training_client("algo")
    batch = bc.batches(tc.schema, 1)[0]
    out = await tc.forward(batch)
    assert out["mean"].shape == (4, 2, 4) and out["log_std"].shape == (4, 4) and out["value"].shape == (4,)
    fb = tc.forward_backward(batch)
    step = tc.optim_step(learning_rate=1e-2)
    assert (await fb)["loss"] > 0 and (await step)["version"] == 2
    out2 = await tc.forward(batch)
    assert not np.allclose(out["mean"], out2["mean"])  # the forward after the step sees it
    # Restart the actor: it resumes from the committed state (seq, accumulated gradients).
    await tc.forward_backward(batch)
    await dep.stop_actor()
    dep.start_actor()
    tc2 = await a.training_client("algo")
    assert tc2.seq == tc.seq == 5
    assert (await tc2.optim_step())["version"] == 3
    version, w = await weights(broker, "acme", "algo")
    # A call delivered again (crash after its commit, before its completion) answers its
    # stored result and applies nothing.
    calls = [j for j in dep.sched.core.jobs.values()
             if j.tenant_id == "acme" and j.task_type == "custom" and j.state == JobState.COMPLETED]
    last = max(calls, key=lambda j: int(j.metadata.extra["seq"]))
    await dep.actor.apply_call(last)
    assert (await weights(broker, "acme", "algo"))[0] == version
    assert torch.equal((await weights(broker, "acme", "algo"))[1], w)
    st = await dep.actor.tenant("acme", "algo")
    assert st.calls.last_seq == 6 and st.module.version == 3
    # A call whose seq was applied already (another job) fails and changes nothing.
    first = min(calls, key=lambda j: int(j.metadata.extra["seq"]))
    again = msgspec.structs.replace(first, job_id="jffffffffffffffffffff", state=JobState.LEASED)
    await dep.actor.apply_call(again)
    st = await dep.actor.tenant("acme", "algo")
    assert st.calls.last_seq == 6 and "jffffffffffffffffffff" not in st.calls.results
    assert (await tc2.forward(batch))["mean"].shape == (4, 2, 4)  # the client goes on
    await a.close()


async def test_named_states_save_load_list_delete(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    a, b = await with_algo(nats_server, broker, "acme", "bolt")
    tc = await a.training_client("algo")
    tb = await b.training_client("algo")
    batch = bc.batches(tc.schema, 1)[0]
    await tc.save_state("start")
    _, w0 = await weights(broker, "acme", "algo")
    tc.forward_backward(batch)
    await tc.optim_step(learning_rate=1e-2)
    assert await tc.list_states() == ["start"]
    assert await tb.list_states() == []  # another tenant's workload of the same name sees none
    with pytest.raises(UnknownTenant):
        await tb.load_state("start")
    version = await tc.load_state("start")
    v, w = await weights(broker, "acme", "algo")
    assert version == v == 3 and torch.equal(w, w0)
    await tc.delete_state("start")
    assert await tc.list_states() == []
    with pytest.raises(InvalidSpec):
        await tc.save_state("../bolt")
    await a.close()
    await b.close()


async def _raw(client: Client, verb: str, body: bytes) -> ApiReply:
    msg = await client._b.nc.request(client._b.names.api(client.tenant, verb), body, timeout=10)
    return decode(msg.data, ApiReply)


async def test_hostile_calls_fail_at_the_door_and_another_tenant_goes_on(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    a, v = await with_algo(nats_server, broker, "acme", "vict")
    tc = await a.training_client("algo")
    victim = asyncio.create_task(bc.train(v, "algo", custom=False, steps=6))
    batch = bc.batches(tc.schema, 1)[0]
    # Non-finite and mis-shaped gradients, an unknown field: refused at put_data.
    for grads, err in (
        ({"mean": np.full((4, 2, 4), np.nan, np.float32)}, "finite|NaN|non-finite"),
        ({"mean": np.zeros((4, 3, 4), np.float32)}, "shape|must be"),
    ):
        rows = {k: batch[k] for k in ("obs_state", "obs_image_base_camera")}
        rows.update({"grad_mean": grads["mean"], "grad_log_std": np.zeros((4, 4), np.float32),
                     "grad_value": np.zeros(4, np.float32)})
        with pytest.raises(JoyNexusError, match=err):
            await tc._send("backward", rows, {})
    with pytest.raises(JoyNexusError, match="takes no fields"):
        await _door(tc, batch)
    # Hostile call bodies: a state name that is a path, NaN settings, an unknown op,
    # a code-like loss, rows over the quota, another tenant's workload.
    for body, err in (
        (b'{"workload":"algo","op":"save_state","seq":9,"name":"../bolt/x"}', "not a valid name"),
        (b'{"workload":"algo","op":"forward_backward","seq":9,"loss":"ppo","settings":{"clip":5.0},'
         b'"sample_count":1}', "finite|clip"),
        (b'{"workload":"algo","op":"exec","seq":9}', "op|exec"),
        (b'{"workload":"algo","op":"forward_backward","seq":9,"loss":"__import__(\'os\')",'
         b'"sample_count":1}', "loss"),
        (b'{"workload":"algo","op":"forward","seq":9,"sample_count":100000}', "quota|max_batch_size"),
    ):
        reply = await _raw(a, "train_call", body)
        assert reply.error is not None and reply.job is None, body
        assert re.search(err, reply.error.message), (body, reply.error.message)
    reply = await _raw(a, "train_result", b'{"workload":"algo","job_id":"j0000"}')
    assert reply.error is not None
    with pytest.raises(QuotaExceeded):
        await tc.forward({k: np.repeat(x, 200, axis=0) for k, x in batch.items()})
    # The hostile tenant's own client still works, and the victim trained all along.
    assert (await tc.forward(batch))["mean"].shape == (4, 2, 4)
    losses = await asyncio.wait_for(victim, 300)
    assert len(losses) == 6
    assert (await weights(broker, "vict", "algo"))[0] == 7
    await a.close()
    await v.close()


async def _door(tc: Any, batch: dict[str, np.ndarray]) -> None:
    """A forward whose rows carry a field the call does not read (past the SDK's filter)."""
    from joynexus.schemas.training import TrainCall

    call = TrainCall(workload=tc.workload, op="forward", seq=tc.seq + 1, sample_count=4)
    job = await tc._admitted(call)
    await tc.client._send_rows(job, {**batch, "evil": np.zeros((4, 1), np.float32)})


async def test_sync_facade(dep: Deployment, nats_server: EmbeddedNats, broker: Broker) -> None:
    def use() -> tuple[int, float]:
        with SyncClient.connect(nats_server.url, tenant="acme", namespace=broker.names.namespace) as c:
            c.create_workload(bc.spec("algo")).result(60)
            tc = c.training_client("algo")
            batch = bc.batches(tc._tc.schema, 1)[0]
            fb = tc.forward_backward(batch)
            step = tc.optim_step(learning_rate=1e-2)
            return step.result(120)["version"], fb.result(120)["loss"]

    version, loss = await asyncio.to_thread(use)
    assert version == 2 and loss > 0


@pytest.fixture
async def served(broker: Broker, backbone: Backbone) -> AsyncIterator[None]:
    """Inference (``act``) and an evaluator beside the deployment, for the RL examples."""
    from joynexus.agents.evaluator import Evaluator
    from joynexus.agents.inference import EnginePool

    pool = EnginePool(broker, backbone, max_batch=16, max_wait_ms=5)
    await pool.scale_to(1)
    stop = asyncio.Event()
    evaluator = asyncio.create_task(Evaluator(broker, instance="eval").run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(evaluator, 30)
        await pool.close()


def _well_formed(ev: dict[str, Any], start: int, end: int, episodes: int) -> None:
    """Both sides' Wilson intervals and the difference's Newcombe one hold their rates."""
    assert (ev["start"]["version"], ev["end"]["version"]) == (start, end)
    for side in (ev["start"], ev["end"]):
        lo, hi = side["ci95"]
        assert side["episodes"] == episodes and 0.0 <= lo <= side["success"] <= hi <= 1.0
    d, (lo, hi) = ev["difference"]["end_minus_start"], ev["difference"]["ci95"]
    assert d == round(ev["end"]["success"] - ev["start"]["success"], 4)
    assert -1.0 <= lo <= d <= hi <= 1.0 and hi - lo > 0.5  # two episodes a side: wide


async def test_reinforce_example_runs_its_iterations(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker, served: None
) -> None:
    """examples/reinforce_pushcube.py, tiny: act rollouts in a PushCube this process runs,
    the client's REINFORCE loss, one version per iteration, success with intervals; then
    the service evaluates the start and the last version on the same seeds, and the
    report carries both rates' Wilson intervals and the difference's Newcombe one."""
    a = await connect(nats_server, broker, "acme")
    await a.create_workload(rf.pc.spec("pg"))
    _, start = await weights(broker, "acme", "pg")
    out = await rf.reinforce(a, "pg", iterations=2, envs=2, steps=4, rows_per_call=4)
    assert [r["version"] for r in out["iterations"]] == [2, 3]
    for r in out["iterations"]:
        lo, hi = r["ci95"]
        assert 0.0 <= lo <= r["success"] <= hi <= 1.0
    assert float(((await weights(broker, "acme", "pg"))[1] - start).abs().max()) > 0
    _well_formed(await rf.pc.evaluate_pair(a, "pg", 1, 3, episodes=2), 1, 3, 2)
    await a.close()


async def test_grpo_example_runs_and_reports_intervals(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker, served: None
) -> None:
    """examples/grpo_pushcube.py through the examples' own run (start evaluated first,
    training, the end on the same seeds), tiny: 2 iterations of up to 8 rows, 2 passes
    in minibatches of 4, a version per minibatch; the ratio's statistics reported, and
    before any step the ratio is 1 (the act mean and the forward mean agree)."""
    a = await connect(nats_server, broker, "acme")
    args = gp.parser().parse_args(["--name", "gr", "--iterations", "2", "--envs", "2", "--group", "2",
                                   "--steps", "4", "--epochs", "2", "--minibatch", "4", "--head-hidden", "32",
                                   "--eval-episodes", "2", "--lr", "1e-3"])
    out = await gp.pc.run(a, args, gp.train)
    versions = [r["version"] for r in out["iterations"]]
    assert 1 < versions[0] < versions[1] <= 9  # a version a minibatch (rows past a success are left out)
    for r in out["iterations"]:
        lo, hi = r["ci95"]
        assert 0.0 <= lo <= r["success"] <= hi <= 1.0 and r["passes"] == 2 and 0 < r["rows"] <= 8
        assert r["approx_kl"] >= 0 and 0.0 <= r["clip_frac"] <= 1.0
        assert abs(r["kl_first"]) < 1e-3  # the client's behaviour log-probs are the policy's own
    _well_formed(out["evaluation"], 1, versions[1], 2)
    assert out["settings"]["epochs"] == 2 and out["train_s"] > 0
    assert out["rollouts"]["last"]["episodes"] == 2 and 0.0 <= out["rollouts"]["last"]["success"] <= 1.0
    await a.close()


async def test_a_cached_state_is_reloaded_once_another_actor_committed(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker, backbone: Backbone, tmp_path: Path
) -> None:
    a = await connect(nats_server, broker, "acme")
    await a.create_workload(bc.spec("algo"))
    tc = await a.training_client("algo")
    await tc.optim_step()
    mine = await dep.actor.tenant("acme", "algo")
    assert await dep.actor.tenant("acme", "algo") is mine  # still the one in force: the cache
    other = Actor(broker, backbone, instance="actor-2", out_dir=tmp_path / "actor-2")
    theirs = await other.tenant("acme", "algo")
    theirs.module.version += 1
    job = next(j for j in dep.sched.core.jobs.values() if j.tenant_id == "acme")
    assert await other._commit(job, theirs)  # another actor commits this tenant
    again = await dep.actor.tenant("acme", "algo")
    assert again is not mine and again.revision == theirs.revision
    assert again.module.version == mine.module.version + 1
    await a.close()


async def test_a_call_applied_before_a_crash_is_answered_not_applied_again(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """The actor dies after an optim_step's commit, before its job completes: the next
    actor leases it again (its lease lapsed), answers the stored result, steps nothing."""
    (a,) = await with_algo(nats_server, broker, "acme")
    tc = await a.training_client("algo")
    batch = bc.batches(tc.schema, 1)[0]
    await tc.forward_backward(batch)
    never = asyncio.Event()

    async def die_here(job: Any, version: int) -> None:
        await never.wait()

    dep.actor._complete_call = die_here  # type: ignore[method-assign]
    assert (await tc.optim_step(learning_rate=1e-2))["version"] == 2  # answered from its commit
    _, w = await weights(broker, "acme", "algo")
    assert dep.actor_task is not None
    dep.actor_task.cancel()
    await asyncio.gather(dep.actor_task, return_exceptions=True)
    dep.start_actor()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while any(j.state != JobState.COMPLETED for j in dep.sched.core.jobs.values() if j.tenant_id == "acme"):
        assert loop.time() < deadline, "the re-delivered call did not complete"
        await asyncio.sleep(0.2)
    version, w2 = await weights(broker, "acme", "algo")
    assert version == 2 and torch.equal(w, w2)
    st = await dep.actor.tenant("acme", "algo")
    assert st.module.version == 2 and st.calls.last_seq == 2
    assert (await tc.optim_step())["version"] == 3
    await a.close()


async def test_a_new_client_numbers_its_calls_after_those_still_in_flight(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    (a,) = await with_algo(nats_server, broker, "acme")
    tc = await a.training_client("algo")
    await tc.optim_step()
    await dep.stop_actor()  # nothing applies for now
    pending = [tc.zero_grad(), tc.optim_step()]  # handed in, ready, not applied
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while tc.seq < 3:
        assert loop.time() < deadline
        await asyncio.sleep(0.05)
    tc2 = await a.training_client("algo")
    assert tc2.seq == 3
    dep.start_actor()
    step = tc2.optim_step()
    await asyncio.gather(*pending)
    assert (await step)["version"] == 4  # after the earlier client's: in order
    await a.close()


async def test_a_call_leased_before_an_earlier_open_one_is_held_not_failed(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """Call 2 in hand while call 1 is still open (another actor's, or a dead one's whose
    lease has not lapsed): held with its lease renewed, then applied after call 1;
    before this, call 2 failed ('comes before call 1') and so did the client's future."""
    (a,) = await with_algo(nats_server, broker, "acme")
    tc = await a.training_client("algo")
    await dep.stop_actor()  # nothing applies for now
    batch = bc.batches(tc.schema, 1)[0]
    fb, step = tc.forward_backward(batch), tc.optim_step(learning_rate=1e-2)
    first = await dep.actor.sched.lease_next("actor", wait_s=30)
    second = await dep.actor.sched.lease_next("actor", wait_s=30)
    assert first is not None and second is not None
    assert [first.metadata.extra["seq"], second.metadata.extra["seq"]] == ["1", "2"]
    assert await dep.actor.prepare_call(second) is None
    assert [j.job_id for j in dep.actor.deferred_calls] == [second.job_id]
    assert (await dep.actor.sched.get_job(second.job_id)).state is JobState.LEASED  # held, not failed
    await dep.actor.apply_call(first)
    await dep.actor.apply_call(dep.actor.deferred_calls.pop())
    assert (await fb)["loss"] > 0 and (await step)["version"] == 2
    st = await dep.actor.tenant("acme", "algo")
    assert st.calls.last_seq == 2 and st.module.version == 2
    dep.start_actor()
    await a.close()


async def test_a_call_after_one_the_scheduler_failed_still_applies(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """Call 1 ends unapplied (the scheduler fails a call whose leases kept lapsing):
    its future fails with the reason, and call 2 applies instead of failing for the gap."""
    (a,) = await with_algo(nats_server, broker, "acme")
    tc = await a.training_client("algo")
    await dep.stop_actor()
    batch = bc.batches(tc.schema, 1)[0]
    fb, step = tc.forward_backward(batch), tc.optim_step(learning_rate=1e-2)
    first = await dep.actor.sched.lease_next("actor", wait_s=30)
    assert first is not None and first.metadata.extra["seq"] == "1"
    await dep.actor.sched.fail(first.job_id, "leased 5 times (poison)", attempt=first.attempt)
    second = await dep.actor.sched.lease_next("actor", wait_s=30)
    assert second is not None and second.metadata.extra["seq"] == "2"
    await dep.actor.apply_call(second)
    with pytest.raises(JoyNexusError, match="poison"):
        await fb
    assert (await step)["version"] == 2
    st = await dep.actor.tenant("acme", "algo")
    assert st.calls.last_seq == 2 and st.module.version == 2
    dep.start_actor()
    await a.close()


async def test_a_new_client_takes_the_workload_over_and_the_old_one_is_told(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """Two training clients on one workload numbered their calls alike, and the second
    one's calls failed as 'applied already'. Now the newest client wins: the older
    one's calls are refused with a Conflict that says why, nothing of them applies,
    and two clients starting at once get different epochs."""
    (a,) = await with_algo(nats_server, broker, "acme")
    old = await a.training_client("algo")
    assert (await old.optim_step())["version"] == 2
    new = await a.training_client("algo")
    assert new.epoch == old.epoch + 1 and new.seq == 1
    with pytest.raises(JoyNexusError, match="newer training client") as refused:
        await old.optim_step()
    assert refused.value.code == "conflict"
    assert (await new.optim_step())["version"] == 3
    st = await dep.actor.tenant("acme", "algo")
    assert st.calls.last_seq == 2 and st.module.version == 3
    both = await asyncio.gather(a.training_client("algo"), a.training_client("algo"))
    assert sorted(c.epoch for c in both) == [new.epoch + 1, new.epoch + 2]
    await a.close()


async def test_rows_put_across_a_control_plane_restart_are_put_once(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward's rows go one per put_data; the control plane is restarted after the
    second put landed and its reply is lost: the SDK asks again (at the same offset, a
    no-op) once the new control plane answers, and the call reads each row once, in
    order: its outputs equal those of the same rows sent with no fault."""
    import joynexus.sdk.data as sdk_data
    from joynexus.schemas.errors import Unavailable

    a, b = await with_algo(nats_server, broker, "acme", "bolt")
    tca, tcb = await a.training_client("algo"), await b.training_client("algo")
    batch = bc.batches(tca.schema, 1, rows=5)[0]
    monkeypatch.setattr(sdk_data, "PUT_CHUNK_BYTES", 1)  # one row per put_data
    api, puts = a._api, []

    async def lossy(verb: str, req: Any, **kw: Any) -> Any:
        reply = await api(verb, req, **kw)
        if verb == "put_data":
            puts.append(req.offset)
            if len(puts) == 2:  # it landed; the control plane dies before answering
                await dep.control.stop()
                dep.control = ControlPlane(broker, init_policy=PolicyInitializer(broker),
                                           instance="control-2", datasets_root=dep.out / "datasets")
                await dep.control.start()
                raise Unavailable("the reply was lost")
        return reply

    monkeypatch.setattr(a, "_api", lossy)
    got, want = await asyncio.gather(tca.forward(batch), tcb.forward(batch))
    assert puts == [0, 1, 1, 2, 3, 4]  # the lost one asked again, at its offset
    # Equal up to float rounding: the two calls' rows may ride in different grouped
    # base forwards (a batch of another size sums in another order); a row read twice
    # or out of order would differ by the rows' own spread, orders of magnitude more.
    assert got["mean"].shape[0] == 5
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=0, atol=1e-6)
    await a.close()
    await b.close()


async def test_a_call_whose_reply_was_lost_is_reserved_once(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train_call reserved the call's job, then its reply was lost (the control plane
    restarted): the SDK asks again marked ``again`` and is answered that job, not a
    second one; a row call's rows then go in once. One job per call, each applied once."""
    from joynexus.schemas.errors import Unavailable

    (a,) = await with_algo(nats_server, broker, "acme")
    tc = await a.training_client("algo")
    batch = bc.batches(tc.schema, 1, rows=3)[0]
    api, sent = a._api, []

    async def lossy(verb: str, req: Any, **kw: Any) -> Any:
        reply = await api(verb, req, **kw)
        if verb == "train_call":
            sent.append((req.seq, req.again))
            if not req.again:
                raise Unavailable("the reply was lost")
        return reply

    monkeypatch.setattr(a, "_api", lossy)
    fb, step = tc.forward_backward(batch), tc.optim_step(learning_rate=1e-2)
    assert (await fb)["loss"] > 0 and (await step)["version"] == 2
    assert sent == [(1, False), (1, True), (2, False), (2, True)]
    calls = [j for j in dep.sched.core.jobs.values() if j.tenant_id == "acme" and j.task_type == "custom"]
    assert sorted(j.metadata.extra["seq"] for j in calls) == ["1", "2"]
    assert all(j.state is JobState.COMPLETED for j in calls)
    st = await dep.actor.tenant("acme", "algo")
    assert st.calls.last_seq == 2 and st.module.version == 2
    await a.close()



async def test_a_put_refused_at_its_offset_holds_no_queue_room(
    dep: Deployment, nats_server: EmbeddedNats, broker: Broker
) -> None:
    """A put past the rows already put is refused (``Conflict``) and writes nothing: the
    tenant's Training Queue room it counted comes back (it held it until the job ended,
    so a tenant's own gaps ate its quota); the rows put at their offsets then run."""
    from joynexus.schemas.errors import Conflict
    from joynexus.schemas.inference import TensorBytes
    from joynexus.schemas.workloads import CloseJob, PutData

    (a,) = await with_algo(nats_server, broker, "acme")
    tc = await a.training_client("algo")
    rows = bc.batches(tc.schema, 1, rows=2)[0]
    rows.pop("actions")
    from joynexus.schemas.training import TrainCall

    opened = await a._api("train_call", TrainCall(workload="algo", op="forward", seq=tc.seq + 1,
                                                  sample_count=2, client=tc.epoch))
    job_id = opened.job.job_id

    def put(i: int, offset: int) -> PutData:
        return PutData(job_id=job_id, offset=offset,
                       fields={k: TensorBytes.from_array(v[i:i + 1]) for k, v in rows.items()})

    with pytest.raises(Conflict, match="a put at row 3"):
        await a._api("put_data", put(0, 3))
    assert dep.control.usage("acme")["tq_bytes"] == 0
    await a._api("put_data", put(0, 0))
    held = dep.control.usage("acme")["tq_bytes"]
    assert held > 0
    await a._api("put_data", put(0, 0))  # asked again: nothing more written or held
    assert dep.control.usage("acme")["tq_bytes"] == held
    await a._api("put_data", put(1, 1))
    await a._api("close_job", CloseJob(job_id=job_id))
    tc.seq += 1
    out = await tc._result(job_id)
    assert out.outputs["mean"].to_array("mean").shape[0] == 2
    await a.close()
