"""The control plane's verbs, in one table: the tenant API (``<ns>.api.<tenant>.<verb>``)
and the operator API (``<ns>.admin.<verb>``).

The control plane dispatches by this table and the SDK sends only what it lists,
each verb with its request type, so the two cannot drift apart. See
docs/ARCHITECTURE.md ("Request/reply: one layer").
"""

from __future__ import annotations

from typing import Any

from joynexus.schemas import training as t
from joynexus.schemas import workloads as w
from joynexus.schemas.apikeys import KEY_VERBS
from joynexus.schemas.base import Wire


class UsageQuery(Wire, kw_only=True, omit_defaults=True):
    """The ``usage`` verb's request: figures since this time (epoch seconds, 0: all)."""

    since: float = 0.0


#: The tenant API: verb -> request type.
VERBS: dict[str, type[Any]] = {
    "create_workload": w.CreateWorkload,
    "get_workload": w.NamedWorkload,
    "list_workloads": w.NamedWorkload,
    "cancel_workload": w.NamedWorkload,
    "open_job": w.OpenJob,
    "close_job": w.CloseJob,
    "abort_job": w.CloseJob,
    "read_events": w.ReadEvents,
    "put_data": w.PutData,
    "get_policy": w.PolicyQuery,
    "get_video": w.VideoQuery,
    "usage": UsageQuery,
    # The training client (schemas/training.py): a call becomes a job; its result.
    "train_call": t.TrainCall,
    "train_result": t.TrainResultQuery,
}

#: The operator API's verbs (each takes a ``TenantRequest``; the key verbs a ``KeyRequest``).
ADMIN_VERBS = ("tenant_add", "tenant_set", "tenant_remove", "tenant_list", *KEY_VERBS)

#: Verbs whose body carries data (rows, a spec); every other request is small.
BIG_VERBS = frozenset({"put_data", "create_workload"})

#: What a verb costs of its tenant's working slots on the control plane (others: 1):
#: those that read or write megabytes (weights, videos, rows) or build a policy take
#: all of a tenant's default slots, so a tenant's expensive calls run one at a time.
VERB_COST: dict[str, int] = {"get_policy": 2, "get_video": 2, "put_data": 2,
                             "create_workload": 2}
