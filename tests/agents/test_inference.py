"""The Inference Queue on a real nats-server: batching, version routing, elastic engines, errors.

Tiny backbone (random weights, built offline). Grouped and serial execution
agree to ATOL: one shared forward over concatenated rows reorders float sums
inside batched matmuls, so results match to ~1e-6, not bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from nats.micro.service import ServiceVerb, control_subject

from joynexus.agents.inference import (
    EnginePool,
    InferenceClient,
    InferenceEngine,
    run_inference_agent,
    serving_threads,
)
from joynexus.agents.inference.admission import canonical
from joynexus.agents.inference.pool import THREADS_ENV
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.agents.models.backbone_inputs import TokenCache, patchify
from joynexus.agents.models.features import FeatureSchema, canonicalize_request
from joynexus.agents.models.grouped import ActRequest, serial_forward
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.agents.models.policyio import PolicyStore, weights_bytes
from joynexus.broker.connection import Broker
from joynexus.ops.runtime.natsserver import EmbeddedNats
from joynexus.schemas import inference as iq
from joynexus.schemas.base import encode
from joynexus.schemas.errors import (
    InvalidMessage,
    InvalidSpec,
    JoyNexusError,
    PayloadTooLarge,
    PermissionDenied,
    ShapeMismatch,
    Unavailable,
    UnknownTenant,
)

pytestmark = pytest.mark.timeout(60)

ATOL = 1e-5
CAMS = ("front", "wrist")
HW = (56, 56)
SCHEMA = FeatureSchema(CAMS, HW, 8, 7, 8)
INSTR = ("pick up the red cube", "open the drawer", "push the block left", "stack the cups")
MODEL = "qwen2.5-vl-tiny"


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    return Backbone.build(BackboneConfig(size="tiny"))


def make_module(tenant: str, head_type: str = "oft_mlp", seed: int = 0, state_dim: int = 8) -> TenantModule:
    return TenantModule(tenant, head_type, HeadConfig(64, state_dim, 7, 8, seed=seed))


def make_obs(seed: int, b: int = 1, state_dim: int = 8) -> dict[str, Any]:
    g = np.random.default_rng(seed)
    return dict(
        images={s: g.integers(0, 256, (b, 3, *HW), dtype=np.uint8) for s in CAMS},
        instruction=[INSTR[(seed + i) % 4] + " now" * (i % 3) for i in range(b)],
        state=g.standard_normal((b, state_dim)).astype(np.float32),
    )


def expected(backbone: Backbone, module: TenantModule, obs: dict[str, Any], noise: Any = None,
             schema: FeatureSchema = SCHEMA) -> np.ndarray:
    """In-process serial reference: this request's rows alone through the backbone, then the head."""
    fb = canonicalize_request(schema, {k: torch.from_numpy(v) for k, v in obs["images"].items()},
                              obs["instruction"], obs["state"])
    n = None if noise is None else torch.from_numpy(noise)
    (a,) = serial_forward(backbone, [ActRequest(module, fb, n)])
    return a.numpy()


def raw_request(tenant: str, obs: dict[str, Any], schema: FeatureSchema = SCHEMA) -> bytes:
    """An encoded inference request as a tenant's SDK builds it (to send on any subject)."""
    return iq.encode_msgpack(iq.InferRequest(
        tenant_id=tenant, schema_signature=schema.signature(),
        observation=iq.Observation(images={k: iq.TensorBytes.from_array(v) for k, v in obs["images"].items()},
                                instruction=obs["instruction"],
                                state=iq.TensorBytes.from_array(obs["state"])),
    ))


@pytest.fixture
async def make_engine(broker: Broker, backbone: Backbone) -> AsyncIterator[Callable[..., Any]]:
    started: list[InferenceEngine] = []

    async def make(**kw: Any) -> InferenceEngine:
        kw.setdefault("max_batch", 8)
        kw.setdefault("max_wait_ms", 20)
        if isinstance(kw.get("backbone"), GatedBackbone):
            # Its forward blocks until the test opens the gate: on the forward thread, never
            # on the event loop (where a short forward of a measured size would run).
            kw.setdefault("inline_forward_ms", 0)
        e = InferenceEngine(broker, kw.pop("backbone", backbone), instance=f"e{len(started)}", **kw)
        started.append(e)
        await e.start()
        return e

    yield make
    for e in started:
        await e.close()


async def micro_instances(broker: Broker, verb: ServiceVerb = ServiceVerb.INFO, window_s: float = 0.3) -> list[dict[str, Any]]:
    """Every live instance of the inference service answering a $SRV request within the window."""
    inbox = broker.nc.new_inbox()
    sub = await broker.nc.subscribe(inbox)
    await broker.nc.publish(control_subject(verb, name=broker.names.inference_service), b"", reply=inbox)
    out = []
    deadline = time.monotonic() + window_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = await sub.next_msg(timeout=left)
        except Exception:
            break
        if msg.data:  # not the server's "no responders" status (no instance serves yet)
            out.append(json.loads(msg.data))
    await sub.unsubscribe()
    return out


