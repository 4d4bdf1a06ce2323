"""Operator requests wait a little for a control plane that is still starting."""

from __future__ import annotations

import asyncio
import time

import pytest

from joynexus.broker.connection import Broker
from joynexus.ops.admin.tenants import admin_request
from joynexus.schemas.base import encode
from joynexus.schemas.errors import Unavailable
from joynexus.schemas.identities import AdminReply, TenantRequest


async def test_admin_request_waits_for_the_control_plane(
    broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="did not answer tenant_list"):
        await admin_request(broker, "tenant_list", TenantRequest(), wait_s=1.0)
    assert time.monotonic() - t0 >= 1.0
    assert "waiting up to 1s for the control plane" in capsys.readouterr().err

    async def late_control_plane() -> None:
        await asyncio.sleep(0.7)

        async def answer(msg: object) -> None:
            await msg.respond(encode(AdminReply()))  # type: ignore[attr-defined]

        await broker.nc.subscribe(broker.names.admin("tenant_list"), cb=answer)

    task = asyncio.create_task(late_control_plane())
    reply = await admin_request(broker, "tenant_list", TenantRequest(), wait_s=10.0)
    await task
    assert reply.error is None
