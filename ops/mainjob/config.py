"""The main job's configuration: the run's settings (:class:`PaperConfig`), the
tenants and their workloads of each round (:func:`plans`), where their datasets and
starting heads live, and a phase's result (:class:`PhaseResult`).

See docs/ARCHITECTURE.md, "The main job".
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from joynexus.broker.layout import (
    METRICS_MAX_BYTES_ENV,
    TQ_MAX_BYTES_ENV,
)
from joynexus.ops.runtime.roles import DEPLOYMENT_ROLES
from joynexus.schemas.workloads import Scheduling, WorkloadSpec

ROLES = DEPLOYMENT_ROLES  # the same deployment `joynexus up` starts
RL_TASKS = (("acme", "PickCube-v1"), ("bolt", "PushCube-v1"), ("cora", "LIBERO-spatial-0"))
SFT_TENANT = "dana"
#: The SFT tenant's dataset, in its dataset space under datasets_root(out).
SFT_DATASET = "pick"


def datasets_root(out: Path) -> Path:
    """Where a run's tenants' datasets live: ``<out>/data/<tenant>/<name>``."""
    return out / "data"
PAPER = {"device_time_ratio": 1.39, "train_util_ratio": 1.99, "infer_util_ratio": 1.33}

#: The stream caps of the demo's namespaces (the embedded server's own, and one per
#: phase), unless the environment sets them: the layout's defaults reserve 9 GiB a
#: namespace on the server's store, and a demo's Training Queue holds megabytes (its
#: rollouts are 2 envs x 8 steps; SFT batches of 16 small frames).
DEMO_STREAM_CAPS = {TQ_MAX_BYTES_ENV: "1G", METRICS_MAX_BYTES_ENV: "512M"}


def use_demo_stream_caps(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Give this process (and the roles it starts, which inherit its environment) the
    demo's stream caps where the environment sets none; call it before the embedded
    server's auth sync makes its namespace's layout."""
    for name, value in DEMO_STREAM_CAPS.items():
        if not environ.get(name, "").strip():
            environ[name] = value


@dataclass
class PaperConfig:
    rl_updates: int = 10
    sft_updates: int = 20
    num_envs: int = 2
    horizon: int = 8
    action_horizon: int = 2
    sft_batch: int = 16
    sft_episodes: int = 4
    eval_episodes: int = 2
    max_policy_staleness: int = 2
    phase_timeout_s: float = 600.0
    #: Environment worker processes per RL tenant (its max_active_rollouts), the
    #: same in the shared run and the isolated baseline.
    workers: int = 1
    #: Shared/isolated pairs measured (the median ratio is the headline).
    repeat: int = 1
    #: The LIBERO tenant's envs per rollout: a LIBERO step (MuJoCo, one 64 px camera)
    #: costs about 2.5 ManiSkill steps on this CPU, so one env of ``horizon`` steps
    #: keeps its rollouts of the same order as the ManiSkill tenants' (num_envs each).
    libero_num_envs: int = 1
    #: LIBERO episodes end after this many steps here (the suites' own limits are
    #: 280-520, ManiSkill's 50): it bounds the final evaluation's time.
    libero_max_steps: int = 50
    #: After the shared run (outside every window), ``eval_points`` versions of each
    #: ManiSkill RL tenant (1: its start, its last, evenly between) are evaluated,
    #: ``eval_episodes`` episodes each (``eval_num_envs`` side by side), pinned: its
    #: learning curve; the LIBERO tenant's ``libero_eval_points`` (its return curve).
    eval_points: int = 3
    libero_eval_points: int = 2
    #: LIBERO's episodes per point: one env, every episode its full 50 steps for a
    #: head that never succeeds (sparse reward: return 0), ~7 s each here; 10 took
    #: 178 s for the first point.
    libero_eval_episodes: int = 4
    eval_num_envs: int = 5
    #: RL from a trained head: the policy's learning rate (the SFT's 1e-3 would
    #: undo it in a few updates).
    rl_learning_rate: float = 1e-4
    #: The starting heads' demonstrations and SFT updates, as a share of
    #: ``RECIPES`` (runs under 2 minutes make tiny heads).
    head_scale: float = 1.0
    #: Updates per tenant of the warm-up round each phase runs before its first
    #: measured window (0: none). A deployment's first workloads pay what later ones
    #: do not (each worker's first build of its tenant's env, the first train step and
    #: forward of each head kind, the inference engine's first batches): in the shared
    #: run's first round that made the window 15-20% longer than its later rounds'.
    #: Both phases run the same warm-up, all tenants at once, outside every window.
    warmup_updates: int = 2

    @classmethod
    def for_minutes(cls, minutes: float, *, repeat: int = 1) -> PaperConfig:
        """Scale the work with the time asked for (4 minutes: 10 RL updates per RL
        tenant and 20 SFT updates per pair; the fixed costs, starting two
        deployments and evaluating, add about two minutes here)."""
        k = max(0.04, minutes / 4.0)
        rl_updates = max(1, round(10 * k))
        return cls(
            rl_updates=rl_updates,
            # A learning curve of three points per RL tenant in runs of 2 minutes and more.
            eval_points=3 if minutes >= 2 else 2,
            sft_updates=max(2, round(20 * k)),
            eval_episodes=2 if minutes < 2 else 10,
            head_scale=1.0 if minutes >= 2 else 0.02,
            phase_timeout_s=max(600.0, 300.0 * minutes),
            repeat=max(1, repeat),
            warmup_updates=2 if minutes >= 2 else 1,
        )


@dataclass
class TenantPlan:
    tenant: str
    spec: WorkloadSpec
    updates: int


