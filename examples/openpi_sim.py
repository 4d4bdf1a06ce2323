"""openpi's own client drives a ManiSkill or LIBERO task against a tenant's policy served
by the JoyNexus policy gateway. Run it in openpi's virtualenv (``.venv-openpi``: openpi-client
0.1.2, numpy < 2); it imports nothing of JoyNexus.

The simulator lives in the service's virtualenv (numpy 2): ``EnvProxy``
(``ops/bench/envproxy.py``) serves one ManiSkill or LIBERO env on a unix socket
(for LIBERO with the observation keys of openpi's own LIBERO example:
``observation/image``, ``observation/wrist_image``, ``observation/state``, ``prompt``), and
:class:`ProxyEnvironment` here is an ordinary openpi ``Environment`` that forwards
``reset``, ``get_observation`` and ``apply_action`` to it, exactly as a robot's
environment would talk to its hardware. The episodes run through openpi's own
``Runtime(env, PolicyAgent(ActionChunkBroker(WebsocketClientPolicy(...))))``.

Usage: python openpi_sim.py WS_URL API_KEY SOCKET EPISODES
(``joynexus bench gateway --success`` starts the proxy and runs this.)
Prints one JSON line: the server's metadata, steps, policy calls and numpy's version.
"""

from __future__ import annotations

import json
import socket
import struct
import sys

import numpy as np
from openpi_client import action_chunk_broker, msgpack_numpy, websocket_client_policy
from openpi_client.runtime import environment, runtime
from openpi_client.runtime.agents import policy_agent


class ProxyEnvironment(environment.Environment):
    """An openpi Environment whose simulator is another process (a unix socket)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.done = True
        self.steps = 0

    def _call(self, **msg: object) -> dict:
        data = msgpack_numpy.packb(msg)
        self.sock.sendall(struct.pack(">I", len(data)) + data)
        (n,) = struct.unpack(">I", self._read(4))
        reply = msgpack_numpy.unpackb(self._read(n))
        if "error" in reply:
            raise RuntimeError(f"environment proxy: {reply['error']}")
        return reply

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the environment proxy closed the connection")
            buf += chunk
        return buf

    def reset(self) -> None:
        self.done = self._call(op="reset")["done"]

    def is_episode_complete(self) -> bool:
        return self.done

    def get_observation(self) -> dict:
        return self._call(op="observe")

    def apply_action(self, action: dict) -> None:
        a = np.asarray(action["actions"], dtype=np.float32)
        self.done = self._call(op="apply", action=a)["done"]
        self.steps += 1


class Counting(websocket_client_policy.WebsocketClientPolicy):
    calls = 0

    def infer(self, obs: dict) -> dict:
        Counting.calls += 1
        return super().infer(obs)


def main() -> None:
    url, key, path, episodes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    policy = Counting(url, api_key=key)
    meta = policy.get_server_metadata()
    env = ProxyEnvironment(path)
    runtime.Runtime(
        environment=env,
        agent=policy_agent.PolicyAgent(
            action_chunk_broker.ActionChunkBroker(policy, action_horizon=meta["action_horizon"])
        ),
        subscribers=[],
        num_episodes=episodes,
    ).run()
    print(json.dumps({"meta": {k: meta[k] for k in ("tenant", "workload", "version", "cameras",
                                                     "action_horizon", "action_dim")},
                      "steps": env.steps, "calls": Counting.calls, "numpy": np.__version__}))


if __name__ == "__main__":
    main()
