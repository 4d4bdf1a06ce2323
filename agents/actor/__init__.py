"""The actor, the one trainer, and the ``actor_forward`` stage before it.

``agent`` (the :class:`~joynexus.agents.actor.agent.Actor` loop: lease, group,
step, commit), ``decisions`` (its pure decisions, no torch), ``batch`` (the
tensors of one tenant's step), ``state`` (a tenant's state and checkpoint
bytes), ``custom`` and ``calls`` (a training client's calls: the loop's part
and the compute) and ``forward`` (the ``actor_forward`` stage, role
``actor-forward``).

Nothing is imported here: ``decisions`` stays free of torch, and a process that
only needs ``forward`` (an environment worker asking ``gaussian_head``) does not
load the trainer.
"""