async def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class GatedBackbone:
    """The real backbone (or a wrapper of it), whose forwards wait while ``gate`` is clear.

    An idle engine runs a request at once, so tests that want several requests in one
    batch first hold the engine busy in a forward, queue them, then open the gate."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _hold(self) -> None:
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise RuntimeError("gate never opened")

    def encode(self, batch: Any) -> torch.Tensor:
        self._hold()
        return self.inner.encode(batch)

    def encode_tokens(self, batch: Any, tokens: bool = True) -> Any:
        self._hold()
        return self.inner.encode_tokens(batch, tokens)


async def hold_busy(gated: GatedBackbone, client: InferenceClient, tenant: str,
                    schema: FeatureSchema = SCHEMA) -> asyncio.Future[Any]:
    """Send one request and keep the engine in its forward until ``gated.gate`` is set."""
    gated.gate.clear()
    gated.entered.clear()
    fut = asyncio.ensure_future(client.request(tenant, schema=schema, **make_obs(1000)))
    await wait_for(gated.entered.is_set, "the engine to be in a forward")
    return fut


async def queued(engine: InferenceEngine, n: int) -> None:
    await wait_for(lambda: len(engine._queue) >= n, f"{n} requests queued")


# -- policy store -----------------------------------------------------------------


async def test_policy_store_publishes_weights_then_record_and_keeps_versions(
    broker: Broker, tmp_path: Path
) -> None:
    store = PolicyStore(broker)
    with pytest.raises(UnknownTenant, match="no policy published for tenant 'acme'"):
        await store.latest("acme")
    m1, m2 = make_module("acme", seed=1), make_module("acme", seed=2)
    r1 = await store.publish("acme", "default", m1, SCHEMA)
    r2 = await store.publish("acme", "default", m2, SCHEMA)
    assert (r1.version, r2.version) == (1, 2)
    assert r2.object_name == broker.names.weights_object("acme", "default", 2)
    assert r2.schema_signature == SCHEMA.signature() and r2.head_type == "oft_mlp"
    assert (await store.latest("acme")).version == 2
    assert (await store.get("acme", "default", 1)) == r1
    assert [r.version for r in await store.history("acme")] == [1, 2]
    data = await store.load_weights(r1)
    assert len(data) == r1.size_bytes == len(weights_bytes(m1, version=1))
    # The stored object is what export_safetensors writes: the tenant can take it home.
    (tmp_path / "head.safetensors").write_bytes(data)
    exported = TenantModule.import_safetensors(tmp_path / "head.safetensors")
    loaded = await store.load_module(r1)
    assert loaded.version == exported.version == 1 and exported.head_type == "oft_mlp"
    for k, v in m1.head.state_dict().items():
        torch.testing.assert_close(loaded.head.state_dict()[k], v, atol=0, rtol=0)
        torch.testing.assert_close(exported.head.state_dict()[k], v, atol=0, rtol=0)
    with pytest.raises(iq.UnknownPolicyVersion, match="no version 9: the latest published is 2"):
        await store.get("acme", "default", 9)
    with pytest.raises(InvalidSpec, match="not above the latest"):
        await store.publish("acme", "default", m1, SCHEMA, version=2)
    with pytest.raises(InvalidSpec, match="state_dim"):
        await store.publish("acme", "default", make_module("acme", state_dim=5), SCHEMA)
    assert [r.tenant_id for r in await store.records()] == ["acme"]


# -- batching -------------------------------------------------------------------


async def test_grouped_through_engine_matches_serial_per_tenant(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    store = PolicyStore(broker)
    heads = ("oft_mlp", "flow_matching", "oft_mlp", "flow_matching")
    mods = {f"t{i}": make_module(f"t{i}", h, seed=i) for i, h in enumerate(heads)}
    for t, m in mods.items():
        await store.publish(t, "default", m, SCHEMA)
    # T is long and B equals the number of tenants: the four requests, queued while the
    # engine is busy, share one forward.
    gated = GatedBackbone(backbone)
    engine = await make_engine(backbone=gated, max_batch=4, max_wait_ms=5000)
    client = InferenceClient(broker)
    obs = {t: make_obs(i, b=2) for i, t in enumerate(mods)}
    noise = {t: np.random.default_rng(10 + i).standard_normal((2, 8, 7)).astype(np.float32)
             for i, t in enumerate(mods)}
    hold = await hold_busy(gated, client, "t0")
    calls = asyncio.gather(*(
        client.request(t, schema=SCHEMA, noise=noise[t] if mods[t].head_type == "flow_matching" else None, **obs[t])
        for t in mods
    ))
    await queued(engine, 4)
    gated.gate.set()
    replies = await calls
    await hold
    assert {r.batch.batch_id for r in replies} == {replies[0].batch.batch_id}
    assert all(r.batch.size == 4 and r.batch.rows == 8 and not r.batch.fallback for r in replies)
    for t, r in zip(mods, replies, strict=True):
        n = noise[t] if mods[t].head_type == "flow_matching" else None
        got = r.actions.to_array()
        assert got.shape == (2, 8, 7) and r.policy_version == 1
        np.testing.assert_allclose(got, expected(backbone, mods[t], obs[t], n), atol=ATOL, rtol=0)
    # The same tenant's request served alone (a batch of one) gives the same actions.
    alone = await client.request("t0", schema=SCHEMA, **obs["t0"])
    assert alone.batch.size == 1
    np.testing.assert_allclose(alone.actions.to_array(), replies[0].actions.to_array(), atol=ATOL, rtol=0)


async def test_batches_respect_max_batch_and_max_wait(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    """Requests that arrive while a batch runs form the next batches (at most B each);
    one left without company waits about T after its arrival, then is served alone."""
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    wait_ms = 150.0
    gated = GatedBackbone(backbone)
    engine = await make_engine(backbone=gated, max_batch=3, max_wait_ms=wait_ms)
    client = InferenceClient(broker)
    hold = await hold_busy(gated, client, "acme")
    calls = asyncio.gather(*(client.request("acme", schema=SCHEMA, **make_obs(i)) for i in range(7)))
    await queued(engine, 7)
    engine.stats.batch_sizes.clear()
    gated.gate.set()
    replies = await calls
    assert (await hold).batch.size == 1
    sizes = {r.batch.batch_id: r.batch.size for r in replies}
    assert max(sizes.values()) == 3 and sum(sizes.values()) == 7, sizes
    assert all(r.batch.size <= 3 for r in replies)
    assert list(engine.stats.batch_sizes) == [1, 3, 3, 1]  # the held one, then full ones first
    (last,) = [r for r in replies if r.batch.size == 1]
    assert wait_ms * 0.9 <= last.timings.queue_ms <= wait_ms + 250, last.timings


async def test_an_idle_engine_answers_a_lone_request_at_once(
    broker: Broker, make_engine: Callable[..., Any]
) -> None:
    """No waiting for company that is not coming: T bounds waits under load only."""
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    wait_ms = 500.0
    await make_engine(max_batch=8, max_wait_ms=wait_ms)
    client = InferenceClient(broker)
    await client.request("acme", schema=SCHEMA, **make_obs(0))  # warm
    for i in range(3):
        t0 = time.perf_counter()
        lone = await client.request("acme", schema=SCHEMA, **make_obs(i))
        took_ms = (time.perf_counter() - t0) * 1e3
        assert lone.batch.size == 1
        assert lone.timings.queue_ms < 50, lone.timings  # not ~500
        assert took_ms < wait_ms / 2, took_ms


def send_burst(url: str, namespace: str, subject: str, payloads: list[bytes],
               sent: threading.Event) -> list[Any]:
    """From a thread of its own (its own loop and connection): the requests in one
    write; ``sent`` is set once the server has them (a flush's PONG comes after it
    routed them); then their replies."""

    async def go() -> list[Any]:
        b = await Broker.connect(url, name="burst", namespace=namespace)
        nc = b.nc  # its inbox is the requester's own (the engine answers no other)
        try:
            calls = [asyncio.ensure_future(nc.request(subject, p, timeout=30)) for p in payloads]
            await asyncio.sleep(0)  # every request in the pending buffer: one write
            await nc.flush()
            sent.set()
            return list(await asyncio.gather(*calls))
        finally:
            await b.close()

    return asyncio.run(go())


async def test_a_burst_into_an_idle_engine_rides_one_batch(
    broker: Broker, nats_server: EmbeddedNats, namespace: str, make_engine: Callable[..., Any]
) -> None:
    """16 requests (~310 kB) that reached an idle engine's socket together ride one
    batch. asyncio reads at most 256 kB a turn, so the loop turns while turns bring
    requests before the batch is chosen; taking only the first read's 13 left 3 to wait
    a whole forward (the c32 bench's batches were mostly 13 and 6, not 16)."""
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    engine = await make_engine(max_batch=16, max_wait_ms=500)
    client = InferenceClient(broker)
    await client.request("acme", schema=SCHEMA, **make_obs(0))  # warm
    subject = broker.names.service_infer(MODEL, "acme")  # an agent's burst for acme
    payloads = [raw_request("acme", make_obs(i)) for i in range(16)]
    assert sum(map(len, payloads)) > 256 * 1024
    seen = []
    for _ in range(5):
        engine.stats.batch_sizes.clear()
        sent = threading.Event()
        burst = asyncio.ensure_future(
            asyncio.to_thread(send_burst, nats_server.url, namespace, subject, payloads, sent)
        )
        await asyncio.sleep(0)  # the thread starts
        # This loop (the engine's) held while the burst lands in the engine's socket.
        assert sent.wait(timeout=20)
        time.sleep(0.05)  # noqa: ASYNC251 - holding this loop is the point
        msgs = await burst
        replies = [iq.decode_msgpack(m.data, iq.InferResult) for m in msgs]
        seen.append(list(engine.stats.batch_sizes))
    # The first burst meets a fresh connection's small receive buffer (128 kB here), so the
    # server hands it over in pieces as the engine reads; once the kernel has grown it,
    # every burst is there at once. Without the turns: [[6, 10], [13, 3], [13, 3], ...].
    assert seen[1:] == [[16]] * 4, seen
    assert len({r.batch.batch_id for r in replies}) == 1
    assert all(r.timings.queue_ms < 100 for r in replies)  # none waited for company


class ThreadRecordingBackbone:
    """The real backbone; records the thread each forward ran on."""

    def __init__(self, inner: Backbone) -> None:
        self.inner = inner
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode_tokens(self, batch: Any, tokens: bool = True) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.inner.encode_tokens(batch, tokens)


async def test_short_forwards_run_on_the_loop_and_long_ones_on_the_forward_thread(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    """A batch of a size never measured runs on the forward thread; once its forwards are
    known to be short (median <= inline_forward_ms) it runs on the event loop, with the
    same actions; a limit below the measured time sends it back to the thread."""
    module = make_module("acme")
    await PolicyStore(broker).publish("acme", "default", module, SCHEMA)
    rec = ThreadRecordingBackbone(backbone)
    engine = await make_engine(backbone=rec, inline_forward_ms=60_000)
    client = InferenceClient(broker)
    loop_thread = threading.current_thread().name
    forward_thread = f"{engine.instance}-forward"
    for i in range(3):
        o = make_obs(i)
        r = await client.request("acme", schema=SCHEMA, **o)
        np.testing.assert_allclose(r.actions.to_array(), expected(backbone, module, o), atol=ATOL, rtol=0)
    assert rec.threads[0].startswith(forward_thread), rec.threads  # not measured yet
    assert rec.threads[1:] == [loop_thread, loop_thread], rec.threads
    assert engine.stats.inline_batches == 2
    # Two rows: another size, measured on the thread first.
    await client.request("acme", schema=SCHEMA, **make_obs(5, b=2))
    assert rec.threads[-1].startswith(forward_thread), rec.threads
    (one_row,) = [k for k in engine._forward_ms if k[1] == 1]  # (backbone key, rows' bit length)
    est = engine.forward_estimate_ms(one_row)
    assert est is not None and est > 0
    engine.inline_forward_ms = est / 2  # the same size is now "long"
    await client.request("acme", schema=SCHEMA, **make_obs(6))
    assert rec.threads[-1].startswith(forward_thread), rec.threads
    assert engine.stats.inline_batches == 2


async def test_tenants_take_turns_each_in_fifo_order(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    """An incompatible request (another backbone key) of one tenant does not block
    the others' batch, and each tenant's own requests keep their order."""
    store = PolicyStore(broker)
    small = FeatureSchema(("front",), (28, 28), 8, 7, 8)  # another backbone key: cannot share a forward
    await store.publish("a", "default", make_module("a"), SCHEMA)
    await store.publish("b", "default", make_module("b", seed=3), small)
    gated = GatedBackbone(backbone)
    engine = await make_engine(backbone=gated, max_batch=8, max_wait_ms=200)
    client = InferenceClient(broker)
    g = np.random.default_rng(0)
    obs_b = dict(images={"front": g.integers(0, 256, (1, 3, 28, 28), dtype=np.uint8)},
                 instruction="x", state=np.zeros((1, 8), np.float32))
    # Warm both tenants so admission is synchronous (strict arrival order).
    await asyncio.gather(client.request("a", schema=SCHEMA, **make_obs(0)),
                         client.request("b", schema=small, **obs_b))
    engine.stats.batch_sizes.clear()
    hold = await hold_busy(gated, client, "a")  # the four queue up behind a running batch
    reqs = [("a", SCHEMA, make_obs(1)), ("a", SCHEMA, make_obs(2)), ("b", small, obs_b), ("a", SCHEMA, make_obs(3))]
    tasks = []
    for t, s, o in reqs:  # issue in order; NATS keeps one connection's order
        tasks.append(asyncio.ensure_future(client.request(t, schema=s, **o)))
        await asyncio.sleep(0)
    await queued(engine, 4)
    gated.gate.set()
    replies = await asyncio.gather(*tasks)
    await hold
    a_ids = {replies[i].batch.batch_id for i in (0, 1, 3)}
    assert len(a_ids) == 1 and replies[0].batch.size == 3  # b's request did not split a's
    assert replies[2].batch.size == 1 and replies[2].batch.batch_id not in a_ids


async def test_a_flooding_tenant_does_not_starve_another(
    broker: Broker, make_engine: Callable[..., Any], backbone: Any
) -> None:
    """Tenant a queues 24 requests before tenant b asks once: b rides in the first
    batch formed after it arrived, not behind all of a's. (The engine is held in a
    forward while they queue, so when batches form all 25 are there: which batch b
    gets is the batcher's choice alone, not how fast the loop took them in.)"""
    store = PolicyStore(broker)
    await store.publish("a", "default", make_module("a"), SCHEMA)
    await store.publish("b", "default", make_module("b", seed=3), SCHEMA)
    gated = GatedBackbone(backbone)
    engine = await make_engine(backbone=gated, max_batch=4, max_wait_ms=50)
    client = InferenceClient(broker)
    await asyncio.gather(client.request("a", schema=SCHEMA, **make_obs(0)),
                         client.request("b", schema=SCHEMA, **make_obs(0)))
    hold = await hold_busy(gated, client, "a")
    flood = [asyncio.ensure_future(client.request("a", schema=SCHEMA, **make_obs(i)))
             for i in range(24)]
    await asyncio.sleep(0)
    victim_task = asyncio.ensure_future(client.request("b", schema=SCHEMA, **make_obs(99)))
    await queued(engine, 25)
    gated.gate.set()
    victim = await victim_task
    await hold
    a_batches = sorted({int(r.batch.batch_id.rsplit("-", 1)[-1]) for r in await asyncio.gather(*flood)})
    b_batch = int(victim.batch.batch_id.rsplit("-", 1)[-1])
    assert len(a_batches) >= 6  # a's 24 requests needed >= 6 batches of 4
    # b is served in the first batch formed after the gate opened, not after all six.
    assert b_batch == a_batches[0], (b_batch, a_batches)
    assert engine.stats.requests >= 28


# -- preparation ------------------------------------------------------------------


def test_batch_images_are_patchified_in_one_call_exactly_as_the_processor(backbone: Backbone) -> None:
    ip = backbone.image_processor
    x = torch.randint(0, 256, (6, 3, *HW), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pv, thw = backbone.process_images({"front": x[:3], "wrist": x[3:]}, CAMS)
    per_image = [x[i].numpy() for i in (0, 3, 1, 4, 2, 5)]  # sample-major, then camera
    ref = ip(images=per_image, do_resize=False, input_data_format="channels_first", return_tensors="pt")
    torch.testing.assert_close(pv, ref["pixel_values"], atol=0, rtol=0)
    torch.testing.assert_close(thw, ref["image_grid_thw"], atol=0, rtol=0)
    rows, grid = patchify(x, patch_size=ip.patch_size, temporal_patch_size=ip.temporal_patch_size,
                          merge_size=ip.merge_size, mean=ip.image_mean, std=ip.image_std)
    assert rows.shape == (6 * 16, 3 * 2 * 14 * 14) and grid.tolist() == [[1, 4, 4]] * 6
    with pytest.raises(ShapeMismatch, match="multiple of patch"):
        patchify(x[:, :, :50], patch_size=14, temporal_patch_size=2, merge_size=2, mean=ip.image_mean,
                 std=ip.image_std)


def test_each_distinct_instruction_is_tokenised_once(backbone: Backbone) -> None:
    calls: list[list[str]] = []

    def enc(texts: list[str]) -> list[list[int]]:
        calls.append(list(texts))
        return [[len(t)] for t in texts]

    cache = TokenCache(enc, maxsize=2)
    assert cache(["a", "bb", "a"]) == [[1], [2], [1]] and calls == [["a", "bb"]]  # one call, distinct texts
    assert cache(["bb", "a"]) == [[2], [1]] and len(calls) == 1
    cache(["ccc"])  # bounded: the least recently used ("bb") goes
    assert len(cache) == 2 and calls[-1] == ["ccc"]
    cache(["a"])
    assert len(calls) == 2
    cache(["bb"])
    assert calls[-1] == ["bb"]
    # The backbone's prompt ids are the tokenizer's, cached or not.
    texts = (INSTR[0], INSTR[1], INSTR[0])
    ids, lengths = backbone.tokenize(texts, 2)
    ids2, lengths2 = backbone.tokenize(texts, 2)
    torch.testing.assert_close(ids, ids2)
    torch.testing.assert_close(lengths, lengths2)
    raw = backbone.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    n_prefix = 1 + 2 * (backbone.tokens_per_image + 2)
    for row, want, n in zip(ids.tolist(), raw, lengths.tolist(), strict=True):
        assert row[n_prefix : n - 1] == want


def test_images_are_read_from_the_wire_without_copies() -> None:
    obs = make_obs(0, b=2)
    wire = iq.Observation(images={k: iq.TensorBytes.from_array(v) for k, v in obs["images"].items()},
                       instruction="x", state=iq.TensorBytes.from_array(obs["state"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not writable" warning either
        fb = canonical(SCHEMA, wire)
    for slot in CAMS:
        assert fb.images[slot].data_ptr() == np.frombuffer(wire.images[slot].data, np.uint8).ctypes.data
        np.testing.assert_array_equal(fb.images[slot].numpy(), obs["images"][slot])
    np.testing.assert_array_equal(fb.state_B_S.numpy(), obs["state"])
    assert fb.state_B_S.numpy().flags.writeable  # a head owns its (small) state


# -- versions -------------------------------------------------------------------


class GatedStore(PolicyStore):
    """Loads of versions >= ``gated_from`` wait for ``gate`` (to watch a load in progress)."""

    def __init__(self, broker: Broker, gated_from: int) -> None:
        super().__init__(broker)
        self.gate = asyncio.Event()
        self.gated_from = gated_from
        self.waiting = asyncio.Event()

    async def load_module(self, record: Any) -> TenantModule:
        if record.version >= self.gated_from:
            self.waiting.set()
            await self.gate.wait()
        return await super().load_module(record)


async def test_version_routing_and_new_version_loaded_before_served(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    store = PolicyStore(broker)
    v1, v2 = make_module("acme", seed=1), make_module("acme", seed=2)
    await store.publish("acme", "default", v1, SCHEMA)
    gated = GatedStore(broker, gated_from=2)
    engine = await make_engine(policies=gated, max_wait_ms=1)
    client = InferenceClient(broker)
    obs = make_obs(5)
    want1, want2 = expected(backbone, v1, obs), expected(backbone, v2, obs)
    assert np.abs(want1 - want2).max() > 1e-3  # the versions are distinguishable

    await store.publish("acme", "default", v2, SCHEMA)
    await asyncio.wait_for(gated.waiting.wait(), 10)  # the engine saw v2 and is loading it
    # While v2 loads, "latest" is still v1 on this engine: never a version without weights.
    r = await client.request("acme", schema=SCHEMA, **obs)
    assert r.policy_version == 1 and engine.latest_version("acme") == 1
    np.testing.assert_allclose(r.actions.to_array(), want1, atol=ATOL, rtol=0)
    gated.gate.set()
    await wait_for(lambda: engine.latest_version("acme") == 2, "v2 to become latest")
    assert 2 in engine.loaded_versions("acme")

    latest = await client.request("acme", schema=SCHEMA, **obs)
    pinned1 = await client.request("acme", schema=SCHEMA, policy_version=1, **obs)
    pinned2 = await client.request("acme", schema=SCHEMA, policy_version=2, **obs)
    assert (latest.policy_version, pinned1.policy_version, pinned2.policy_version) == (2, 1, 2)
    np.testing.assert_allclose(latest.actions.to_array(), want2, atol=ATOL, rtol=0)
    np.testing.assert_allclose(pinned1.actions.to_array(), want1, atol=ATOL, rtol=0)
    np.testing.assert_allclose(pinned2.actions.to_array(), want2, atol=ATOL, rtol=0)
    with pytest.raises(iq.UnknownPolicyVersion, match="no version 7"):
        await client.request("acme", schema=SCHEMA, policy_version=7, **obs)


async def test_a_policy_no_one_asked_for_is_loaded_at_its_first_request(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    """A workload created while the engine serves is not loaded until a request asks
    for it (its load's CPU is then its owner's request's, not every tenant's); once
    held, each new version is loaded as the watch announces it. A request for the
    latest never gets a version older than one announced."""
    store = PolicyStore(broker)
    engine = await make_engine(max_wait_ms=1)
    await store.publish("acme", "default", make_module("acme", seed=1), SCHEMA)
    await wait_for(lambda: ("acme", "default") in engine.cache._announced, "v1 announced")
    assert engine.loaded_versions("acme") == [] and engine.latest_version("acme") is None
    client = InferenceClient(broker)
    obs = make_obs(3)
    first = await client.request("acme", schema=SCHEMA, **obs)
    assert first.policy_version == 1 and engine.loaded_versions("acme") == [1]
    assert ("acme", "default") not in engine.cache._announced
    v2 = make_module("acme", seed=2)
    await store.publish("acme", "default", v2, SCHEMA)
    await wait_for(lambda: engine.latest_version("acme") == 2, "v2 loaded eagerly (held)")
    assert engine.loaded_versions("acme") == [1, 2]
    # The watch announced a version that is not resident (a load on demand raced it):
    # a request for the latest does not take the resident older one.
    engine.cache._announced[("acme", "default")] = 3
    assert engine.cache.lookup("acme", "default", None) is None
    assert engine.cache.lookup("acme", "default", 2) is not None  # a pinned one still is
    v3 = make_module("acme", seed=3)
    await store.publish("acme", "default", v3, SCHEMA)
    third = await client.request("acme", schema=SCHEMA, **obs)
    assert third.policy_version == 3
    np.testing.assert_allclose(third.actions.to_array(), expected(backbone, v3, obs), atol=ATOL, rtol=0)


def test_announced_versions_of_policies_not_held_are_bounded(monkeypatch: Any) -> None:
    """A tenant creating and cancelling workloads without end leaves each engine a
    note per workload it never served: at most ``MAX_ANNOUNCED``, the oldest forgotten."""
    from joynexus.agents.inference import policies

    monkeypatch.setattr(policies, "MAX_ANNOUNCED", 3)
    cache = policies.PolicyCache(None, None, base_model="m", retain_versions=2,  # type: ignore[arg-type]
                                 instance="i")
    for i in range(10):
        cache._announce(("mallory", f"w{i}"), 1)
    cache._announce(("mallory", "w8"), 2)  # announced again: now the newest
    assert list(cache._announced.items()) == [
        (("mallory", "w7"), 1), (("mallory", "w9"), 1), (("mallory", "w8"), 2)]


async def test_pinned_old_version_beyond_resident_window_is_loaded_on_demand(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    store = PolicyStore(broker)
    mods = [make_module("acme", seed=s) for s in range(4)]
    for m in mods:
        await store.publish("acme", "default", m, SCHEMA)
    engine = await make_engine(retain_versions=2, max_wait_ms=1)
    assert engine.loaded_versions("acme") == [4]
    client = InferenceClient(broker)
    obs = make_obs(1)
    for v in (1, 2, 3):
        r = await client.request("acme", schema=SCHEMA, policy_version=v, **obs)
        assert r.policy_version == v
        np.testing.assert_allclose(r.actions.to_array(), expected(backbone, mods[v - 1], obs), atol=ATOL, rtol=0)
    # The latest plus the most recently used other version stay resident.
    assert engine.loaded_versions("acme") == [3, 4]
    # The per-policy index is exactly what is resident, and no load is left counted.
    cache = engine.cache
    by_policy: dict[tuple[str, str], set[int]] = {}
    for t, w, v in cache._policies:
        by_policy.setdefault((t, w), set()).add(v)
    assert cache._versions == by_policy == {("acme", "default"): {3, 4}}
    assert not cache._loads and not cache._loading
    assert cache._held(("acme", "default")) and not cache._held(("acme", "other"))


async def test_full_queue_answers_unavailable_and_serves_the_rest(
    broker: Broker, make_engine: Callable[..., Any]
) -> None:
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    engine = await make_engine(max_batch=1, max_wait_ms=0, max_queue=2)
    client = InferenceClient(broker)
    out = await asyncio.gather(*(client.request("acme", schema=SCHEMA, **make_obs(i)) for i in range(24)),
                               return_exceptions=True)
    refused = [r for r in out if isinstance(r, Unavailable)]
    served = [r for r in out if isinstance(r, iq.InferResult)]
    assert len(refused) + len(served) == 24
    assert refused and engine.stats.rejected == len(refused)
    assert "requests queued; retry later or scale up" in str(refused[0])
    assert refused[0].permanent is False  # retryable by class


# -- errors ---------------------------------------------------------------------


async def test_bad_requests_get_clear_errors_while_batch_mates_are_served(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    store = PolicyStore(broker)
    ma, mb = make_module("a", seed=1), make_module("b", seed=2)
    await store.publish("a", "default", ma, SCHEMA)
    await store.publish("b", "default", mb, SCHEMA)
    gated = GatedBackbone(backbone)
    engine = await make_engine(backbone=gated, max_batch=16, max_wait_ms=300)
    client = InferenceClient(broker)
    oa, ob = make_obs(1), make_obs(2)
    nan = make_obs(3)
    nan["state"][0, 2] = np.nan
    wrong_shape = make_obs(4, state_dim=5)
    bad_img = make_obs(5)
    bad_img["images"]["front"] = bad_img["images"]["front"][:, :, :28]
    other_schema = FeatureSchema(CAMS, HW, 8, 7, 4)

    calls = {
        "good_a": client.request("a", schema=SCHEMA, **oa),
        "unknown_tenant": client.request("nobody", schema=SCHEMA, **make_obs(6)),
        "nan": client.request("a", schema=SCHEMA, **nan),
        "good_b": client.request("b", schema=SCHEMA, **ob),
        "wrong_state": client.request("b", schema=SCHEMA, **wrong_shape),
        "wrong_image": client.request("a", schema=SCHEMA, **bad_img),
        "schema": client.request("a", schema=other_schema, **make_obs(7)),
        "version": client.request("a", schema=SCHEMA, policy_version=3, **make_obs(8)),
        "slot": client.request("a", schema=SCHEMA, images={"front": oa["images"]["front"]},
                               instruction="x", state=oa["state"]),
    }
    hold = await hold_busy(gated, client, "a")
    gathered = asyncio.gather(*calls.values(), return_exceptions=True)
    await queued(engine, 2)
    gated.gate.set()
    out = dict(zip(calls, await gathered, strict=True))
    await hold
    assert isinstance(out["unknown_tenant"], UnknownTenant) and "nobody" in str(out["unknown_tenant"])
    assert isinstance(out["nan"], InvalidSpec) and "state contains 1 NaN/inf" in str(out["nan"])
    assert isinstance(out["wrong_state"], ShapeMismatch) and "state: expected [B, 8]" in str(out["wrong_state"])
    assert isinstance(out["wrong_image"], ShapeMismatch) and "images['front']" in str(out["wrong_image"])
    assert isinstance(out["schema"], iq.IncompatibleSchema) and "act=4x7" in str(out["schema"])
    assert isinstance(out["version"], iq.UnknownPolicyVersion)
    assert isinstance(out["slot"], InvalidSpec) and "missing ['wrist']" in str(out["slot"])
    ra, rb = out["good_a"], out["good_b"]
    assert isinstance(ra, iq.InferResult) and isinstance(rb, iq.InferResult)
    assert ra.batch.batch_id == rb.batch.batch_id and ra.batch.size == 2  # only the good ones batched
    np.testing.assert_allclose(ra.actions.to_array(), expected(backbone, ma, oa), atol=ATOL, rtol=0)
    np.testing.assert_allclose(rb.actions.to_array(), expected(backbone, mb, ob), atol=ATOL, rtol=0)
    assert engine.stats.errors == 7

    # Bytes that are not an inference request, and tensor bytes that do not fit their shape.
    msg = await broker.nc.request(broker.names.service_infer(MODEL, "a"), b"\x01garbage", timeout=5)
    err = iq.decode_msgpack(msg.data, iq.InferReply)
    assert isinstance(err, iq.InferError) and isinstance(err.to_exception(), InvalidMessage)
    assert msg.headers and msg.headers.get("Nats-Service-Error-Code") == "400"


async def security_events(broker: Broker, tenant: str, n: int = 1, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The first ``n`` security events of ``tenant``, read back from the metrics stream."""
    sub = await broker.js.subscribe(broker.names.metrics("security", tenant),
                                    stream=broker.names.metrics_stream, ordered_consumer=True)
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{len(out)} of {n} security event(s) of {tenant!r} within {timeout_s}s: {out}")
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:
                continue
            out.append(json.loads(msg.data))
    finally:
        await sub.unsubscribe()
    return out


async def test_payload_claiming_another_tenant_is_refused_and_reported(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    """A request on tenant a's subject whose payload claims tenant b: a PermissionDenied
    reply to it alone (b's policy never serves it), a security event for a, and the
    good requests of the same batch window are served as usual."""
    store = PolicyStore(broker)
    ma, mb = make_module("a", seed=1), make_module("b", seed=2)
    await store.publish("a", "default", ma, SCHEMA)
    await store.publish("b", "default", mb, SCHEMA)
    gated = GatedBackbone(backbone)
    engine = await make_engine(backbone=gated, max_batch=8, max_wait_ms=300)
    client = InferenceClient(broker)
    oa, ob, forged = make_obs(1), make_obs(2), make_obs(3)
    subject_a = broker.names.service_infer(MODEL, "a")

    hold = await hold_busy(gated, client, "a")
    calls = asyncio.gather(
        client.request("a", schema=SCHEMA, **oa),
        broker.nc.request(subject_a, raw_request("b", forged), timeout=5),
        client.request("b", schema=SCHEMA, **ob),
    )
    await queued(engine, 2)
    gated.gate.set()
    good_a, bad, good_b = await calls
    await hold
    reply = iq.decode_msgpack(bad.data, iq.InferReply)
    assert isinstance(reply, iq.InferError) and reply.code == "permission_denied"
    err = reply.to_exception()
    assert isinstance(err, PermissionDenied) and err.permanent
    assert subject_a in str(err) and "claims tenant 'b'" in str(err) and "tenant 'a'" in str(err)
    assert bad.headers and bad.headers.get("Nats-Service-Error-Code") == "403"
    # The batch-mates: one shared forward of the two good requests, each with its own head.
    assert isinstance(good_a, iq.InferResult) and isinstance(good_b, iq.InferResult)
    assert good_a.batch.batch_id == good_b.batch.batch_id and good_a.batch.size == 2
    np.testing.assert_allclose(good_a.actions.to_array(), expected(backbone, ma, oa), atol=ATOL, rtol=0)
    np.testing.assert_allclose(good_b.actions.to_array(), expected(backbone, mb, ob), atol=ATOL, rtol=0)
    assert engine.stats.errors == 1

    (event,) = await security_events(broker, "a")
    assert event["kind"] == "security" and event["tenant_id"] == "a"
    assert (event["action"], event["source"], event["target"]) == ("claim_tenant", "inference", subject_a)
    assert "claims tenant 'b'" in event["reason"] and "tenant 'a'" in event["reason"]

    # Through the client too: the error comes back as its class.
    with pytest.raises(PermissionDenied, match="claims tenant 'b'"):
        await client._once(MODEL, raw_request("b", forged), "a", 5)
    # A subject that names no tenant (a literal wildcard token) serves nobody.
    msg = await broker.nc.request(broker.names.service_infer(MODEL), raw_request("a", oa), timeout=5)
    nobody = iq.decode_msgpack(msg.data, iq.InferReply)
    assert isinstance(nobody, iq.InferError) and nobody.code == "permission_denied"
    assert "names no tenant" in nobody.message
    (event,) = await security_events(broker, "_")
    assert event["action"] == "claim_tenant" and event["target"] == broker.names.service_infer(MODEL)
    assert len(await security_events(broker, "a", n=2)) == 2
    # One event per refusal, each on the subject's tenant: b (whose policy was claimed) is not blamed.
    info = await broker.js.stream_info(broker.names.metrics_stream,
                                       subjects_filter=broker.names.metrics("security", "*"))
    assert info.state.subjects == {broker.names.metrics("security", "a"): 2,
                                   broker.names.metrics("security", "_"): 1}


async def test_agents_and_tenants_ask_on_subjects_of_their_own(
    broker: Broker, make_engine: Callable[..., Any], as_tenant: Callable[..., Any]
) -> None:
    """An agent asks for a tenant on ``isvc.<model>.<tenant>`` (only the service may
    publish there; its replies go to the agents' inboxes); a tenant on its own
    ``infer.<model>.<tenant>``, answered only in its own inboxes (issue 24)."""
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    await PolicyStore(broker).publish("bolt", "default", make_module("bolt", seed=4), SCHEMA)
    engine = await make_engine(max_wait_ms=1)
    seen: list[tuple[str, str]] = []

    async def spy(msg: Any) -> None:  # a plain subscriber (no queue group) sees every request
        seen.append((msg.subject, iq.decode_msgpack(msg.data, iq.InferRequest).tenant_id))

    subs = [await broker.nc.subscribe(broker.names.infer(MODEL), cb=spy),
            await broker.nc.subscribe(broker.names.service_infer(MODEL), cb=spy)]
    try:
        agent = InferenceClient(broker)
        r = await agent.request("acme", schema=SCHEMA, **make_obs(0))
        assert isinstance(r, iq.InferResult) and r.policy_version == 1
        await agent.request("bolt", schema=SCHEMA, **make_obs(1))
        ns = broker.names.namespace
        assert broker.names.service_infer(MODEL, "acme") == f"{ns}.isvc.qwen2_5-vl-tiny.acme"
        tenant = InferenceClient(await as_tenant("acme"), service=False)
        assert isinstance(await tenant.request("acme", schema=SCHEMA, **make_obs(2)), iq.InferResult)
        await broker.nc.flush()
        assert seen == [(broker.names.service_infer(MODEL, "acme"), "acme"),
                        (broker.names.service_infer(MODEL, "bolt"), "bolt"),
                        (broker.names.infer(MODEL, "acme"), "acme")]
        # On a tenant's subject, a reply asked for in the agents' inboxes is dropped.
        refused = engine.intake.rpc.refused
        with pytest.raises(TimeoutError):
            await broker.nc.request(broker.names.infer(MODEL, "acme"),
                                    raw_request("acme", make_obs(3)), timeout=1)
        assert engine.intake.rpc.refused == refused + 1
        # A tenant id that cannot be a subject token never reaches the wire.
        with pytest.raises(InvalidSpec, match=r"tenant 'a\.b' is not a valid name"):
            await agent.request("a.b", schema=SCHEMA, **make_obs(2))
        await broker.nc.flush()
        assert len(seen) == 4
    finally:
        for sub in subs:
            await sub.unsubscribe()


class FlakyBackbone:
    """The real backbone, except that any forward containing the instruction 'boom' fails."""

    def __init__(self, inner: Backbone) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, batch: Any) -> torch.Tensor:
        if "boom" in batch.instructions:
            raise RuntimeError("boom")
        return self.inner.encode(batch)

    def encode_tokens(self, batch: Any, tokens: bool = True) -> Any:
        if "boom" in batch.instructions:
            raise RuntimeError("boom")
        return self.inner.encode_tokens(batch, tokens)


async def test_failure_inside_a_batch_falls_back_per_request(
    broker: Broker, backbone: Backbone, make_engine: Callable[..., Any]
) -> None:
    store = PolicyStore(broker)
    ma = make_module("a", seed=1)
    await store.publish("a", "default", ma, SCHEMA)
    gated = GatedBackbone(FlakyBackbone(backbone))
    engine = await make_engine(backbone=gated, max_batch=3, max_wait_ms=2000)
    client = InferenceClient(broker)
    o1, o2 = make_obs(1), make_obs(2)
    boom = dict(make_obs(3), instruction=["boom"])
    hold = await hold_busy(gated, client, "a")
    calls = asyncio.gather(
        client.request("a", schema=SCHEMA, **o1),
        client.request("a", schema=SCHEMA, **boom),
        client.request("a", schema=SCHEMA, **o2),
        return_exceptions=True,
    )
    await queued(engine, 3)
    gated.gate.set()
    out = await calls
    await hold
    r1, bad, r2 = out
    assert isinstance(r1, iq.InferResult) and isinstance(r2, iq.InferResult)
    assert r1.batch.fallback and r1.batch.size == 3
    assert isinstance(bad, JoyNexusError) and "internal error" in str(bad)
    assert "boom" not in str(bad)  # no exception text reaches a tenant
    np.testing.assert_allclose(r1.actions.to_array(), expected(backbone, ma, o1), atol=ATOL, rtol=0)
    np.testing.assert_allclose(r2.actions.to_array(), expected(backbone, ma, o2), atol=ATOL, rtol=0)
    assert engine.stats.fallbacks == 1


async def test_no_engine_is_a_clear_unavailable(broker: Broker) -> None:
    with pytest.raises(Unavailable, match="no inference engine serves"):
        await InferenceClient(broker).request("a", schema=SCHEMA, timeout_s=2, **make_obs(0))


async def test_a_request_waits_for_an_engine_that_comes_back(
    broker: Broker, make_engine: Callable[..., Any]
) -> None:
    """With retry_for_s, a request made while no engine runs (one died, the health
    manager is restarting it) is answered once an engine joins."""
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    client = InferenceClient(broker, retry_for_s=20.0)
    pending = asyncio.ensure_future(client.request("acme", schema=SCHEMA, timeout_s=2, **make_obs(0)))
    await asyncio.sleep(0.5)
    assert not pending.done()
    await make_engine()
    reply = await asyncio.wait_for(pending, 20)
    assert reply.policy_version == 1


# -- the micro service, traces --------------------------------------------------


async def test_visible_as_micro_service_and_reply_continues_the_trace(
    broker: Broker, make_engine: Callable[..., Any]
) -> None:
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    engine = await make_engine()
    infos = await micro_instances(broker)
    assert len(infos) == 1
    info = infos[0]
    assert info["name"] == broker.names.inference_service
    assert info["metadata"]["instance"] == engine.instance
    ep, svc = info["endpoints"]
    # One endpoint for every tenant of the model: the tenant is the subject's last token;
    # the agents' requests for tenants on an endpoint of their own.
    assert ep["subject"] == f"{broker.names.namespace}.infer.qwen2_5-vl-tiny.*" == broker.names.infer(MODEL)
    assert svc["subject"] == broker.names.service_infer(MODEL)
    assert ep["queue_group"] == svc["queue_group"] == broker.names.inference_service

    o = dict(make_obs(0), instruction="go")
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    msg = await broker.nc.request(broker.names.service_infer(MODEL, "acme"), raw_request("acme", o), timeout=5,
                                  headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert isinstance(iq.decode_msgpack(msg.data, iq.InferReply), iq.InferResult)
    assert msg.headers is not None and msg.headers["traceparent"].split("-")[1] == trace_id


# -- elastic engines --------------------------------------------------------------


async def test_scale_down_mid_stream_loses_no_request(broker: Broker, backbone: Backbone) -> None:
    store = PolicyStore(broker)
    for i in range(3):
        await store.publish(f"t{i}", "default", make_module(f"t{i}", seed=i), SCHEMA)
    pool = EnginePool(broker, backbone, max_batch=4, max_wait_ms=10)
    try:
        await pool.scale_to(2)
        leaving = pool.engines[-1]
        client = InferenceClient(broker)
        tasks = [asyncio.ensure_future(client.request(f"t{i % 3}", schema=SCHEMA, **make_obs(i)))
                 for i in range(60)]
        await wait_for(lambda: leaving.stats.batches >= 1, "the leaving engine to be busy")
        assert leaving._inflight > 0 or leaving.stats.requests > 0
        gone = await pool.scale_down()
        assert gone is leaving and gone.state == "stopped" and len(pool) == 1
        replies = await asyncio.gather(*tasks)  # every request answered (none errors or times out)
        assert len(replies) == 60 and all(isinstance(r, iq.InferResult) for r in replies)
        served_by = {r.batch.instance for r in replies}
        assert served_by == {pool.engines[0].instance, leaving.instance}
        assert leaving.stats.requests == sum(r.batch.instance == leaving.instance for r in replies)
        after = await client.request("t0", schema=SCHEMA, **make_obs(0))
        assert after.batch.instance == pool.engines[0].instance
        assert len(await micro_instances(broker, ServiceVerb.PING)) == 1
    finally:
        await pool.close()


async def publish_unloadable(broker: Broker, store: PolicyStore, tenant: str) -> None:
    """The next version of ``tenant``'s policy, current, with weights that do not load
    (written by hand, object first as publish() does, so no engine sees good bytes)."""
    good = await store.latest(tenant)
    version = good.version + 1
    bad = msgspec.structs.replace(
        good, version=version, object_name=broker.names.weights_object(tenant, "default", version)
    )
    obj = await broker.js.object_store(broker.names.weights_store)
    await obj.put(bad.object_name, b"not safetensors")
    kv = await broker.js.key_value(broker.names.policy_bucket)
    await kv.put(broker.names.policy_record_key(tenant, "default"), encode(bad))


async def test_scale_up_loads_weights_before_joining_and_failure_rolls_back(
    broker: Broker, backbone: Backbone
) -> None:
    store = PolicyStore(broker)
    mods = {f"t{i}": make_module(f"t{i}", seed=i) for i in range(3)}
    for t, m in mods.items():
        await store.publish(t, "default", m, SCHEMA)
    pool = EnginePool(broker, backbone, max_batch=4, max_wait_ms=5)
    try:
        first = await pool.scale_up()
        await store.publish("t0", "default", make_module("t0", seed=10), SCHEMA)  # v2 of t0
        second = await pool.scale_up()
        # Joined with every tenant's current version already resident.
        assert {t: second.latest_version(t) for t in mods} == {"t0": 2, "t1": 1, "t2": 1}
        assert all(second.loaded_versions(t) for t in mods)
        await pool.scale_down()  # the newest (second) drains
        await pool.scale_down()  # first too: nobody serves now
        assert len(pool) == 0 and first.state == "stopped"
        third = await pool.scale_up()
        assert third.loaded_versions("t1") == [1]
        r = await InferenceClient(broker).request("t1", schema=SCHEMA, **make_obs(1))
        assert r.batch.instance == third.instance and r.policy_version == 1

        # A current version whose weights do not load: the scale-up fails and rolls back.
        await publish_unloadable(broker, store, "t2")
        with pytest.raises(InvalidSpec, match="do not load"):
            await pool.scale_up()
        assert pool.engines == [third]
        assert [i["metadata"]["instance"] for i in await micro_instances(broker)] == [third.instance]
        # The running engine keeps serving (t2 at its last good version).
        r2 = await InferenceClient(broker).request("t2", schema=SCHEMA, **make_obs(2))
        assert r2.policy_version == 1 and third.latest_version("t2") == 1
    finally:
        await pool.close()


async def test_concurrent_scale_operations_are_serialized(broker: Broker, backbone: Backbone) -> None:
    await PolicyStore(broker).publish("a", "default", make_module("a"), SCHEMA)
    pool = EnginePool(broker, backbone)
    try:
        await asyncio.gather(pool.scale_up(), pool.scale_up(), pool.scale_up())
        assert len(pool) == 3 and len({e.instance for e in pool.engines}) == 3
        await asyncio.gather(pool.scale_down(), pool.scale_up(), pool.scale_down())
        assert len(pool) == 2 and all(e.state == "serving" for e in pool.engines)
        assert len(await micro_instances(broker, ServiceVerb.PING)) == 2
    finally:
        await pool.close()


def test_serving_threads_leave_the_event_loop_a_core() -> None:
    assert serving_threads(environ={}, cores=2) == 1
    assert serving_threads(environ={}, cores=8) == 7
    assert serving_threads(environ={}, cores=1) == 1
    assert serving_threads(environ={THREADS_ENV: " 3 "}, cores=8) == 3
    assert serving_threads(2, environ={THREADS_ENV: "5"}, cores=8) == 2  # given beats the environment
    with pytest.raises(InvalidSpec, match=r"JOYNEXUS_INFER_THREADS='many'"):
        serving_threads(environ={THREADS_ENV: "many"})
    for bad in (0, -1):
        with pytest.raises(InvalidSpec, match=">= 1"):
            serving_threads(bad, environ={})
    with pytest.raises(InvalidSpec, match=">= 1"):
        serving_threads(environ={THREADS_ENV: "0"})


async def test_the_inference_agent_forwards_with_the_serving_threads(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`joynexus agent inference` sets torch's threads on its event loop's thread (where
    short forwards run) before it serves, and answers with them."""
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    monkeypatch.setenv(THREADS_ENV, str(want))
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    stop = asyncio.Event()
    agent = asyncio.create_task(run_inference_agent(broker, stop, instance="threads"))
    try:
        deadline = time.monotonic() + 30
        while not agent.done() and not await micro_instances(broker, ServiceVerb.PING):
            assert time.monotonic() < deadline, "the agent's engine never joined"
        reply = await InferenceClient(broker).request("acme", schema=SCHEMA, **make_obs(1))
        assert reply.actions.to_array("actions").shape[0] == 1
        assert torch.get_num_threads() == want and not agent.done()
    finally:
        stop.set()
        await agent
        torch.set_num_threads(before)


async def test_policy_watch_is_ready_only_after_every_current_record(
    broker: Broker, early_kv_marker: list[int]
) -> None:
    """nats-py's end-of-current-values marker comes first (nats.py#842, forced here):
    the policy watch still sets ``ready`` only once every tenant's current record
    has been handed on, and ``records()`` lists them all."""
    store = PolicyStore(broker)
    for i in range(5):
        await store.publish(f"t{i}", "default", make_module(f"t{i}", seed=i), SCHEMA)
    ready = asyncio.Event()
    before_ready = []
    async for rec in store.watch(ready=ready, follow=False):
        if not ready.is_set():
            before_ready.append(rec.tenant_id)
    assert ready.is_set() and sorted(before_ready) == [f"t{i}" for i in range(5)]
    assert sorted(r.tenant_id for r in await store.records()) == [f"t{i}" for i in range(5)]
    assert len(early_kv_marker) == 2 and all(n >= 0 for n in early_kv_marker)


async def test_a_current_version_that_does_not_load_fails_the_scale_up_whatever_the_marker_does(
    broker: Broker, backbone: Backbone, early_kv_marker: list[int]
) -> None:
    """The CI failure of test_scale_up_loads_weights_before_joining_and_failure_rolls_back:
    with nats-py's marker ahead of the records, the engine took itself as loaded, the
    bad current version's failure was only logged, and it joined."""
    store = PolicyStore(broker)
    await store.publish("t1", "default", make_module("t1", seed=1), SCHEMA)
    await publish_unloadable(broker, store, "t1")
    pool = EnginePool(broker, backbone, max_batch=4, max_wait_ms=5)
    try:
        with pytest.raises(InvalidSpec, match="do not load"):
            await pool.scale_up()
        assert pool.engines == [] and early_kv_marker
        assert await micro_instances(broker) == []
    finally:
        await pool.close()


async def test_an_engine_that_joined_answers_the_first_request_from_another_connection(
    broker: Broker, backbone: Backbone, nats_server: EmbeddedNats
) -> None:
    """``join()`` returns once the server has the engine's subscriptions (``settle``):
    nats-py's ``flush()`` alone writes its PING ahead of the SUBs still in its buffer.
    A bare micro service asked at once from another connection found no responders in
    4 of 300 tries with one flush, none with ``settle``; this loop did not catch the
    one-flush engine in 75 joins, so it guards the behaviour, not that race."""
    await PolicyStore(broker).publish("acme", "default", make_module("acme"), SCHEMA)
    other = await Broker.connect(nats_server.url, name="asker", namespace=broker.names.namespace)
    pool = EnginePool(broker, backbone, max_batch=4, max_wait_ms=5)
    try:
        client = InferenceClient(other)
        for _ in range(25):  # join, ask at once, leave: nobody serves in between
            engine = await pool.scale_up()
            r = await client.request("acme", schema=SCHEMA, **make_obs(0))
            assert r.batch.instance == engine.instance
            await pool.scale_down()
            assert len(pool) == 0
    finally:
        await pool.close()
        await other.close()


async def test_a_large_request_runs_in_parts_that_take_turns_with_other_tenants(
    broker: Broker, make_engine: Callable[..., Any], backbone: Any
) -> None:
    """A request of more rows than the engine's ``max_rows`` runs as parts of at most
    half that many (``part_rows``: no forward is larger than ``max_rows``), answered once with every row's actions, equal to
    what it gets served whole; another tenant's 1-row request queued behind it runs
    right after the first part (in a batch of its own: while two tenants send, a batch
    holds at most a part's rows), not after all of them (issue 24)."""
    store = PolicyStore(broker)
    await store.publish("a", "default", make_module("a", "flow_matching"), SCHEMA)
    await store.publish("b", "default", make_module("b", seed=3), SCHEMA)
    gated = GatedBackbone(backbone)
    engine = await make_engine(backbone=gated, max_batch=8, max_rows=4, max_wait_ms=5)
    client = InferenceClient(broker)
    big = make_obs(7, b=10)
    noise = np.random.default_rng(5).standard_normal((10, 8, 7)).astype(np.float32)
    hold = await hold_busy(gated, client, "b")
    whole_task = asyncio.ensure_future(client.request("a", schema=SCHEMA, noise=noise, **big))
    await queued(engine, 5)  # 10 rows: five parts of 2
    victim_task = asyncio.ensure_future(client.request("b", schema=SCHEMA, **make_obs(99)))
    await queued(engine, 6)
    gated.gate.set()
    whole, victim = await whole_task, await victim_task
    await hold
    got = whole.actions.to_array()
    assert got.shape == (10, 8, 7)
    np.testing.assert_allclose(got, expected(backbone, engine.cache.lookup("a", "default", None)
                                             .module, big, noise), atol=ATOL, rtol=0)
    assert max(engine.stats.batch_sizes) <= 2 and engine.stats.rows <= 10 + 2
    # b's request ran right after a's first part (alone: two tenants share, so a batch
    # holds at most 2 rows): it did not wait for a's five parts; a's answer came with
    # its last part's batch.
    b_batch = int(victim.batch.batch_id.rsplit("-", 1)[-1])
    a_last = int(whole.batch.batch_id.rsplit("-", 1)[-1])
    assert b_batch < a_last, (b_batch, a_last)
    assert victim.batch.rows == 1, victim.batch
    assert whole.batch.rows <= 4
    # Served whole (an engine whose batches hold all 10 rows): the same actions.
    await engine.close()
    wide = await make_engine(max_rows=64)
    alone = await client.request("a", schema=SCHEMA, noise=noise, **big)
    assert alone.batch.rows == 10 and wide.stats.batches >= 1
    np.testing.assert_allclose(alone.actions.to_array(), got, atol=ATOL, rtol=0)


async def test_a_batch_over_the_message_limit_is_asked_in_halves_on_one_version(
    broker: Broker, make_engine: Callable[..., Any], backbone: Any
) -> None:
    """An ``act`` whose request is over the server's ``max_payload`` goes in halves of
    its rows (each under the limit), the halves after the first pinned to the version
    that served it; the actions are every row's, in order, equal to the rows served alone."""
    store = PolicyStore(broker)
    module = make_module("acme", "flow_matching", seed=4)
    await store.publish("acme", "default", module, SCHEMA)
    await make_engine(max_wait_ms=1)
    sent: list[iq.InferRequest] = []
    client = InferenceClient(broker, fast=False)

    async def spying(subject: str, payload: bytes, *, timeout: float, headers: Any) -> Any:  # noqa: ASYNC109
        if len(payload) <= broker.max_payload:  # what the server would take
            sent.append(iq.decode_msgpack(payload, iq.InferRequest))
        return await broker.nc.request(subject, payload, timeout=timeout, headers=headers)

    client._request = spying
    rows = broker.max_payload // (len(CAMS) * 3 * HW[0] * HW[1]) + 8  # just over the limit
    obs = make_obs(11, b=rows)
    noise = np.random.default_rng(6).standard_normal((rows, 8, 7)).astype(np.float32)
    got = await client.act("acme", schema=SCHEMA, noise=noise, **obs)
    assert got.shape == (rows, 8, 7)
    np.testing.assert_allclose(got, expected(backbone, module, obs, noise), atol=ATOL, rtol=0)
    assert [len(r.observation.instruction) for r in sent] == [rows // 2, rows - rows // 2]
    assert [r.policy_version for r in sent] == [None, 1]
    # One row over the limit has nothing to split: the caller is told.
    one = make_obs(12)
    one["images"] = {s: np.zeros((1, 3, 1024, 1024), np.uint8) for s in CAMS}
    with pytest.raises(PayloadTooLarge, match="fewer rows"):
        await client.act("acme", schema=SCHEMA, **one)
