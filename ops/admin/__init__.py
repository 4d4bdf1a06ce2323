"""Operator tools behind ``joynexus`` commands: ``tenants`` (issue, revoke and list
credentials), ``status`` (tenants, jobs, queues, consumers), ``usage`` (usage per
tenant) and ``pretrain_base`` (``joynexus base``: the frozen base every tenant
is served)."""
