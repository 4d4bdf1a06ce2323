"""The parser of every command and ``main``: no command knows another.

Each command module's ``register(sub)`` adds its subparser (the order of
:data:`COMMANDS` is the order ``joynexus --help`` lists them) and sets ``run``;
``main`` parses, makes ``--creds`` this process's identity and calls ``args.run(args)``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType

from joynexus.ops.cli import agent, base, bench, demo, learning, plan, status, tenant, up, usage
from joynexus.ops.cli.common import use_credentials

#: The command modules, in the order `joynexus --help` lists their commands.
COMMANDS: tuple[ModuleType, ...] = (
    demo,  # demo
    up,  # up, server
    tenant,  # tenant add/set/rm/ls
    agent,  # agent ROLE
    status,  # status
    bench,  # bench NAME (bench learning: learning.register_bench)
    learning,  # dataset generate, evals
    usage,  # usage
    plan,  # plan
    base,  # base pretrain
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="joynexus",
        description="JoyNexus: multi-tenant post-training of VLA policies on NATS JetStream.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    # `up`/`server --config FILE` sets that command's defaults before parsing (up.apply_config).
    parser.set_defaults(_commands=dict(sub.choices))
    return parser


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        up.apply_config(parser, argv)
    except Exception as e:
        print(f"joynexus: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    _setup_logging(getattr(args, "verbose", False))
    try:
        use_credentials(args)
        code: int = args.run(args)
        return code
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from joynexus.schemas.errors import JoyNexusError

        if isinstance(e, JoyNexusError):
            print(f"joynexus: error: {e}", file=sys.stderr)
            return 2
        raise
