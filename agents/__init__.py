"""The agents: each role of the service as a process that consumes and publishes
JetStream events (docs/ARCHITECTURE.md).

One package or module per role: ``scheduler`` (admission and leases), ``actor``
(the trainer and its actor_forward stage), ``advantage`` (the advantage stage),
``inference`` (the shared-encoder Inference Queue), ``producers`` and ``envworkers``
(SFT batches and simulator rollouts), ``evaluator``, ``control`` (the tenants'
control plane), ``monitor`` and ``health`` (restarts failed roles in place). Their shared pieces:
``models`` (the resident base and the tenants' heads), ``envs`` (ManiSkill and
LIBERO), ``datasets`` (LeRobot demonstrations)."""
