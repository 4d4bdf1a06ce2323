"""Run inside openpi's own virtualenv (``.venv-openpi``, numpy < 2): drive episodes
against the policy gateway with openpi's real client,
``Runtime(env, PolicyAgent(ActionChunkBroker(WebsocketClientPolicy(...))))``, and
print one JSON line: the server's metadata, steps, policy calls, action shapes,
and what a bad observation raised. Imports nothing of joynexus.

Usage: python openpi_driver.py URL KEY EPISODES STEPS
"""

from __future__ import annotations

import json
import sys

import numpy as np
from openpi_client import action_chunk_broker, websocket_client_policy
from openpi_client.runtime import environment, runtime
from openpi_client.runtime.agents import policy_agent


class Counting(websocket_client_policy.WebsocketClientPolicy):
    calls = 0

    def infer(self, obs: dict) -> dict:
        Counting.calls += 1
        return super().infer(obs)


class Scene(environment.Environment):
    """A stand-in robot: random camera frames and state of the policy's sizes."""

    def __init__(self, meta: dict, steps: int) -> None:
        self.meta, self.steps, self.t, self.actions = meta, steps, 0, []
        self.rng = np.random.default_rng(0)

    def reset(self) -> None:
        self.t = 0

    def is_episode_complete(self) -> bool:
        return self.t >= self.steps

    def get_observation(self) -> dict:
        h, w = self.meta["image_size"]
        return {
            "observation/image": self.rng.integers(0, 255, (h, w, 3), dtype=np.uint8),
            "observation/state": self.rng.standard_normal(self.meta["state_dim"]).astype(np.float32),
            "prompt": self.meta["instruction"] or "pick the cube",
        }

    def apply_action(self, action: dict) -> None:
        a = action["actions"]
        assert a.shape == (self.meta["action_dim"],) and np.isfinite(a).all(), a
        self.actions.append(a)
        self.t += 1


def main() -> None:
    url, key, episodes, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    policy = Counting(url, api_key=key)
    meta = policy.get_server_metadata()
    scene = Scene(meta, steps)
    runtime.Runtime(
        environment=scene,
        agent=policy_agent.PolicyAgent(
            action_chunk_broker.ActionChunkBroker(policy, action_horizon=meta["action_horizon"])
        ),
        subscribers=[],
        num_episodes=episodes,
    ).run()
    bad = scene.get_observation()
    bad["observation/state"] = np.full(meta["state_dim"], np.nan, np.float32)
    try:
        policy.infer(bad)
        error = ""
    except RuntimeError as e:
        error = str(e)
    after = policy.infer(scene.get_observation())["actions"].shape
    print(json.dumps({"meta": {k: meta[k] for k in ("tenant", "workload", "version",
                                                     "action_horizon", "action_dim")},
                      "steps": len(scene.actions), "calls": Counting.calls, "error": error,
                      "after_error": list(after), "numpy": np.__version__}))


if __name__ == "__main__":
    main()
