"""What a workload needs besides the scheduler, one module per job:

- :mod:`.schema`: a workload's feature layout (``workload_schema``), the
  backbone's feature width, normalisation stats, and the pure target builders
  (``chunk_targets``, ``decision_lengths``);
- :mod:`.init`: ``PolicyInitializer``, the control plane's hook that publishes
  version 1 of a new workload's policy (checks and copies here, fresh weights at
  the actor's ``PolicyInitService``);
- :mod:`.sft`: ``SFTProducer``;
- :mod:`.supervisor`: ``ProducerAgent`` (a producer per active workload of its
  kind) and ``watch_workloads``.

Every module here is light (no torch, simulator or lerobot at import): the
control plane and the producers' supervisors import them; torch is imported
inside what computes with it (fresh weights, reading a LeRobot dataset). The RL
producer runs in environment worker processes
(:mod:`joynexus.agents.envworkers`); sample field names are in
:mod:`joynexus.schemas.samples`.
See docs/ARCHITECTURE.md
("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

from joynexus.agents.producers.init import PolicyInitializer, PolicyInitService
from joynexus.agents.producers.schema import (
    EXPLORATION_STD,
    MAX_INFO_BYTES,
    chunk_targets,
    decision_lengths,
    feature_dim,
    normalization_stats,
    unusable_dataset,
    workload_schema,
)
from joynexus.agents.producers.sft import SFTProducer
from joynexus.agents.producers.supervisor import ProducerAgent, watch_workloads

__all__ = [
    "EXPLORATION_STD",
    "MAX_INFO_BYTES",
    "PolicyInitService",
    "PolicyInitializer",
    "ProducerAgent",
    "SFTProducer",
    "chunk_targets",
    "decision_lengths",
    "feature_dim",
    "normalization_stats",
    "unusable_dataset",
    "watch_workloads",
    "workload_schema",
]
