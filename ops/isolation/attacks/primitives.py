"""Attacks on the training client's fields (issue 28): the client epoch that fences
an older client, the row offset that makes an upload idempotent, and the
evaluation policy. Each hostile value gets a clear refusal naming the field (or is
a no-op where the protocol says so), never an internal error, and touches only
the attacker's own workload. See docs/ARCHITECTURE.md ("The training client").
"""

from __future__ import annotations

import contextlib
from typing import Any

from joynexus.ops.isolation.deployment import SecuredDeployment
from joynexus.ops.isolation.kit import AttackResult, Checks, api_raw, refused, short_error
from joynexus.schemas.errors import JoyNexusError
from joynexus.schemas.inference import TensorBytes
from joynexus.schemas.workloads import WorkloadSpec

#: The attacker's custom workload (a small head: nothing here trains it).
WORKLOAD = "tc-fields"
BAD = ("invalid_spec", "invalid_message")


def _rows(schema: Any, n: int) -> dict[str, TensorBytes]:
    """``n`` forward rows of the workload's layout (zeros: their values do not matter)."""
    import numpy as np

    h, w = schema.image_hw
    rows = {f"obs_image_{c}": np.zeros((n, 3, h, w), np.uint8) for c in schema.camera_slots}
    rows["obs_state"] = np.zeros((n, schema.state_dim), np.float32)
    return {k: TensorBytes.from_array(v) for k, v in rows.items()}


async def attack_training_client_fields(dep: SecuredDeployment, attacker: str, victim: str) -> AttackResult:
    """A training client's ``client`` epoch out of range, a bool, or one no start
    issued; ``put_data`` offsets negative, a bool, huge, past the rows put; a repeat
    at an offset already put; ``eval_policy`` unknown, or ``sampled`` on a head with
    no std: each refused (the field named), the repeat a no-op, and the call the
    rows belong to still runs on exactly the rows put once."""
    ck = Checks()
    client = await dep.client(attacker)
    try:
        await client.create_workload(WorkloadSpec(
            name=WORKLOAD, task_type="custom", env="PushCube-v1", action_horizon=2, head_hidden=16))
        tc = await client.training_client(WORKLOAD)
        schema = tc.schema
        # -- the client epoch
        call = {"workload": WORKLOAD, "op": "zero_grad", "seq": tc.seq + 1}
        for what, epoch in (("-1", -1), ("true", True), ("2**60", 2**60), ("a string", "7")):
            ok, note = await refused(api_raw(client, "train_call", {**call, "client": epoch}),
                                     BAD, mention="client", within_s=5.0)
            ck.add(f"client={what} refused", ok, note)
        ok, note = await refused(api_raw(client, "train_call", {**call, "client": tc.epoch + 7}),
                                 ("conflict",), within_s=5.0)
        ck.add("an epoch no start issued refused", ok, note)

        # -- row offsets: a forward call of 2 rows, put hostile ways, then honestly
        opened = await api_raw(client, "train_call", {
            "workload": WORKLOAD, "op": "forward", "seq": tc.seq + 1, "sample_count": 2,
            "client": tc.epoch})
        assert opened.job is not None
        job_id, one = opened.job.job_id, _rows(schema, 1)
        for what, offset, codes in (("-1", -1, BAD), ("true", True, BAD), ("2**50", 2**50, BAD),
                                    ("past the rows put", 5, ("conflict",))):
            ok, note = await refused(
                api_raw(client, "put_data", {"job_id": job_id, "fields": one, "offset": offset},
                        binary=True),
                codes, mention="offset", within_s=5.0)
            ck.add(f"offset={what} refused", ok, note)
        for offset in (0, 0, 1):  # the second a repeat after a "lost reply": a no-op
            await api_raw(client, "put_data", {"job_id": job_id, "fields": one, "offset": offset},
                          binary=True)
        await api_raw(client, "close_job", {"job_id": job_id})
        tc.seq += 1  # the call above was this client's next (made by hand)
        result = await tc._result(job_id)
        mean = result.outputs.get("mean")
        rows = None if mean is None else mean.to_array("mean").shape[0]
        ck.add("the call ran on the 2 rows put, the repeat not among them", rows == 2,
               f"rows in its result: {rows}")

        # -- the evaluation policy
        for what, over, mention in (
            ("eval_policy='greedy'", {"eval_policy": "greedy"}, "eval_policy"),
            ("'sampled' on a flow head", {"eval_policy": "sampled",
                                          "action_module": "flow_matching"}, "sampled"),
        ):
            ok, note = await refused(
                api_raw(client, "create_workload", {"spec": {
                    "name": "tc-eval", "task_type": "eval", "env": "PushCube-v1",
                    "init_from_workload": WORKLOAD, "episodes": 1, **over}}),
                BAD, mention=mention, within_s=5.0)
            ck.add(f"{what} refused", ok, note)
    except JoyNexusError as e:
        ck.add("the attacker's own calls answered", False, short_error(e))
    finally:
        with contextlib.suppress(Exception):
            await client.cancel_workload(WORKLOAD)
        with contextlib.suppress(Exception):
            await client.cancel_workload("tc-eval")
    return ck.result()


__all__ = ["attack_training_client_fields"]
