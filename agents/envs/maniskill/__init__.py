"""ManiSkill3 simulators for RL rollouts and evaluation, on CPU backends.

The RL producers and the evaluator run a tenant's task here (PickCube-v1,
PushCube-v1, StackCube-v1). One module per job; this package re-exports
every name, so ``from joynexus.agents.envs.maniskill import make_env`` keeps
working. Importing it points the Vulkan loader at lavapipe (``rendering``)
before anything imports sapien. See docs/ARCHITECTURE.md, "Layout and import
root" (the modules) and "Simulators by name: ManiSkill and LIBERO".

    rendering   configure_cpu_rendering, the renderer keep-alive
    tasks       TaskInfo, TASKS, state entries and presets (pure)
    spec        EnvSpec, task_spec, the observation and policy types (pure)
    batched     BatchedEnv, StepResult: the batch API every simulator shares
    privileged  the "extra/*" state entries read off a scene
    env         ManiSkillEnv, make_env
    rollout     rollout, rollout_fields, policy_obs, episode_seed, the action check
    episodes    run_episodes, evaluate, random_policy, EpisodeControl, FrameRecorder
"""

from __future__ import annotations

from joynexus.agents.envs.maniskill.batched import BatchedEnv, StepResult
from joynexus.agents.envs.maniskill.env import ManiSkillEnv, make_env
from joynexus.agents.envs.maniskill.episodes import (
    EpisodeControl,
    FrameRecorder,
    evaluate,
    random_policy,
    run_episodes,
)
from joynexus.agents.envs.maniskill.rendering import configure_cpu_rendering
from joynexus.agents.envs.maniskill.rollout import (
    episode_seed,
    policy_obs,
    rollout,
    rollout_fields,
)
from joynexus.agents.envs.maniskill.spec import (
    TASK,
    ActFn,
    EnvSpec,
    ObsBatch,
    ObsMode,
    check_env_args,
    task_spec,
)
from joynexus.agents.envs.maniskill.tasks import (
    STATE_PRESETS,
    TASKS,
    TaskInfo,
    expand_state_keys,
    resolve_state_keys,
    state_key_dims,
)
from joynexus.schemas.samples import ACTION, OBS_IMAGES, OBS_STATE, tq_field

__all__ = [
    "ACTION",
    "OBS_IMAGES",
    "OBS_STATE",
    "STATE_PRESETS",
    "TASK",
    "TASKS",
    "ActFn",
    "BatchedEnv",
    "EnvSpec",
    "EpisodeControl",
    "FrameRecorder",
    "ManiSkillEnv",
    "ObsBatch",
    "ObsMode",
    "StepResult",
    "TaskInfo",
    "check_env_args",
    "configure_cpu_rendering",
    "episode_seed",
    "evaluate",
    "expand_state_keys",
    "make_env",
    "policy_obs",
    "random_policy",
    "resolve_state_keys",
    "rollout",
    "rollout_fields",
    "run_episodes",
    "state_key_dims",
    "task_spec",
    "tq_field",
]
