"""One tenant's state in the actor: its module, the jobs (and a custom workload's
calls) it has applied, and the revision of its committed checkpoint.

The checkpoint's bytes (``blob``) are what the actor commits to JetStream
(``broker.trainerstate``) after each step or call: weights, optimizer and
version, the applied jobs, and for a ``custom`` workload the gradients
accumulated since its last ``optim_step`` and its call log (last sequence,
results), so a restart on any host resumes exactly where the last commit was.
See docs/ARCHITECTURE.md ("Workloads, from the SDK to a new policy version").
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from joynexus.agents.actor.calls import CallLog, accumulated, restore_accumulated
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.schemas.inference import PolicyRecord

__all__ = ["TenantState"]


@dataclass
class TenantState:
    module: TenantModule
    record: PolicyRecord  # the latest version this actor knows (schema, base model)
    applied: dict[str, int] = field(default_factory=dict)  # job_id -> version it produced
    dir: Path = Path()
    #: Revision of this tenant's record in the trainer KV this state was loaded or
    #: committed at (None: no committed checkpoint yet): the compare-and-set token.
    revision: int | None = None
    #: A custom workload's applied calls and their results (``agents.actor.calls``).
    calls: CallLog = field(default_factory=CallLog)

    def blob(self) -> bytes:
        """The checkpoint's bytes: module (weights, optimizer, version), applied jobs,
        and a custom workload's accumulated gradients and applied calls."""
        buf = io.BytesIO()
        torch.save({"module": self.module.state_dict(), "applied": self.applied,
                    "grads": accumulated(self.module), "calls": self.calls.to_dict()}, buf)
        return buf.getvalue()

    @staticmethod
    def unpack(data: bytes) -> tuple[TenantModule, dict[str, int], CallLog]:
        saved = torch.load(io.BytesIO(data), weights_only=True)
        module = TenantModule.from_state_dict(saved["module"])
        restore_accumulated(module, saved.get("grads"))
        return module, dict(saved["applied"]), CallLog.from_dict(saved.get("calls"))

    def save(self, data: bytes | None = None) -> None:
        """The local cache of the checkpoint, written atomically (the one in force is
        the trainer KV's, see ``Actor._commit``)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "checkpoint.pt.tmp"
        tmp.write_bytes(self.blob() if data is None else data)
        os.replace(tmp, self.dir / "checkpoint.pt")
        manifest = {
            "tenant_id": self.record.tenant_id,
            "workload": self.record.workload,
            "version": self.module.version,
            "head_type": self.module.head_type,
            "schema_signature": self.record.schema_signature,
            "base_model": self.record.base_model,
            # State/action statistics the head applies (also inside its weights).
            "normalization": self.module.normalization(),
            "jobs_applied": len(self.applied),
            "last_job": next(reversed(self.applied), None),
            "updated_at": time.time(),
        }
        tmp_m = self.dir / "manifest.json.tmp"
        tmp_m.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp_m, self.dir / "manifest.json")
