"""``WorkloadSpec.init_from_checkpoint``: a tenant's head started from a LeRobot policy
checkpoint in its own dataset space (``agents.datasets.resolve_checkpoint`` confines the
path; ``agents.models.pi05_checkpoint`` or ``smolvla_checkpoint`` reads it, by the head's
family). Torch-free, checked on decode.

See docs/ARCHITECTURE.md, "Model families: the π0.5 base" and
"Model families: the SmolVLA base".
"""

from __future__ import annotations

from typing import Any

from joynexus.schemas.errors import InvalidSpec

__all__ = ["CHECKPOINT_HEADS", "check_init_from_checkpoint"]

#: The heads a LeRobot checkpoint can start (its policy's action expert).
CHECKPOINT_HEADS = ("pi05_expert", "smolvla_expert")


def check_init_from_checkpoint(spec: Any) -> None:
    """``InvalidSpec`` unless ``spec.init_from_checkpoint`` (None: nothing) may start this workload."""
    ckpt = spec.init_from_checkpoint
    if ckpt is None:
        return
    if not isinstance(ckpt, str) or not ckpt or len(ckpt) > 1024 or "\x00" in ckpt:
        raise InvalidSpec("init_from_checkpoint must be a path of 1 to 1024 characters")
    if spec.task_type not in ("sft", "rl"):
        raise InvalidSpec(f"init_from_checkpoint applies to sft and rl workloads, not {spec.task_type}")
    if spec.init_from_workload or spec.init_from_export:
        raise InvalidSpec("give one of init_from_workload, init_from_export and init_from_checkpoint")
    if spec.action_module not in CHECKPOINT_HEADS:
        raise InvalidSpec(
            f"init_from_checkpoint (a LeRobot PI05Policy or SmolVLAPolicy checkpoint) starts a pi05_expert "
            f"or smolvla_expert head, not {spec.action_module!r}"
        )
    if getattr(spec, "expert_state", None) == "token":
        raise InvalidSpec("init_from_checkpoint: a LeRobot π0.5 checkpoint has no continuous state "
                          "token (expert_state='token'); leave expert_state at its default")
