"""Behaviour cloning written on the client, through the training client.

Two tenants train the same head (same seed, same batches, same AdamW settings)
on a ``task_type="custom"`` workload each: one with an MSE loss written here in
torch (``forward_backward_custom``: the service sends the head's outputs, this
process computes the loss and its gradients with respect to those outputs, and
sends back only the gradients), the other with the service's built-in
``bc_mse`` (``forward_backward``). After the same steps both end at the same
weights, to float rounding; an L1 written here ends where a ``sft`` workload's
steps on the same batches do (``tests/agents/test_training_client.py`` runs both).

    python examples/custom_bc.py --nats nats://127.0.0.1:4222 --a acme.json --b bolt.json
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import numpy as np

from joynexus.sdk import Client, WorkloadSpec

ENV = "PushCube-v1"


def spec(name: str, seed: int = 0) -> WorkloadSpec:
    return WorkloadSpec(name=name, task_type="custom", env=ENV, action_horizon=2, head_hidden=16,
                        seed=seed)


def batches(schema: Any, steps: int, rows: int = 4, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Demonstration-like batches of the workload's layout (random, but fixed by ``seed``)."""
    rng = np.random.default_rng(seed)
    out = []
    h, w = schema.image_hw
    for _ in range(steps):
        b = {f"obs_image_{c}": rng.integers(0, 256, (rows, 3, h, w), dtype=np.uint8)
             for c in schema.camera_slots}
        b["obs_state"] = rng.normal(size=(rows, schema.state_dim)).astype(np.float32)
        b["actions"] = rng.uniform(-1, 1, (rows, schema.action_horizon, schema.action_dim)).astype(np.float32)
        out.append(b)
    return out


def mse(outputs: dict[str, Any], batch: dict[str, Any]) -> Any:
    """The client's own loss: mean squared error of the mean chunk to the demonstration."""
    return ((outputs["mean"] - batch["actions"]) ** 2).mean()


def l1(outputs: dict[str, Any], batch: dict[str, Any]) -> Any:
    """The ``sft`` workload's own loss (its heads' default), written on the client."""
    return (outputs["mean"] - batch["actions"]).abs().mean()


async def train(client: Client, workload: str, *, custom: bool, steps: int = 20,
                lr: float = 1e-3, seed: int = 0, loss: Any = mse) -> list[float]:
    """``steps`` BC steps on ``workload``; the losses. Calls are made without waiting
    (several in flight); they apply in the order made."""
    tc = await client.training_client(workload)
    futures = []
    for batch in batches(tc.schema, steps, seed=seed):
        if custom:
            futures.append(tc.forward_backward_custom(batch, loss))
        else:
            futures.append(tc.forward_backward(batch, loss="bc_mse"))
        tc.optim_step(learning_rate=lr)
    losses = [r["loss"] for r in await asyncio.gather(*futures)]
    await tc.zero_grad()  # after every step: all applied
    return losses


async def train_sft(client: Client, workload: str, schema: Any, *, steps: int = 20, seed: int = 0) -> int:
    """The same batches as one-step jobs of a ``source="tenant"`` sft workload; its
    last version once every step is applied."""
    for batch in batches(schema, steps, seed=seed):
        await client.submit_sft_batch(workload, batch)
    done = 0
    async for event in client.events(workload):  # its job events, from its start
        done += event.job.state == "completed"
        if done == steps:
            break
    return await client.latest_version(workload)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nats", default=None)
    p.add_argument("--a", required=True, help="credentials of the tenant with the client-side loss")
    p.add_argument("--b", required=True, help="credentials of the tenant with the built-in loss")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    a = await Client.connect(args.nats, credentials=args.a)
    b = await Client.connect(args.nats, credentials=args.b)
    await a.create_workload(spec("bc-custom"))
    await b.create_workload(spec("bc-builtin"))
    la, lb = await asyncio.gather(train(a, "bc-custom", custom=True, steps=args.steps),
                                  train(b, "bc-builtin", custom=False, steps=args.steps))
    print({"custom_losses": la, "builtin_losses": lb})


if __name__ == "__main__":
    asyncio.run(main())
