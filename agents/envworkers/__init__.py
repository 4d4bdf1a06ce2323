"""Environment workers: each RL workload's rollouts in processes of their own.

A ManiSkill step holds the GIL for its whole duration, so rollouts of
different tenants in one process run one after another. Here every RL
workload the service feeds gets worker processes of its own (as many as its
``scheduling.max_active_rollouts``), and their simulators run at the same
time.

* :class:`EnvSupervisor` is role ``producer-rl``. It owns a pool of worker
  processes (``joynexus agent env-worker --instance <sup>-w<k>``) under its own
  :class:`~joynexus.agents.health.HealthManager` (supervise mode, slots that
  come and go, heartbeats ``hb.env-worker.<instance>``): a worker that exits,
  stops beating or freezes is restarted in place, same instance, same
  arguments. It keeps ``spares`` warm idle workers (a worker's first rgb env
  starts the CPU renderer, 15-30 s here), hands them to workloads as they
  become active, takes them back when a workload is cancelled or done, and
  stops spares beyond the target. Its view (every slot with its workload) is
  ``mgr.<sup>`` in the health bucket, which ``joynexus status`` shows.
* The assignment of a worker is durable: key ``env.<instance>`` of the health
  bucket (:class:`Assignment`, written only by the supervisor). A restarted
  worker reads it and resumes the same workload.
* :class:`EnvWorker` is role ``env-worker``: warm up, announce ``ready``
  (a ``system`` metric, ``service="env-worker"``), then run an
  :class:`RLProducer` for whatever its assignment names; it reports a workload
  ``done`` when the scheduler refuses for the completion target and that many
  jobs completed. Every rollout is a busy interval (``service="env"``), the
  lanes of the main job's utilization plot.
* Jobs carry their producer (``metadata.extra["producer"]``): a restarted
  worker fails only the jobs its previous incarnation left reserved or
  producing (they hold admission slots), the supervisor fails those of a
  worker it removed and, when it starts, those of any worker of its previous
  incarnation. So a worker SIGKILLed mid-rollout loses no job (the job is
  failed, terminal) and none is trained twice (its data never reached
  ``needs_advantages``).

A cancelled workload's jobs all end in a bound: a worker taken off it fails its
rollout's job even inside a policy call that waits on a down engine; the
supervisor fails what a stopped worker left in the workload it *served*, and what
a standby worker still holds after ``JOYNEXUS_ENV_RELEASE_S``.

Knobs (environment): ``JOYNEXUS_ENV_SPARES`` (warm idle workers, default 1),
``JOYNEXUS_ENV_WORKERS_MAX`` (worker processes at most, default 8),
``JOYNEXUS_ENV_THREADS`` (compute threads per worker, default 1),
``JOYNEXUS_ENV_RELEASE_S`` (that grace, default 15 s).

One module per job: :mod:`.assign` (the role name, the knobs, :class:`Assignment`,
``worker_env``), :mod:`.worker` (:class:`EnvWorker`, ``warm_up``),
:mod:`.supervisor` (:class:`EnvSupervisor`); every name is re-exported here, the
worker's on first use (it imports torch; the supervisor does not). The producer a
worker runs is :class:`joynexus.agents.producers.rl.RLProducer` (with the SFT
producer it feeds the service; this package holds only the processes) and the
envs it keeps between workloads :class:`joynexus.agents.envs.pool.EnvPool`. See docs/ARCHITECTURE.md ("Environment workers").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from joynexus.agents.envworkers.assign import (
    ASSIGN_PREFIX,
    ENV_ROLE,
    MAX_WORKERS_ENV,
    RELEASE_GRACE_ENV,
    SPARES_ENV,
    THREADS_ENV,
    Assignment,
    assignment_key,
    worker_env,
    workers_wanted,
)
from joynexus.agents.envworkers.supervisor import EnvSupervisor

if TYPE_CHECKING:
    from joynexus.agents.envworkers.worker import EnvWorker, warm_up

#: The worker's names, imported on first use: the supervisor (role producer-rl)
#: stays light, without torch (docs/ARCHITECTURE.md, "Light roles").
_LAZY = {"EnvWorker": "worker", "warm_up": "worker"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ASSIGN_PREFIX",
    "ENV_ROLE",
    "MAX_WORKERS_ENV",
    "RELEASE_GRACE_ENV",
    "SPARES_ENV",
    "THREADS_ENV",
    "Assignment",
    "EnvSupervisor",
    "EnvWorker",
    "assignment_key",
    "warm_up",
    "worker_env",
    "workers_wanted",
]
