"""The ``joynexus`` command: launcher, agents, demo, status and benchmarks.

Every command that needs NATS takes ``--nats URL``; without it, commands that
run a deployment start an embedded nats-server (JetStream, file store) and
stop it on exit, leaving nothing running.

One module per command (or group of related commands), each with
``register(sub)``: it adds its subparser and sets ``run`` (the runner, which
returns the exit status) as the subparser's default; :mod:`.app` builds the
parser from :data:`~joynexus.ops.cli.app.COMMANDS` and calls ``args.run(args)``.
"""

from joynexus.ops.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
