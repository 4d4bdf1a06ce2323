"""The SDK's public surface is small and explicit, and needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import joynexus.sdk as sdk
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.workloads import Scheduling, WorkloadSpec

#: The SDK's public names, pinned: changing the surface means changing them here too.
PUBLIC = frozenset(
    "Client Conflict Credentials IllegalTransition IncompatibleSchema InvalidMessage InvalidSpec "
    "JobEvent JobState JoyNexusError PermissionDenied Scheduling SyncClient TrainingJob Unavailable "
    "UnknownJob UnknownPolicyVersion UnknownTenant Workload WorkloadRecord WorkloadSpec".split()
)


def test_public_surface_is_pinned() -> None:
    assert set(sdk.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(sdk, name) is not None


def test_sdk_imports_without_torch() -> None:
    code = "import sys, joynexus.sdk; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"name": "Bad Name", "task_type": "sft", "dataset": "/d"},
            "workload name 'Bad Name' is not a valid name",
        ),
        ({"name": "a", "task_type": "rl", "env": "AntMaze"}, "needs env set to one of"),
        ({"name": "a", "task_type": "sft"}, "needs dataset"),
        (
            {"name": "a", "task_type": "sft", "dataset": "/d", "action_module": "gpt"},
            "action_module 'gpt' is unknown",
        ),
        (
            {"name": "a", "task_type": "sft", "dataset": "/d", "base_model": "llama"},
            "base_model 'llama' is not hosted",
        ),
        ({"name": "a", "task_type": "train", "dataset": "/d"}, "task_type 'train' is not one of"),
        (
            {"name": "a", "task_type": "sft", "dataset": "/d", "learning_rate": 3.0},
            "learning_rate must be in",
        ),
    ],
)
def test_invalid_specs_say_what_is_wrong(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        WorkloadSpec(**kwargs)


def test_invalid_scheduling_says_which_field() -> None:
    with pytest.raises(InvalidSpec, match=r"scheduling\.max_in_flight must be >= 1"):
        Scheduling(max_in_flight=0)


def test_sync_facade_covers_every_future_method() -> None:
    from joynexus.sdk.sync import FUTURE_METHODS

    assert FUTURE_METHODS <= set(dir(sdk.Client))
    assert not {"close", "events", "connect"} & FUTURE_METHODS


async def test_sync_client_blocks_on_futures_and_raises_typed_errors(broker, tmp_path) -> None:
    import asyncio

    from joynexus.agents.control import ControlPlane
    from joynexus.agents.producers import PolicyInitializer
    from joynexus.agents.scheduler import SchedulerAgent

    sched = SchedulerAgent(broker)
    await sched.start()
    control = ControlPlane(
        broker, init_policy=PolicyInitializer(broker), datasets_root=tmp_path / "datasets"
    )
    await control.start()
    url = broker.nc.connected_url.netloc

    def use_sync() -> tuple[list, str]:
        with sdk.SyncClient.connect(f"nats://{url}", tenant="acme", namespace=broker.names.namespace) as c:
            listed = c.list_workloads().result(10)
            try:
                c.create_workload(
                    sdk.WorkloadSpec(name="demo", task_type="sft", dataset=str(tmp_path))
                ).result(30)
            except sdk.InvalidSpec as e:
                return listed, str(e)
        return listed, ""

    try:
        listed, err = await asyncio.to_thread(use_sync)
        assert listed == [] and "tenant 'acme' has no dataset" in err
    finally:
        await control.stop()
        await sched.stop()
