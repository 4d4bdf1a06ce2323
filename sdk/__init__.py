"""The JoyNexus tenant SDK: the whole public surface is listed in ``__all__``.

async with await Client.connect(credentials="acme.json") as client:  # from `joynexus tenant add`
    wl = await client.create_workload(WorkloadSpec(name="pick", task_type="sft",
                                                   dataset="/data/acme_pick"))
    async for event in wl.events():
        print(event.job.state)
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
