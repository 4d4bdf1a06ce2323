"""``joynexus tenant add|set|rm|ls``: the operator issues, changes, revokes and lists
tenants' credentials and quotas (the admin identity; ``ops/admin/tenants.py``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from joynexus.ops.cli.common import common
from joynexus.ops.cli.tenantkeys import register_keys


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tenant",
        help="operator: issue, revoke and list tenants' credentials",
        description="Tenant slots (admin identity). `add` issues a tenant its NATS user and "
        "writes its credentials file (owner-only) for you to hand over; the server applies it "
        "without a restart. `rm` revokes it (the tenant's connections are closed) and cancels "
        "its active workloads.",
    )
    tsub = p.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    for action, text in (
        ("add", "issue credentials to a new tenant (or new ones with --rotate)"),
        ("set", "change a tenant's quota and priority class (--quota KEY=VALUE ...)"),
        ("rm", "revoke a tenant's credentials and cancel its active workloads"),
        ("ls", "list tenants with their quotas"),
    ):
        tp = tsub.add_parser(action, help=text, description=text)
        common(tp, embedded=False)
        tp.add_argument(
            "--data-dir",
            default=".jnx",
            help="where the deployment keeps credentials (default .jnx): admin credentials "
            "are read from <data-dir>/credentials/admin.json, tenants' written to "
            "<data-dir>/tenants/<namespace>/<tenant>.json",
        )
        if action != "ls":
            tp.add_argument("tenant", help="tenant name")
        if action == "add":
            tp.add_argument("--rotate", action="store_true", help="issue new credentials")
            tp.add_argument("--out", default=None, help="credentials file to write instead")
        if action in ("add", "set"):
            tp.add_argument(
                "--quota", action="append", default=[], metavar="KEY=VALUE",
                help="a bound on the tenant (repeatable), e.g. --quota tq_bytes=100000000 "
                "--quota priority_class=premium; keys: " + ", ".join(quota_keys()),
            )
        if action == "rm":
            tp.add_argument(
                "--keep-workloads", action="store_true", help="do not cancel its workloads"
            )
        if action == "ls":
            tp.add_argument("--json", action="store_true", help="print JSON")
        tp.set_defaults(run=run)
    register_keys(tsub)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_tenant_command(args))


def quota_keys() -> list[str]:
    from joynexus.schemas.quotas import Quota

    return list(Quota.__struct_fields__)


async def _tenant_command(args: argparse.Namespace) -> int:
    import msgspec

    from joynexus.broker.connection import Broker
    from joynexus.broker.credentials import from_env_or_file
    from joynexus.ops.admin.tenants import (
        add_tenant,
        check_applied,
        get_tenant,
        list_tenants,
        remove_tenant,
        set_tenant,
        tenant_creds_path,
    )
    from joynexus.schemas.errors import InvalidSpec
    from joynexus.schemas.quotas import parse_quota_args

    b = await Broker.connect(args.nats, name="joynexus-tenant", namespace=args.namespace)
    try:
        if args.tenant_command == "add":
            me = from_env_or_file(None)
            quota = parse_quota_args(args.quota) if args.quota else None
            creds, reply = await add_tenant(
                b, args.tenant, url=args.nats, rotate=args.rotate,
                ca_file=me.ca_file if me else None, quota=quota,
            )
            path = creds.save(
                Path(args.out) if args.out
                else tenant_creds_path(args.data_dir, args.namespace, args.tenant)
            )
            print(
                f"tenant {args.tenant}: NATS user {creds.user}; credentials written to {path} "
                "(owner-only). Hand them to the tenant: Client.connect(credentials=<file>)."
            )
            check_applied(reply, f"tenant {args.tenant}'s credentials")
        elif args.tenant_command == "set":
            if not args.quota:
                raise InvalidSpec("tenant set needs at least one --quota KEY=VALUE")
            current = await get_tenant(b, args.tenant)
            reply = await set_tenant(b, args.tenant, parse_quota_args(args.quota, current.quota))
            assert reply.tenant is not None and reply.tenant.quota is not None
            print(f"tenant {args.tenant}: quota now " + ", ".join(
                f"{k}={v}" for k, v in msgspec.structs.asdict(reply.tenant.quota).items()
            ))
        elif args.tenant_command == "rm":
            reply = await remove_tenant(b, args.tenant, cancel_workloads=not args.keep_workloads)
            check_applied(reply, f"revoking tenant {args.tenant}")
            print(
                f"tenant {args.tenant}: credentials revoked; its connections are closed"
                + (f"; cancelled workloads: {', '.join(reply.cancelled)}" if reply.cancelled else "")
            )
        else:
            tenants = await list_tenants(b)
            if args.json:
                import msgspec

                print(json.dumps([msgspec.to_builtins(t) for t in tenants]))
            elif not tenants:
                print("no tenants (add one: joynexus tenant add NAME --nats URL)")
            else:
                import time as _time

                from joynexus.schemas.quotas import DEFAULT_QUOTA

                print(f"{'TENANT':<20} {'USER':<28} {'ACTIVE/ALL':>10} {'CLASS':<9} "
                      f"{'TQ MiB':>7}  CREATED")
                for t in tenants:
                    q = t.quota or DEFAULT_QUOTA
                    created = _time.strftime("%Y-%m-%d %H:%M", _time.localtime(t.created_at))
                    counts = f"{t.active_workloads}/{t.workloads}"
                    print(f"{t.tenant_id:<20} {t.user:<28} {counts:>10} {q.priority_class:<9} "
                          f"{q.tq_bytes / 2**20:>7.0f}  {created}")
            return 0
        if reply.applied == "off":
            print("note: no auth sync answered: the server runs without authorization "
                  "(or is not a joynexus embedded server); anyone can connect", file=sys.stderr)
        return 0
    finally:
        await b.close()

