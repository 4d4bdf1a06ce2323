"""The policy gateway of the isolation deployment, and how the attacks reach it.

A fresh :class:`~joynexus.ops.isolation.deployment.SecuredDeployment` starts a
gateway beside its agents: in its own process with the others when the agents
run one process per role (``joynexus agent gateway``, as ``joynexus up`` runs it),
in the deployment's process otherwise. Its knobs are the role's environment
(:data:`GATEWAY_ENV`: a short send timeout, so a client that never reads is cut
off within an attack's time). See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

#: The gateway role's environment in the isolation deployment.
GATEWAY_ENV = {
    "JOYNEXUS_GATEWAY_HOST": "127.0.0.1",
    "JOYNEXUS_GATEWAY_TENANT_CONNS": "16",
    "JOYNEXUS_GATEWAY_SEND_TIMEOUT_S": "3",
    "JOYNEXUS_GATEWAY_IDLE_S": "60",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def healthy(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a gateway answers ``GET /healthz`` on ``port``."""
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return (await asyncio.wait_for(r.read(64), 2.0)).startswith(b"HTTP/1.1 200")
    except (OSError, TimeoutError):
        return False
    finally:
        w.close()


async def wait_healthy(port: int, within_s: float, alive: Any = None) -> None:
    """Until the gateway on ``port`` serves; ``alive()`` False (its process died) or
    ``within_s`` passing raises."""
    deadline = time.monotonic() + within_s
    while not await healthy(port):
        if alive is not None and not alive():
            raise RuntimeError(f"the gateway on port {port} exited while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway did not serve on port {port} within {within_s:.0f}s")
        await asyncio.sleep(0.3)


async def start_in_process(b: Any, stack: contextlib.AsyncExitStack) -> int:
    """A gateway on the service connection ``b`` in this process (stopped with
    ``stack``); its port."""
    from joynexus.agents.gateway import GatewayOptions, PolicyGateway

    gw = PolicyGateway(b, GatewayOptions(
        host="127.0.0.1", port=0, max_conns_per_tenant=int(GATEWAY_ENV["JOYNEXUS_GATEWAY_TENANT_CONNS"]),
        send_timeout_s=float(GATEWAY_ENV["JOYNEXUS_GATEWAY_SEND_TIMEOUT_S"]),
        idle_s=float(GATEWAY_ENV["JOYNEXUS_GATEWAY_IDLE_S"])))
    await gw.start()
    stack.push_async_callback(gw.stop)
    return gw.port


__all__ = ["GATEWAY_ENV", "free_port", "healthy", "start_in_process", "wait_healthy"]
