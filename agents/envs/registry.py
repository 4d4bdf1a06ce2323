"""Simulators by name: one ``make_env`` for every environment a workload may name.

* ManiSkill tasks keep their ids: ``PickCube-v1``, ``PushCube-v1``, ``StackCube-v1``
  (:mod:`joynexus.agents.envs.maniskill`).
* LIBERO tasks are ``LIBERO-<suite>-<i>``: suite spatial, object, goal or 10
  (i in 0..9) or 90 (i in 0..89) (:mod:`joynexus.agents.envs.libero`; what
  each task is, without a simulator: :mod:`joynexus.agents.envs.libero_tasks`).

Both kinds return an env with the same surface (``spec``, ``reset``,
``reset_one``, ``step``, ``replace_obs``, ``close``), so ``rollout``, the
evaluator's episode loop and the producers run either unchanged. A name that
is neither is refused with the list of valid ones (:func:`valid_envs`). The
names themselves are checked without importing a simulator
(``joynexus.schemas.workloads``), so a spec is refused at the door.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from joynexus.agents.envs.maniskill import EnvSpec, ObsMode
from joynexus.schemas.catalog import RL_ENVS, describe_envs, libero_task, valid_env_names
from joynexus.schemas.errors import InvalidSpec

EnvKind = Literal["maniskill", "libero"]


def valid_envs() -> tuple[str, ...]:
    """Every env name a workload may give (ManiSkill's, then LIBERO's 130)."""
    return valid_env_names()


def env_kind(name: str) -> EnvKind:
    """Which simulator runs ``name``; InvalidSpec naming the valid envs if none does."""
    if name in RL_ENVS:
        return "maniskill"
    if libero_task(name) is not None:
        return "libero"
    raise InvalidSpec(f"unknown env {name!r:.80}: choose one of {describe_envs()}")


def task_spec(
    name: str,
    *,
    obs: ObsMode = "state",
    num_envs: int = 1,
    image_size: int = 64,
    control_mode: str | None = None,
    cameras: Sequence[str] | None = None,
    state_keys: Sequence[str] | None = None,
) -> EnvSpec:
    """Validate a request and describe the env it builds (its schema), without building it."""
    kw: dict[str, Any] = dict(
        obs=obs, num_envs=num_envs, image_size=image_size, cameras=cameras, state_keys=state_keys
    )
    if control_mode is not None:
        kw["control_mode"] = control_mode
    if env_kind(name) == "libero":
        from joynexus.agents.envs import libero_tasks

        return libero_tasks.task_spec(name, **kw)
    from joynexus.agents.envs import maniskill

    return maniskill.task_spec(name, **kw)


def state_key_dims(name: str) -> dict[str, int]:
    """Every state entry env ``name`` can give, with its size."""
    if env_kind(name) == "libero":
        from joynexus.agents.envs import libero_tasks

        return libero_tasks.state_key_dims(name)
    from joynexus.agents.envs import maniskill

    return maniskill.state_key_dims(name)


def resolve_state_keys(name: str, keys: Sequence[str]) -> tuple[str, ...]:
    """State presets ("proprio", "privileged") of env ``name`` expanded into its keys."""
    if env_kind(name) == "libero":
        from joynexus.agents.envs import libero_tasks

        return libero_tasks.resolve_state_keys(name, keys)
    from joynexus.agents.envs import maniskill

    return maniskill.resolve_state_keys(name, keys)


def make_env(
    name: str,
    *,
    obs: ObsMode = "state",
    num_envs: int = 1,
    image_size: int = 64,
    control_mode: str | None = None,
    seed: int | None = None,
    cameras: Sequence[str] | None = None,
    state_keys: Sequence[str] | None = None,
    shadows: bool = False,
    **kwargs: Any,
) -> Any:
    """Build ``num_envs`` envs of ``name`` (see the module docstring for the names).

    The arguments mean the same for every simulator; ``control_mode`` defaults
    to the simulator's own (ManiSkill ``pd_ee_delta_pos``, LIBERO ``osc_pose``);
    ``shadows`` applies to LIBERO (off by default: cheaper to render; so are
    reflections, ``reflections=True``);
    other keyword arguments go to the simulator's own ``make_env``.
    """
    kw: dict[str, Any] = dict(
        obs=obs,
        num_envs=num_envs,
        image_size=image_size,
        seed=seed,
        cameras=cameras,
        state_keys=state_keys,
        **kwargs,
    )
    if control_mode is not None:
        kw["control_mode"] = control_mode
    if env_kind(name) == "libero":
        from joynexus.agents.envs import libero

        return libero.make_env(name, shadows=shadows, **kw)
    from joynexus.agents.envs import maniskill

    return maniskill.make_env(name, **kw)


__all__ = [
    "EnvKind",
    "env_kind",
    "make_env",
    "resolve_state_keys",
    "state_key_dims",
    "task_spec",
    "valid_envs",
]