@dataclass
class PhaseResult:
    name: str
    wall_s: float = 0.0
    busy: dict[str, float] = field(default_factory=lambda: {"train": 0.0, "infer": 0.0})
    #: CPU seconds the services computed in the window (the busy intervals' wall time
    #: stretches when services share the CPU; this does not).
    compute: dict[str, float] = field(default_factory=lambda: {"train": 0.0, "infer": 0.0})
    intervals: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    peak_rss_mb: dict[str, float] = field(default_factory=lambda: {"train": 0.0, "infer": 0.0})
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    losses: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    #: Inference batches in the window: (distinct tenants, requests) each.
    batches: list[tuple[int, int]] = field(default_factory=list)
    #: Environment steps the workers took in the window.
    env_steps: int = 0
    #: Per RL tenant (base name): (duration s, steps) of every rollout begun in the window.
    rollouts: dict[str, list[tuple[float, int]]] = field(default_factory=lambda: defaultdict(list))
    #: CPU seconds every process of the deployment used in the windows (and by role).
    cpu_s: float = 0.0
    cpu_s_by_role: dict[str, float] = field(default_factory=dict)
    #: Each role's peak RSS and start-to-ready seconds; all processes' peak RSS together.
    roles: dict[str, dict[str, float | None]] = field(default_factory=dict)
    peak_rss_mb_total: float = 0.0
    #: The learning-curve evaluations after the windows: every process's RSS
    #: together at its peak, and the evaluator's.
    eval_peak_rss_mb_total: float = 0.0
    eval_peak_rss_mb_evaluator: float = 0.0
    eval_wall_s: float = 0.0

    def mean_tenants_per_batch(self) -> float | None:
        return (
            round(sum(t for t, _ in self.batches) / len(self.batches), 3) if self.batches else None
        )

    def util(self, service: str) -> float:
        return self.busy[service] / self.wall_s if self.wall_s else 0.0

    def compute_util(self, service: str) -> float:
        return self.compute[service] / self.wall_s if self.wall_s else 0.0


def round_tenant(tenant: str, r: int) -> str:
    """Round ``r``'s name of a tenant (every round of ``--repeat`` gets fresh tenants,
    so each round's policies, evaluations and figures are its own): acme, acme1, ..."""
    return tenant if r == 0 else f"{tenant}{r}"


def base_tenant(tenant: str) -> str:
    return tenant.rstrip("0123456789")


def warmup_round(cfg: PaperConfig) -> int:
    """The round index of the warm-up tenants (after the measured rounds' names)."""
    return cfg.repeat


def warmup_plans(cfg: PaperConfig, dataset: str) -> list[TenantPlan]:
    """The warm-up round: the measured rounds' workloads (the same builds, heads and
    datasets) with ``warmup_updates`` updates each, under tenants of their own."""
    if cfg.warmup_updates <= 0:
        return []
    small = replace(cfg, rl_updates=cfg.warmup_updates, sft_updates=cfg.warmup_updates)
    return plans(small, dataset, warmup_round(cfg))


def plans(cfg: PaperConfig, dataset: str, r: int = 0) -> list[TenantPlan]:
    """The tenants' workloads of round ``r``; ``dataset`` names the SFT tenant's
    dataset inside its dataset space (``<datasets root>/<SFT_TENANT>/<dataset>``).
    The ManiSkill RL tenants start from their task's SFT head (``heads``:
    privileged state, as the demonstrations), its first updates critic-only."""
    out: list[TenantPlan] = []
    for base, env in RL_TASKS:
        tenant = round_tenant(base, r)
        from_head = env in RECIPES
        spec = WorkloadSpec(
            name="rl",
            task_type="rl",
            env=env,
            num_envs=cfg.libero_num_envs if env.startswith("LIBERO-") else cfg.num_envs,
            horizon=cfg.horizon,
            action_horizon=cfg.action_horizon,
            seed=len(out),
            scheduling=Scheduling(
                max_in_flight=max(2, cfg.workers + 1),
                max_active_rollouts=cfg.workers,
                max_policy_staleness=cfg.max_policy_staleness,
                completion_target=cfg.rl_updates,
            ),
        )
        if from_head:
            spec = msgspec.structs.replace(
                spec, init_from_export=init_path(env), state=["privileged"],
                learning_rate=cfg.rl_learning_rate, critic_warmup=max(1, cfg.rl_updates // 3),
            )
        out.append(TenantPlan(tenant, spec, cfg.rl_updates))
    spec = WorkloadSpec(
        name="sft",
        task_type="sft",
        dataset=dataset,
        batch_size=cfg.sft_batch,
        action_horizon=cfg.action_horizon,
        scheduling=Scheduling(max_in_flight=16, completion_target=cfg.sft_updates),
    )
    out.append(TenantPlan(round_tenant(SFT_TENANT, r), spec, cfg.sft_updates))
    return out




#: Where a round's RL tenant finds its starting head, inside its dataset space.
HEADS_DIR = "heads"
#: Per task: demonstrations and updates of its starting head (``heads``). PushCube: 60
#: demos and 200 updates succeed 10 of 10 here; PickCube: 150 demos and 300 updates
#: only 3 of 10, so 1000 (bench learning: 200 demos, 1500 updates, 0.92). An update
#: takes ~0.14 s here, the demonstrations ~1.1 s each: the first run makes both heads
#: in about 6 minutes.
RECIPES: dict[str, tuple[int, int]] = {"PickCube-v1": (150, 1000), "PushCube-v1": (60, 200)}


def init_path(task: str) -> str:
    """``init_from_export`` of an RL tenant on ``task`` (inside its dataset space)."""
    return f"{HEADS_DIR}/{task}"

def env_kind_of(env: str) -> str:
    return "libero" if env.startswith("LIBERO-") else "maniskill"
