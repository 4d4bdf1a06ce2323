"""Simulators (ManiSkill) and demonstration datasets (LeRobot format).

- ``maniskill``: ``make_env`` (CPU physics + lavapipe rendering), ``rollout``
  (async, N x horizon samples for a Training Queue put), ``evaluate``.
- ``experts``: scripted privileged-state experts (``ScriptedExpert``).
- ``lerobot_data``: ``generate_dataset`` (expert demos -> LeRobot v3.0 dataset)
  and ``load_dataset`` (offline, a torch Dataset of training frames).

Nothing heavy is imported here; import the submodule you need.
"""
