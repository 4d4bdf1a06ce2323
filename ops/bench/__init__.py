"""Benchmarks that print figures (JSON), ``joynexus bench <name>``: one module per
benchmark, ``stats`` (interleaved arms, intervals, the one ``percentile``) and
``server`` (the embedded nats-server of a run without ``--nats``)."""
