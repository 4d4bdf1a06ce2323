"""What runs a deployment: ``roles`` (every agent role by name), ``launcher``
(``joynexus up``: one process per role under the health manager), ``deploy``
(an embedded or given nats-server, with authorization and its ``authsync``),
``threads`` (each role's compute threads), ``telemetry`` (trace export) and
``roleprobe`` (one role in a probe process, for the light-roles check). The
embedded nats-server itself is ``ops/runtime/natsserver.py``."""
