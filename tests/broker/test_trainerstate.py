"""Trainer checkpoints in JetStream: the KV record is the commit point, CAS fences a
deposed writer, a torn or lost object is refused, superseded objects are swept."""

from __future__ import annotations

import os

import pytest

from joynexus.broker.connection import Broker
from joynexus.broker.layout import delete_layout, ensure_layout
from joynexus.broker.trainerstate import TrainerStateStore
from joynexus.schemas.errors import Conflict, InvalidSpec, Unavailable


@pytest.fixture
async def broker(nats_server):  # type: ignore[no-untyped-def]
    b = await Broker.connect(nats_server.url, name="trainerstate-test", namespace=f"ts{os.urandom(3).hex()}")
    await ensure_layout(b)
    yield b
    await delete_layout(b)
    await b.close()


async def test_save_then_load_from_another_connection(broker: Broker, nats_server) -> None:  # type: ignore[no-untyped-def]
    a = TrainerStateStore(broker, instance="actor-host-a")
    assert await a.load("acme", "pick") is None
    blob = os.urandom(300_000)  # several object-store chunks
    rev = await a.save("acme", "pick", version=1, data=blob, expected_revision=None,
                       jobs_applied=1, last_job="j1")
    # "Another host": its own connection, no shared memory or disk.
    other = await Broker.connect(nats_server.url, name="host-b", namespace=broker.names.namespace)
    try:
        got = await TrainerStateStore(other, instance="actor-host-b").load("acme", "pick")
    finally:
        await other.close()
    assert got is not None and got.data == blob and got.revision == rev
    assert got.record.version == 1 and got.record.last_job == "j1"
    assert got.record.written_by == "actor-host-a"


async def test_a_deposed_writer_cannot_overwrite_newer_state(broker: Broker) -> None:
    a = TrainerStateStore(broker, instance="a")
    b = TrainerStateStore(broker, instance="b")
    r1 = await a.save("acme", "pick", version=1, data=b"v1", expected_revision=None)
    # b takes over: loads, trains, commits v2
    loaded = await b.load("acme", "pick")
    assert loaded is not None
    await b.save("acme", "pick", version=2, data=b"v2", expected_revision=loaded.revision)
    # a still believes r1 is the latest: its commit is refused, v2 stays in force
    with pytest.raises(Conflict, match="another actor"):
        await a.save("acme", "pick", version=2, data=b"a's v2", expected_revision=r1)
    with pytest.raises(Conflict):
        await a.save("acme", "pick", version=1, data=b"again", expected_revision=None)
    now = await a.load("acme", "pick")
    assert now is not None and now.data == b"v2" and now.record.written_by == "b"
    # the refused writers' objects were removed; one object per policy stays
    assert len(await a.objects("acme", "pick")) == 1


async def test_superseded_and_leftover_objects_are_swept(broker: Broker) -> None:
    s = TrainerStateStore(broker, instance="a")
    obj = await broker.js.object_store(broker.names.checkpoints_store)
    await obj.put("acme/pick/v0-crashed.ckpt", b"left by a crash before its commit")
    rev = None
    for v in range(1, 4):
        rev = await s.save("acme", "pick", version=v, data=f"v{v}".encode(), expected_revision=rev)
    [name] = await s.objects("acme", "pick")
    assert name.startswith("acme/pick/v3-")
    # other tenants' and policies' objects are not touched by acme's sweep
    await TrainerStateStore(broker).save("bolt", "pick", version=1, data=b"b", expected_revision=None)
    await TrainerStateStore(broker).save("acme", "push", version=1, data=b"p", expected_revision=None)
    await TrainerStateStore(broker).save("acme", "pick", version=4, data=b"v4", expected_revision=rev)
    assert len(await s.objects("bolt", "pick")) == 1 and len(await s.objects("acme", "push")) == 1


async def test_a_record_whose_object_does_not_match_is_refused(broker: Broker) -> None:
    s = TrainerStateStore(broker)
    await s.save("acme", "pick", version=1, data=b"good bytes", expected_revision=None)
    loaded = await s.load("acme", "pick")
    assert loaded is not None
    obj = await broker.js.object_store(broker.names.checkpoints_store)
    await obj.put(loaded.record.object_name, b"torn")  # same name, other bytes
    with pytest.raises(Unavailable, match="does not match its record"):
        await s.load("acme", "pick")
    await obj.delete(loaded.record.object_name)
    with pytest.raises(Unavailable, match="missing"):
        await s.load("acme", "pick")


async def test_names_are_checked(broker: Broker) -> None:
    s = TrainerStateStore(broker)
    for bad in ("a.b", "*", ">", "", "x y"):
        with pytest.raises(InvalidSpec):
            await s.save(bad, "pick", version=1, data=b"x", expected_revision=None)
        with pytest.raises(InvalidSpec):
            await s.load("acme", bad)
