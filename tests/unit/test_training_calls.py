"""The training client's pure parts: a call checks itself, a call's rows are exactly
the fields it reads in the workload's shapes, the door's quota checks, the call
log, and the head-side compute (a client-side MSE through ``backward`` gives the
built-in ``bc_mse`` gradients; a failed call leaves the module as it was)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from joynexus.agents.actor.calls import KEEP_RESULTS, CallLog, apply_rows, optim_step, outputs
from joynexus.agents.control.training import check_train_call
from joynexus.agents.models.heads.base import HeadConfig
from joynexus.agents.models.heads.tenant import TenantModule
from joynexus.schemas.errors import InvalidSpec, QuotaExceeded, ShapeMismatch
from joynexus.schemas.quotas import Quota
from joynexus.schemas.samples import dims_of
from joynexus.schemas.training import TrainCall, check_call_rows
from joynexus.schemas.workloads import WorkloadRecord, WorkloadSpec


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"op": "exec"}, "op 'exec' is not one of"),
        ({"op": "forward", "seq": 0, "sample_count": 1}, "seq must be"),
        ({"op": "forward_backward", "loss": "mine", "sample_count": 1}, "loss 'mine' is not one of"),
        ({"op": "forward_backward", "loss": "ppo", "settings": {"clip": 3.0}, "sample_count": 1},
         r"ppo setting clip must be a finite number in \[0, 1\]"),
        ({"op": "forward_backward", "loss": "bc_mse", "settings": {"clip": 0.1}, "sample_count": 1},
         "takes settings"),
        ({"op": "forward_backward", "loss": "awr", "settings": {"beta": float("nan")}, "sample_count": 1},
         "finite"),
        ({"op": "optim_step", "learning_rate": float("inf")}, "learning_rate"),
        ({"op": "optim_step", "betas": [0.9]}, "betas must be two"),
        ({"op": "forward", "learning_rate": 0.1, "sample_count": 1}, "no optimizer settings"),
        ({"op": "save_state", "name": "../other/x"}, "not a valid name"),
        ({"op": "load_state", "name": "A" * 40}, "not a valid name"),
        ({"op": "zero_grad", "name": "x"}, "takes no state name"),
        ({"op": "forward"}, "needs sample_count"),
        ({"op": "optim_step", "sample_count": 3}, "carries no rows"),
        ({"op": "forward", "sample_count": 1, "workload": "Other.Tenant"}, "not a valid name"),
    ],
)
def test_a_call_checks_itself(fields: dict, message: str) -> None:
    base = {"workload": "algo", "seq": 1}
    with pytest.raises(InvalidSpec, match=message):
        TrainCall(**{**base, **fields})


def test_a_call_travels_in_its_job_and_is_checked_again() -> None:
    call = TrainCall(workload="algo", op="forward_backward", seq=3, loss="ppo",
                     settings={"clip": 0.1}, sample_count=8, wait_s=5.0)
    extra = call.extra()
    assert extra["op"] == "forward_backward" and extra["seq"] == "3"
    back = TrainCall.from_extra(extra)
    assert back.settings == {"clip": 0.1} and back.wait_s == 0.0
    with pytest.raises(InvalidSpec):
        TrainCall.from_extra({"call": extra["call"].replace('"clip":0.1', '"clip":9.0')})
    with pytest.raises(InvalidSpec, match="no training call"):
        TrainCall.from_extra({})


SIZES = dims_of(2, 4, 9, 3, (64, 64))
IMG = (3, 64, 64)


def _rows(call: TrainCall, family: str, shapes: dict) -> None:
    check_call_rows(call, family, shapes, SIZES, ["cam"])


def test_a_calls_rows_are_exactly_its_fields_in_the_outputs_shapes() -> None:
    fwd = TrainCall(workload="algo", op="forward", seq=1, sample_count=2)
    _rows(fwd, "gaussian", {"obs_state": (9,), "obs_image_cam": IMG})
    with pytest.raises(InvalidSpec, match="takes no fields"):
        _rows(fwd, "gaussian", {"obs_state": (9,), "obs_image_cam": IMG, "actions": (2, 4)})
    with pytest.raises(InvalidSpec, match="needs fields"):
        _rows(fwd, "flow", {"obs_state": (9,), "obs_image_cam": IMG})
    bwd = TrainCall(workload="algo", op="backward", seq=1, sample_count=2)
    grads = {"grad_mean": (2, 4), "grad_log_std": (4,), "grad_value": ()}
    _rows(bwd, "gaussian", {"obs_state": (9,), "obs_image_cam": IMG, **grads})
    with pytest.raises(ShapeMismatch, match="grad_mean"):
        _rows(bwd, "gaussian", {"obs_state": (9,), "obs_image_cam": IMG, **grads, "grad_mean": (3, 4)})
    with pytest.raises(ShapeMismatch, match="obs_image_cam"):
        _rows(bwd, "gaussian", {"obs_state": (9,), "obs_image_cam": (3, 8, 8), **grads})
    ppo = TrainCall(workload="algo", op="forward_backward", seq=1, loss="ppo", sample_count=2)
    with pytest.raises(InvalidSpec, match="needs fields"):
        _rows(ppo, "gaussian", {"obs_state": (9,), "obs_image_cam": IMG, "actions": (2, 4)})
    flow = TrainCall(workload="algo", op="forward_backward", seq=1, loss="flow_matching", sample_count=2)
    with pytest.raises(InvalidSpec, match="trains flow heads"):
        _rows(flow, "gaussian", {"obs_state": (9,), "obs_image_cam": IMG, "actions": (2, 4)})


def _record(**kw: object) -> WorkloadRecord:
    spec = WorkloadSpec(**{"name": "algo", "task_type": "custom", "env": "PushCube-v1", **kw})  # type: ignore[arg-type]
    return WorkloadRecord(tenant_id="acme", spec=spec, generation=1, created_at=0.0)


def test_the_door_bounds_calls_by_the_tenants_quota() -> None:
    q = Quota(max_batch_size=8, max_open_jobs=2)
    fwd = TrainCall(workload="algo", op="forward", seq=1, sample_count=8)
    check_train_call("acme", _record(), fwd, q, opened=0)
    with pytest.raises(QuotaExceeded, match="max_batch_size"):
        check_train_call("acme", _record(), TrainCall(workload="algo", op="forward", seq=1, sample_count=9), q, 0)
    with pytest.raises(QuotaExceeded, match="jobs open"):
        check_train_call("acme", _record(), fwd, q, opened=2)
    with pytest.raises(InvalidSpec, match="drives heads"):
        check_train_call("acme", _record(action_module="gr00t_flow"), fwd, q, 0)
    sft = WorkloadRecord(tenant_id="acme", generation=1, created_at=0.0,
                         spec=WorkloadSpec(name="algo", task_type="sft", dataset="d"))
    with pytest.raises(InvalidSpec, match="custom"):
        check_train_call("acme", sft, fwd, q, 0)


def test_a_custom_spec_declares_its_layout() -> None:
    with pytest.raises(InvalidSpec, match="needs env"):
        WorkloadSpec(name="algo", task_type="custom")
    with pytest.raises(InvalidSpec, match="env must be one of"):
        WorkloadSpec(name="algo", task_type="custom", env="AntMaze")


def test_the_call_log_keeps_the_latest_results() -> None:
    log = CallLog()
    gone: list[str] = []
    for i in range(1, KEEP_RESULTS + 3):
        gone += log.record(f"j{i}", i, b"r")
    assert log.last_seq == KEEP_RESULTS + 2 and gone == ["j1", "j2"]
    again = CallLog.from_dict(log.to_dict())
    assert again.last_seq == log.last_seq and list(again.results) == list(log.results)


def _module() -> TenantModule:
    return TenantModule("acme", "oft_mlp", HeadConfig(feature_dim=16, state_dim=9, action_dim=4,
                                                     action_horizon=2, hidden=16, seed=3))


def test_a_client_side_mse_through_backward_gives_the_builtin_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    feats, state = torch.randn(5, 16, generator=g), torch.randn(5, 9, generator=g)
    actions = np.random.default_rng(0).uniform(-1, 1, (5, 2, 4)).astype(np.float32)
    builtin, custom = _module(), _module()
    fb = TrainCall(workload="algo", op="forward_backward", seq=1, loss="bc_mse", sample_count=5)
    loss, _, _ = apply_rows(builtin, fb, feats, state, {"actions": actions})
    # The client: outputs from forward, its own MSE, the gradients of the outputs.
    fwd = TrainCall(workload="algo", op="forward", seq=1, sample_count=5)
    _, _, outs = apply_rows(custom, fwd, feats, state, {})
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in outs.items()}
    client_loss = ((leaves["mean"] - torch.from_numpy(actions)) ** 2).mean()
    client_loss.backward()
    grads = {f"grad_{k}": (t.grad if t.grad is not None else torch.zeros_like(t)).numpy() for k, t in leaves.items()}
    bwd = TrainCall(workload="algo", op="backward", seq=2, sample_count=5)
    apply_rows(custom, bwd, feats, state, grads)
    assert loss == pytest.approx(float(client_loss.detach()), abs=1e-6)
    for p, q in zip(builtin.head.parameters(), custom.head.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-6)
    step = TrainCall(workload="algo", op="optim_step", seq=3, learning_rate=1e-2, grad_clip=1.0)
    optim_step(builtin, step)
    optim_step(custom, step)
    assert builtin.version == custom.version == 1
    for p, q in zip(builtin.head.parameters(), custom.head.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_failed_call_leaves_the_accumulated_gradients_as_they_were() -> None:
    m = _module()
    feats, state = torch.randn(3, 16), torch.randn(3, 9)
    fb = TrainCall(workload="algo", op="forward_backward", seq=1, loss="bc_mse", sample_count=3)
    apply_rows(m, fb, feats, state, {"actions": np.zeros((3, 2, 4), np.float32)})
    before = [None if p.grad is None else p.grad.clone() for p in m.head.parameters()]
    bad = {"actions": np.full((3, 2, 4), np.inf, np.float32)}
    with pytest.raises(InvalidSpec, match="non-finite"):
        apply_rows(m, fb, feats, state, bad)
    for p, b in zip(m.head.parameters(), before, strict=True):
        assert (p.grad is None and b is None) or torch.equal(p.grad, b)
    with pytest.raises(InvalidSpec, match="not driven"):
        outputs(TenantModule("acme", "value", HeadConfig(feature_dim=16, state_dim=9)), feats, state, {})


def test_a_gaussian_heads_outputs_are_in_the_envs_action_units() -> None:
    """mean and log_std in one unit: N(mean, exp(log_std)) is the distribution the
    policy's rollouts sample (``action_std_A``), whatever the data's action scale; and
    a gradient on log_std reaches the head's own (normalised) log_std one for one."""
    m = _module()
    head = m.head
    head.action_std.copy_(torch.tensor([0.5, 2.0, 0.1, 1.0]))
    feats, state = torch.randn(3, 16), torch.randn(3, 9)
    out = outputs(m, feats, state, {})
    assert torch.allclose(out["log_std"].exp()[0], head.action_std_A(), atol=1e-6)
    out["log_std"].sum().backward()
    assert torch.allclose(head.log_std.grad, torch.full((4,), 3.0))


def test_a_call_fails_for_its_own_errors_but_not_for_the_machines() -> None:
    """A Training Queue read that timed out while a host was lost (``Unavailable``) is no
    answer to the tenant's call: it propagates (the actor stops, the call is leased again);
    the call's own errors become its result."""
    from joynexus.agents.actor.custom import _as_call_error
    from joynexus.schemas.errors import InvalidSpec, Timeout, Unavailable
    from joynexus.schemas.training import TrainCall

    call = TrainCall(workload="w", op="zero_grad", seq=1)
    for machine in (Unavailable("reading chunk 95 of JNX_TQ timed out"), Timeout("t"), OSError("o")):
        with pytest.raises(type(machine)):
            _as_call_error(machine, call)
    own = InvalidSpec("bad rows")
    assert _as_call_error(own, call) is own
    assert isinstance(_as_call_error(ValueError("nan"), call), InvalidSpec)
