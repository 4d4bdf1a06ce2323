"""The operator's side of tenant slots: add (issue credentials), set (quota),
remove (revoke), list.

Requests go to the control plane on ``<ns>.admin.<verb>``, which only the
admin identity may publish to, and the replies come back to the operator's
own inbox prefix (``_INBOX.<ns>._admin``), which no other identity may read.
``joynexus tenant add acme`` generates the password here and sends only its
bcrypt hash; it writes the tenant's credentials file (owner-only) for the
operator to hand over.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import replace
from pathlib import Path

from joynexus.broker import rpc
from joynexus.broker.connection import Broker
from joynexus.broker.credentials import Credentials
from joynexus.broker.permissions import hash_password, new_password
from joynexus.schemas.base import encode
from joynexus.schemas.errors import JoyNexusError, Unavailable
from joynexus.schemas.identities import AdminReply, TenantInfo, TenantRequest
from joynexus.schemas.quotas import Quota


class NotApplied(JoyNexusError):
    """The control plane stored the change but no server confirmed applying it."""

    code = "not_applied"
    permanent = False


#: How long an operator request waits for a control plane that is not answering yet
#: (no responders: a deployment still starting, a control role restarting).
WAIT_FOR_CONTROL_S = 60.0


async def admin_request(
    b: Broker,
    verb: str,
    req: TenantRequest,
    *,
    timeout_s: float = 30.0,
    wait_s: float = WAIT_FOR_CONTROL_S,
) -> AdminReply:
    """One operator request; no responders is asked again for ``wait_s``
    (``broker.rpc.OPERATOR``), saying once on stderr that it waits."""
    subject = b.names.admin(verb)
    said: list[bool] = []

    def waiting(_e: BaseException, _sleep_s: float) -> None:
        if not said:
            said.append(True)
            print(
                f"waiting up to {wait_s:.0f}s for the control plane to answer on {subject} "
                "(is the deployment still starting?) ...",
                file=sys.stderr,
                flush=True,
            )

    def unanswered(e: Exception) -> Unavailable:
        return Unavailable(
            f"the control plane did not answer {verb} on {subject} ({type(e.__cause__ or e).__name__}): "
            "is the deployment up, and are you connected as the admin identity "
            "(--creds <data-dir>/credentials/admin.json)?"
        )

    return await rpc.call(
        b,
        subject,
        encode(req),
        rpc.checked(AdminReply, f"reply to {verb}"),
        timeout_s=timeout_s,
        retry=replace(rpc.OPERATOR, deadline_s=wait_s) if wait_s > 0 else rpc.ONCE,
        unanswered=unanswered,
        on_retry=waiting,
    )


async def add_tenant(
    b: Broker,
    tenant: str,
    *,
    url: str,
    rotate: bool = False,
    ca_file: str | None = None,
    quota: Quota | None = None,
) -> tuple[Credentials, AdminReply]:
    """Allocate ``tenant``'s slot and issue its NATS user; returns its credentials
    (not yet written anywhere) and the control plane's reply. The password is
    made here; only its hash is sent."""
    password = new_password()
    req = TenantRequest(tenant=tenant, rotate=rotate, quota=quota,
                        password_hash=await asyncio.to_thread(hash_password, password))
    reply = await admin_request(b, "tenant_add", req)
    assert reply.tenant is not None
    creds = Credentials(
        kind="tenant",
        tenant=tenant,
        namespace=b.names.namespace,
        url=url,
        user=reply.tenant.user,
        password=password,
        ca_file=ca_file,
    )
    return creds, reply


async def set_tenant(b: Broker, tenant: str, quota: Quota) -> AdminReply:
    """Change ``tenant``'s quota (its credentials stay)."""
    return await admin_request(b, "tenant_set", TenantRequest(tenant=tenant, quota=quota))


async def get_tenant(b: Broker, tenant: str) -> TenantInfo:
    for t in await list_tenants(b):
        if t.tenant_id == tenant:
            return t
    from joynexus.schemas.errors import UnknownTenant

    raise UnknownTenant(f"no tenant {tenant!r} (joynexus tenant ls lists them)")


async def remove_tenant(b: Broker, tenant: str, *, cancel_workloads: bool = True) -> AdminReply:
    return await admin_request(
        b, "tenant_remove", TenantRequest(tenant=tenant, cancel_workloads=cancel_workloads)
    )


def check_applied(reply: AdminReply, what: str) -> None:
    """Raise NotApplied when no server confirmed the change: the operator must know
    that a revocation has not taken effect."""
    if reply.applied == "pending":
        raise NotApplied(
            f"{what}: stored, but the server's auth sync did not confirm applying it in time, "
            "so it may NOT be in force yet; check the process that owns the server "
            "(its log names the record it could not apply) and run the command again"
        )


async def list_tenants(b: Broker) -> list[TenantInfo]:
    return (await admin_request(b, "tenant_list", TenantRequest())).tenants


def tenant_creds_path(data_dir: str | os.PathLike[str], namespace: str, tenant: str) -> Path:
    return Path(data_dir) / "tenants" / namespace / f"{tenant}.json"
