"""No tenant can harm another: a live secured deployment, a victim, and the attack
catalogue; one module per job.

One catalogue, two users: the adversarial suite (``pytest -m adversarial``,
``tests/system/test_adversarial.py``) asserts every attack, and ``joynexus bench
isolation --json`` (``ops/bench/isolation.py``) reports them.

- :mod:`.deployment`: :class:`SecuredDeployment` (the server, the agents, the tenants'
  credentials, clients and dataset spaces, what an attack observes) and the
  tenants' batches;
- :mod:`.victim`: :class:`Victim`, tenant ``bolt`` training and probing;
- :mod:`.kit`: what every attack uses (raw calls, :class:`Checks`,
  :func:`refused`, :class:`Attack`);
- :mod:`.attacks`: one module per family (subjects, identities, floods, data,
  quotas, inputs) and :data:`CATALOGUE`, in the order they run (each attack
  function is imported from its family's module);
- :mod:`.runner`: :func:`run_attack` (a baseline window, then the attack with the
  victim probed), :class:`Outcome`, :func:`prepare`.

See docs/ARCHITECTURE.md ("Tenants fenced by the broker", "Layout and import root").
"""

from __future__ import annotations

from joynexus.ops.isolation.attacks import BY_NAME, CATALOGUE, HOSTILE_BODIES
from joynexus.ops.isolation.deployment import (
    ATTACKER,
    ATTACKER_TQ_BYTES,
    DATASET,
    MODEL,
    NS,
    VICTIM,
    VICTIM_WORKLOAD,
    MiB,
    RawConn,
    SecuredDeployment,
    sft_batch,
    sft_spec,
)
from joynexus.ops.isolation.kit import (
    Attack,
    AttackResult,
    Checks,
    api_raw,
    infer_raw,
    infer_request,
    refused,
)
from joynexus.ops.isolation.runner import (
    P50_TARGET,
    P99_ABS_BOUND_S,
    P99_RATIO_BOUND,
    P99_TARGET,
    TRAIN_RATE_TARGET,
    Outcome,
    prepare,
    run_attack,
)
from joynexus.ops.isolation.victim import CALL_TIMEOUT_S, PROGRESS_GRACE_S, Stats, Victim

__all__ = [
    "ATTACKER",
    "ATTACKER_TQ_BYTES",
    "BY_NAME",
    "CALL_TIMEOUT_S",
    "CATALOGUE",
    "DATASET",
    "HOSTILE_BODIES",
    "MODEL",
    "NS",
    "P50_TARGET",
    "P99_ABS_BOUND_S",
    "P99_RATIO_BOUND",
    "P99_TARGET",
    "PROGRESS_GRACE_S",
    "TRAIN_RATE_TARGET",
    "VICTIM",
    "VICTIM_WORKLOAD",
    "Attack",
    "AttackResult",
    "Checks",
    "MiB",
    "Outcome",
    "RawConn",
    "SecuredDeployment",
    "Stats",
    "Victim",
    "api_raw",
    "infer_raw",
    "infer_request",
    "prepare",
    "refused",
    "run_attack",
    "sft_batch",
    "sft_spec",
]
