"""The operator layer: the ``joynexus`` command, embedded nats-server, deployments, benchmarks.

By job: ``cli`` (the command, one module per command), ``runtime`` (the embedded
nats-server, roles, the launcher, deployments, auth sync, threads, telemetry), ``admin`` (tenants, status, usage, the base model),
``mainjob`` (``joynexus demo``), ``plan`` (the capacity planner), ``bench``
(benchmarks) and ``isolation`` (the attack catalogue).

The top layer: it may import everything below and nothing imports it. See
docs/ARCHITECTURE.md, "Layout and import root" and "Processes".
"""
