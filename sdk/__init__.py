"""The JoyNexus tenant SDK: the whole public surface is listed in ``__all__`` (pinned by
tests/agents/test_sdk_surface.py).

A tenant reaches the service only through the control plane and the Inference
Queue, under its own credentials; calls return futures to await, and
``sdk.sync`` is the blocking facade for scripts::

    async with await Client.connect(credentials="acme.json") as client:  # from `joynexus tenant add`
        wl = await client.create_workload(WorkloadSpec(name="pick", task_type="sft",
                                                       dataset="pick"))  # in acme's dataset space
        async for event in wl.events():
            print(event.job.state)

See README.md and docs/ARCHITECTURE.md, "Workloads, from the SDK to a new policy version".
"""

from joynexus.schemas.errors import (
    Conflict,
    IllegalTransition,
    IncompatibleSchema,
    InvalidMessage,
    InvalidSpec,
    JoyNexusError,
    PermissionDenied,
    Unavailable,
    UnknownJob,
    UnknownPolicyVersion,
    UnknownTenant,
)
from joynexus.schemas.jobs import JobEvent, JobState, TrainingJob
from joynexus.schemas.workloads import Scheduling, WorkloadRecord, WorkloadSpec
from joynexus.sdk.client import Client, Credentials, Workload
from joynexus.sdk.sync import SyncClient

__all__ = [
    "Client",
    "Conflict",
    "Credentials",
    "IllegalTransition",
    "IncompatibleSchema",
    "InvalidMessage",
    "InvalidSpec",
    "JobEvent",
    "JobState",
    "JoyNexusError",
    "PermissionDenied",
    "Scheduling",
    "SyncClient",
    "TrainingJob",
    "Unavailable",
    "UnknownJob",
    "UnknownPolicyVersion",
    "UnknownTenant",
    "Workload",
    "WorkloadRecord",
    "WorkloadSpec",
]
