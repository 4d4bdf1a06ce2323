"""Simulators (ManiSkill) and demonstration datasets (LeRobot format)."""
