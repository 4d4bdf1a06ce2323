"""The main job, ``joynexus demo``: the paper's mixed workload on one deployment,
then the same work one tenant at a time, then a report.

``config`` (the run's settings and each round's tenant plans), ``heads`` (the RL
tenants' starting heads, made once and cached), ``deployment`` (one process per
role, their RSS and CPU seconds), ``phases`` (a phase's measured windows and its
tenants' outcomes), ``accounting`` (busy time, CPU, batches and rollouts inside
the windows; the event log; the pair's figures), ``summary`` (the planner's
prediction, what limits the ratio, the printed table), ``report`` (report.md),
``plots`` (its figures) and ``run`` (the whole job). ``synthetic`` is ``joynexus demo
--synthetic``, the scheduler-only demo with synthetic workers."""
