"""The operator's side of the policy gateway's API keys: add (make a key here, send
only the sha256 of its secret), remove (the gateways close its connections), list.

Requests go to the control plane's admin verbs ``key_add``, ``key_rm`` and
``key_ls`` (``agents/control/apikeys.py``) as ``joynexus tenant add`` does.
See docs/ARCHITECTURE.md ("The policy gateway").
"""

from __future__ import annotations

from joynexus.broker import rpc
from joynexus.broker.connection import Broker
from joynexus.schemas.apikeys import ApiKeyInfo, KeyReply, KeyRequest, new_key
from joynexus.schemas.base import encode


async def key_request(b: Broker, verb: str, req: KeyRequest, *, timeout_s: float = 30.0) -> KeyReply:
    return await rpc.call(
        b, b.names.admin(verb), encode(req), rpc.checked(KeyReply, f"reply to {verb}"),
        timeout_s=timeout_s, retry=rpc.OPERATOR,
    )


async def add_key(
    b: Broker, tenant: str, *, workload: str = "", version: int = 0, label: str = ""
) -> tuple[str, ApiKeyInfo]:
    """A new key for ``tenant``: ``(the key, to print once; its record)``."""
    key_id, key, digest = new_key()
    reply = await key_request(b, "key_add", KeyRequest(
        tenant=tenant, key_id=key_id, secret_sha256=digest, workload=workload,
        version=version, label=label))
    assert reply.key is not None
    return key, reply.key


async def remove_key(b: Broker, tenant: str, key_id: str) -> ApiKeyInfo:
    reply = await key_request(b, "key_rm", KeyRequest(tenant=tenant, key_id=key_id))
    assert reply.key is not None
    return reply.key


async def list_keys(b: Broker, tenant: str = "") -> list[ApiKeyInfo]:
    return (await key_request(b, "key_ls", KeyRequest(tenant=tenant))).keys
