"""A burst of one tenant's control-plane requests past its in-flight bound (issue 24's
``request_flood``): refused at the door (``ControlPlane._handle`` asks
``Server.busy`` before any other check), every refusal still answered, in turn with
other tenants' work; and the door's shortcut still drops a reply aimed at another
tenant's inbox."""

from __future__ import annotations

import asyncio
from typing import Any

from test_positions import control_and_client

from joynexus.broker.connection import Broker
from joynexus.schemas.base import decode
from joynexus.schemas.workloads import ApiReply


async def test_a_burst_past_the_bound_is_refused_at_the_door_and_others_go_on(
    broker: Broker, tmp_path: Any
) -> None:
    async with control_and_client(broker, tmp_path, tenant="bolt") as (control, bolt):
        n, nc = broker.names, broker.nc
        codes: list[str] = []
        stolen: list[str] = []
        done = asyncio.Event()

        async def got(m: Any) -> None:
            r = decode(m.data, ApiReply)
            codes.append(r.error.code if r.error else "ok")
            if len(codes) >= 2000:
                done.set()

        async def steal(m: Any) -> None:
            stolen.append(m.subject)

        await nc.subscribe(f"{n.inbox_prefix('acme')}.flood.>", cb=got, pending_msgs_limit=100_000)
        await nc.subscribe(f"{n.inbox_prefix('bolt')}.stolen.>", cb=steal)
        await nc.flush()
        refused0 = control.rpc.refused
        for i in range(2000):
            await nc.publish(n.api("acme", "list_workloads"), b"{}",
                             reply=f"{n.inbox_prefix('acme')}.flood.{i}")
            if i == 1000:  # while acme is at its bound: a reply aimed at bolt's inbox
                for j in range(5):
                    await nc.publish(n.api("acme", "list_workloads"), b"{}",
                                     reply=f"{n.inbox_prefix('bolt')}.stolen.{j}")
        await nc.flush()
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(bolt.list_workloads(), 10) == []
        bolt_s = asyncio.get_running_loop().time() - t0
        before_bolt = len(codes)
        await asyncio.wait_for(done.wait(), 30)
        await asyncio.sleep(0.3)
        assert set(codes) <= {"ok", "rate_limited"} and len(codes) == 2000
        assert codes.count("rate_limited") > 1000 and codes.count("ok") >= 1
        assert before_bolt < 1900, f"bolt answered after {before_bolt} of acme's 2000"
        assert bolt_s < 5.0
        assert stolen == [] and control.rpc.refused >= refused0 + 5
        assert control.rpc.refusals_dropped == 0
        # acme's own calls work once its burst is answered
        assert control.rpc.in_flight.get("acme", 0) == 0
