"""The operator's side of tenant slots: add (issue credentials), remove (revoke), list.

Requests go to the control plane on ``<ns>.admin.<verb>``, which only the
admin identity may publish to. ``joynexus tenant add acme`` writes the
tenant's credentials file (owner-only) for the operator to hand over.
"""

from __future__ import annotations

import os
from pathlib import Path

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.schemas.base import decode, encode
from joynexus.schemas.errors import Unavailable, error_from_code
from joynexus.schemas.identities import AdminReply, TenantInfo, TenantRequest


async def admin_request(
    b: Broker, verb: str, req: TenantRequest, *, timeout_s: float = 30.0
) -> AdminReply:
    subject = b.names.admin(verb)
    try:
        msg = await b.nc.request(subject, encode(req), timeout=timeout_s)
    except (NoRespondersError, NatsTimeout, TimeoutError) as e:
        raise Unavailable(
            f"the control plane did not answer {verb} on {subject} ({type(e).__name__}): is "
            "the deployment up, and are you connected as the admin identity "
            "(--creds <data-dir>/credentials/admin.json)?"
        ) from e
    reply = decode(msg.data, AdminReply, what=f"reply to {verb}")
    if reply.error is not None:
        raise error_from_code(reply.error.code, reply.error.message)
    return reply


async def add_tenant(
    b: Broker,
    tenant: str,
    *,
    url: str,
    rotate: bool = False,
    ca_file: str | None = None,
) -> tuple[Credentials, AdminReply]:
    """Allocate ``tenant``'s slot and issue its NATS user; returns its credentials
    (not yet written anywhere) and the control plane's reply."""
    reply = await admin_request(b, "tenant_add", TenantRequest(tenant=tenant, rotate=rotate))
    assert reply.tenant is not None
    creds = Credentials(
        kind="tenant",
        tenant=tenant,
        namespace=b.names.namespace,
        url=url,
        user=reply.tenant.user,
        password=reply.password,
        ca_file=ca_file,
    )
    return creds, reply


async def remove_tenant(b: Broker, tenant: str, *, cancel_workloads: bool = True) -> AdminReply:
    return await admin_request(
        b, "tenant_remove", TenantRequest(tenant=tenant, cancel_workloads=cancel_workloads)
    )


async def list_tenants(b: Broker) -> list[TenantInfo]:
    return (await admin_request(b, "tenant_list", TenantRequest())).tenants


def tenant_creds_path(data_dir: str | os.PathLike[str], namespace: str, tenant: str) -> Path:
    return Path(data_dir) / "tenants" / namespace / f"{tenant}.json"
