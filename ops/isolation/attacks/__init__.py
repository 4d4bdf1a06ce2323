"""The attack catalogue: one module per family, and their order.

Each attack runs as tenant ``acme`` against ``bolt`` and checks its own effect
precisely where it would show (the job stream was not purged, bolt's record
still decodes, the consumer count stayed bounded...); :data:`CATALOGUE` names
each by the class of the issue it belongs to. The adversarial suite
(``tests/system/test_adversarial.py``) and ``joynexus bench isolation`` both run this
list. See docs/ARCHITECTURE.md ("Tenants fenced by the broker").
"""

from __future__ import annotations

from joynexus.ops.isolation.attacks.data import (
    attack_foreign_dataset,
    attack_nan_batch,
    attack_nan_in_step,
)
from joynexus.ops.isolation.attacks.floods import (
    attack_long_strings,
    attack_open_loop_flood,
    attack_request_flood,
)
from joynexus.ops.isolation.attacks.gateway import (
    attack_gateway_connections,
    attack_gateway_frames,
    attack_gateway_keys,
    attack_gateway_never_reads,
)
from joynexus.ops.isolation.attacks.identities import (
    attack_bad_identity_record,
    attack_failed_logins,
)
from joynexus.ops.isolation.attacks.inputs import (
    HOSTILE_BODIES,
    attack_hostile_bodies,
    attack_non_finite_wait,
)
from joynexus.ops.isolation.attacks.limits import (
    attack_bad_seed,
    attack_connections,
    attack_event_position,
    attack_service_inbox_reply,
)
from joynexus.ops.isolation.attacks.primitives import attack_training_client_fields
from joynexus.ops.isolation.attacks.quotas import attack_quotas
from joynexus.ops.isolation.attacks.shares import (
    attack_control_reads,
    attack_inference_in_flight,
    attack_inference_rows,
    attack_periodic_evals,
)
from joynexus.ops.isolation.attacks.subjects import (
    attack_reply_subject,
    attack_service_reads_admin_inbox,
)
from joynexus.ops.isolation.kit import Attack

CATALOGUE: list[Attack] = [
    Attack("request_flood", attack_request_flood, "3: per-call server resources", 120),
    Attack("open_loop_flood", attack_open_loop_flood,
           "24: a flood that never reads its replies (the penalty box)", 120),
    Attack("nan_batch", attack_nan_batch, "4: a bad batch takes the actor down", 60),
    Attack("nan_in_step", attack_nan_in_step, "4: a bad batch takes the actor down", 60,
           in_process=True),
    Attack("foreign_dataset", attack_foreign_dataset, "5: reads other tenants' files", 90),
    Attack("quotas", attack_quotas, "6: no quotas, no operator bounds", 150),
    Attack("long_strings", attack_long_strings, "7: unbounded strings", 60),
    Attack("inference_rows", attack_inference_rows, "24: an inference flood within quota", 90),
    Attack("inference_in_flight", attack_inference_in_flight,
           "24: an inference flood within quota", 120),
    Attack("control_reads", attack_control_reads, "24: a control-plane flood within quota", 90),
    Attack("periodic_evals", attack_periodic_evals, "24: periodic evaluations escape quotas",
           180),
    Attack("failed_logins", attack_failed_logins, "7: failed logins filed as the victim's", 60),
    Attack("service_reads_admin_inbox", attack_service_reads_admin_inbox,
           "7: the service reads the operator's replies", 30),
    Attack("non_finite_wait", attack_non_finite_wait, "7: a non-finite wait_s parks", 60),
    Attack("hostile_bodies", attack_hostile_bodies, "7: internal errors on hostile input", 60),
    Attack("bad_identity_record", attack_bad_identity_record, "2: revocation stops silently", 60),
    Attack("connections", attack_connections, "24: connections past the tenant's cap", 90),
    Attack("service_inbox_reply", attack_service_inbox_reply,
           "24: replies into the service's inbox space", 30),
    Attack("event_position", attack_event_position, "24: the job stream's position leaks", 30),
    Attack("bad_seed", attack_bad_seed, "24: a spec accepted that later breaks", 30),
    Attack("training_client_fields", attack_training_client_fields,
           "28: hostile training-client epochs, row offsets and evaluation policies", 90),
    Attack("gateway_keys", attack_gateway_keys, "27: gateway keys and scopes", 90),
    Attack("gateway_frames", attack_gateway_frames, "27: hostile gateway frames", 120),
    Attack("gateway_never_reads", attack_gateway_never_reads,
           "27: a gateway client that never reads", 200),
    Attack("gateway_connections", attack_gateway_connections,
           "27: 1,000 gateway connections from one tenant", 150),
    # Last: when it does not hold it purges the job log and deletes streams.
    Attack("reply_subject", attack_reply_subject, "1: replies to any subject", 60),
]
BY_NAME = {a.name: a for a in CATALOGUE}

__all__ = [
    "BY_NAME",
    "CATALOGUE",
    "HOSTILE_BODIES",
    "attack_bad_identity_record",
    "attack_bad_seed",
    "attack_connections",
    "attack_control_reads",
    "attack_event_position",
    "attack_failed_logins",
    "attack_foreign_dataset",
    "attack_gateway_connections",
    "attack_gateway_frames",
    "attack_gateway_keys",
    "attack_gateway_never_reads",
    "attack_hostile_bodies",
    "attack_inference_in_flight",
    "attack_inference_rows",
    "attack_long_strings",
    "attack_nan_batch",
    "attack_nan_in_step",
    "attack_non_finite_wait",
    "attack_open_loop_flood",
    "attack_periodic_evals",
    "attack_quotas",
    "attack_reply_subject",
    "attack_request_flood",
    "attack_service_inbox_reply",
    "attack_service_reads_admin_inbox",
    "attack_training_client_fields",
]
