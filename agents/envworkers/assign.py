"""What the supervisor and its workers share: the role name, the knobs, a
worker's durable assignment (``env.<instance>`` in the health bucket) and how
many workers a workload wants."""

from __future__ import annotations

import os

import msgspec

from joynexus.schemas.workloads import WorkloadRecord

ENV_ROLE = "env-worker"
#: Key prefix of the assignments in the health bucket: ``env.<instance>``.
ASSIGN_PREFIX = "env."
SPARES_ENV = "JOYNEXUS_ENV_SPARES"
MAX_WORKERS_ENV = "JOYNEXUS_ENV_WORKERS_MAX"
#: Seconds a worker taken off a workload has to end its own rollout before its
#: supervisor fails whatever job of that workload it still holds.
RELEASE_GRACE_ENV = "JOYNEXUS_ENV_RELEASE_S"


THREADS_ENV = "JOYNEXUS_ENV_THREADS"
#: Environments every worker builds and resets once before it says it is ready,
#: comma-separated (default: PickCube-v1, which starts ManiSkill's CPU renderer).
#: The first env of a kind in a process pays its imports, renderer and assets (here
#: ManiSkill 18 s, LIBERO 40 s; the next one of the kind 2-3 s): a deployment whose
#: tenants use LIBERO names a LIBERO task too, or its first rollout pays it.
WARM_ENV = "JOYNEXUS_ENV_WARM"
DEFAULT_WARM = ("PickCube-v1",)


def warm_envs(environ: os._Environ[str] | dict[str, str] = os.environ) -> tuple[str, ...]:
    """The envs a worker warms (``$JOYNEXUS_ENV_WARM``), each a name a workload may
    give; ValueError naming the valid ones for any other."""
    raw = environ.get(WARM_ENV, "").strip()
    if not raw:
        return DEFAULT_WARM
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    from joynexus.agents.envs.registry import valid_envs

    valid = set(valid_envs())
    bad = [n for n in names if n not in valid]
    if bad:
        raise ValueError(
            f"${WARM_ENV}: {', '.join(bad)} not an environment name; use names such as "
            "PickCube-v1 or LIBERO-spatial-0 (`joynexus envs` lists them)"
        )
    return names


def worker_env() -> dict[str, str]:
    """A worker's compute threads (default 1): several workers share the cores, and
    a simulator step gains little from intra-op threads while oversubscribed
    threads cost every process on the machine."""
    n = os.environ.get(THREADS_ENV, "1")
    out = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, THREADS_ENV: n}
    if os.environ.get(WARM_ENV):
        out[WARM_ENV] = os.environ[WARM_ENV]
    return out


def assignment_key(instance: str) -> str:
    return f"{ASSIGN_PREFIX}{instance}"


class Assignment(msgspec.Struct, kw_only=True):
    """What one worker runs (value of ``env.<instance>``; the supervisor writes it)."""

    #: ``<tenant>.<workload>`` (a key of the workloads bucket); "" = standby.
    workload: str = ""
    #: The workload it served before this one (a restarted worker fails its orphans
    #: there too: a worker killed just after being taken off a cancelled workload).
    previous: str = ""
    supervisor: str = ""
    at: float = 0.0


def _workers_wanted(rec: WorkloadRecord) -> int:
    return max(1, int(rec.spec.scheduling.max_active_rollouts))
