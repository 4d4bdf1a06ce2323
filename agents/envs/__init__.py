"""Simulators by name (ManiSkill, LIBERO) and demonstration datasets (LeRobot format).

Callers build envs through ``registry.make_env`` / ``registry.task_spec``,
which pick the simulator from the env name; ``lerobot_data`` writes and reads
demonstration datasets. Nothing heavy is imported here (a simulator takes
seconds to import): import the submodule you need.

See docs/ARCHITECTURE.md, "Simulators by name: ManiSkill and LIBERO".
"""
