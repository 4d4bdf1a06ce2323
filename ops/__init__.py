"""The operator layer: the ``joynexus`` command, embedded nats-server, deployments, benchmarks.

The top layer: it may import everything below and nothing imports it. See
docs/ARCHITECTURE.md, "Layout and import root" and "Processes".
"""
