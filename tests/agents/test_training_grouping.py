"""The training client's calls in the actor's grouped step, and its benchmark's smoke
run (issue 28; the calls end to end: test_training_client.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from joynexus.agents.actor.agent import Actor
from joynexus.agents.models.backbone import Backbone
from joynexus.agents.models.backbone_config import BackboneConfig
from joynexus.ops.runtime.natsserver import EmbeddedNats


@pytest.fixture(scope="module")
def backbone() -> Backbone:
    torch.manual_seed(0)
    return Backbone.build(BackboneConfig(size="tiny"))


def test_a_calls_rows_share_the_groups_base_forward(backbone: Backbone, tmp_path: Path) -> None:
    """A forward call of one tenant and an SFT item of another: ONE backbone forward."""
    from joynexus.agents.actor.custom import CallTodo
    from joynexus.agents.actor.state import TenantState
    from joynexus.agents.models.features import FeatureSchema, canonicalize_request
    from joynexus.agents.models.grouped import TrainItem
    from joynexus.agents.models.heads.base import HeadConfig
    from joynexus.agents.models.heads.tenant import TenantModule
    from joynexus.schemas.jobs import TrainingJob
    from joynexus.schemas.training import TrainCall

    schema = FeatureSchema(camera_slots=("cam",), image_hw=(64, 64), state_dim=9, action_dim=4,
                           action_horizon=2, base_model="qwen2.5-vl-tiny")
    rng = np.random.default_rng(0)

    def batch(rows: int) -> Any:
        return canonicalize_request(schema, {"cam": rng.integers(0, 256, (rows, 3, 64, 64), dtype=np.uint8)},
                                    "push", rng.normal(size=(rows, 9)).astype(np.float32))

    cfg = HeadConfig(feature_dim=backbone.hidden_size, state_dim=9, action_dim=4, action_horizon=2, hidden=16)
    sft = TrainItem(tenant=TenantModule("acme", "oft_mlp", cfg), batch=batch(3),
                    target=torch.zeros(3, 2, 4))
    caller = TenantModule("bolt", "oft_mlp", cfg)
    job = TrainingJob(job_id="j1", tenant_id="bolt", task_type="custom", workload="algo")
    call = CallTodo(job, TenantState(module=caller, record=None), TrainCall(  # type: ignore[arg-type]
        workload="algo", op="forward", seq=1, sample_count=2), TrainItem(tenant=caller, batch=batch(2),
        target=torch.empty(0)), {})
    seen: list[int] = []
    encode = backbone.encode_tokens

    def counting(shared: Any, **kw: Any) -> Any:
        seen.append(shared.batch_size)
        return encode(shared, **kw)

    actor = Actor.__new__(Actor)
    actor.backbone = backbone
    backbone.encode_tokens = counting  # type: ignore[method-assign]
    try:
        losses, results = actor._step([sft], [call])
    finally:
        del backbone.encode_tokens
    assert seen == [5]  # one forward over both tenants' rows
    assert isinstance(losses[0], float)
    assert isinstance(results[0], dict) and set(results[0]["outputs"]) == {"mean", "log_std", "value"}


async def test_bench_primitives_smoke(nats_server: EmbeddedNats) -> None:
    """`joynexus bench primitives` with tiny settings: its figures are there and sane."""
    from joynexus.ops.bench.primitives import bench_primitives

    out = await bench_primitives(nats_server.url, repeats=2, rows=2, progress=False)
    for key in ("fwdbwd_p50_ms", "optim_step_p50_ms", "sft_step_p50_ms", "ratio"):
        assert out[key] is not None and out[key] > 0, key
    assert out["rounds"] == 2
