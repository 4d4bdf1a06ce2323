"""``joynexus tenant key add|rm|ls``: API keys of the policy gateway
(``joynexus agent gateway``), bound to one tenant and optionally one workload and
version; ``add`` prints the key once (only its hash is stored)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from joynexus.ops.cli.common import common


def register_keys(tsub: Any) -> None:
    kp = tsub.add_parser(
        "key",
        help="API keys of the policy gateway (openpi's websocket protocol)",
        description="API keys a tenant's robots or clients present to the policy gateway "
        "(`Authorization: Api-Key <key>`). `add` prints the key once; `rm` revokes it at "
        "once (open connections close); `ls` shows ids, scopes and last use.",
    )
    ksub = kp.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    for action, text in (
        ("add", "issue a key to a tenant (printed once)"),
        ("rm", "revoke a key (its open connections close)"),
        ("ls", "list keys: ids, scopes, last use"),
    ):
        p = ksub.add_parser(action, help=text, description=text)
        common(p, embedded=False)
        p.add_argument("--data-dir", default=".jnx",
                       help="admin credentials from <data-dir>/credentials/admin.json")
        p.add_argument("tenant", nargs="?" if action == "ls" else None, default="",
                       help="tenant name" + (" (ls: all tenants if omitted)" if action == "ls" else ""))
        if action == "add":
            p.add_argument("--workload", default="", help="the one workload the key may drive")
            p.add_argument("--version", type=int, default=0,
                           help="pin the key to this version (0: the latest)")
            p.add_argument("--label", default="", help="a note shown by ls")
        if action == "rm":
            p.add_argument("key_id", help="the key's id (ls shows it)")
        if action == "ls":
            p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(run=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    return asyncio.run(_keys(args))


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "never"


async def _keys(args: argparse.Namespace) -> int:
    import msgspec

    from joynexus.broker.connection import Broker
    from joynexus.ops.admin.apikeys import add_key, list_keys, remove_key

    b = await Broker.connect(args.nats, name="joynexus-tenant-key", namespace=args.namespace)
    try:
        if args.key_command == "add":
            key, info = await add_key(b, args.tenant, workload=args.workload,
                                      version=args.version, label=args.label)
            scope = f"workload {info.workload or '*'}, version {info.version or 'latest'}"
            print(f"tenant {args.tenant}: key {info.key_id} ({scope}); shown once, store it:")
            print(key)
        elif args.key_command == "rm":
            info = await remove_key(b, args.tenant, args.key_id)
            print(f"tenant {args.tenant}: key {info.key_id} revoked; its connections are closed")
        else:
            keys = await list_keys(b, args.tenant or "")
            if args.json:
                print(json.dumps([msgspec.to_builtins(k) for k in keys]))
            elif not keys:
                print("no keys (add one: joynexus tenant key add TENANT)")
            else:
                print(f"{'KEY':<13} {'TENANT':<16} {'WORKLOAD':<16} {'VERSION':>7}  "
                      f"{'CREATED':<19}  LAST USE")
                for k in keys:
                    print(f"{k.key_id:<13} {k.tenant_id:<16} {k.workload or '*':<16} "
                          f"{k.version or 'latest':>7}  {_when(k.created_at):<19}  "
                          f"{_when(k.last_used_at)}")
        return 0
    finally:
        await b.close()
