"""The policy gateway (role ``gateway``): tenants' policies served to robots and any
client speaking openpi's websocket policy protocol, through the Inference Queue.

- :mod:`.codec`: openpi's msgpack-numpy frames, decoded with bounds (pure);
- :mod:`.observation`: openpi's keys mapped to a policy's inputs, the metadata (pure);
- :mod:`.keystore`: the API keys bucket in memory, revocations told at once;
- :mod:`.server`: :class:`PolicyGateway`, the websocket server.

See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

from joynexus.agents.gateway.server import GatewayOptions, PolicyGateway, run_gateway

__all__ = ["GatewayOptions", "PolicyGateway", "run_gateway"]
