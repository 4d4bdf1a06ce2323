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
#: Environments the workers build and reset once before they say they are ready,
#: comma-separated, one per worker in turn (worker k: the k-th, wrapping); the
#: supervisor gives a workload a worker warmed for its simulator kind first. Default
#: PickCube-v1 (ManiSkill's CPU renderer). The first env of a kind in a process pays
#: its imports, renderer and assets (here ManiSkill 18 s, LIBERO 40 s; the next one of
#: the kind 2-3 s), and holds their memory (a worker with both kinds loaded: ~3.5 GB,
#: one: ~1.4-2 GB): name a kind as often as the tenants using it want workers.
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


def worker_env(warm: str | None = None) -> dict[str, str]:
    """A worker's compute threads (default 1): several workers share the cores, and
    a simulator step gains little from intra-op threads while oversubscribed
    threads cost every process on the machine; and the env it warms (``warm``)."""
    n = os.environ.get(THREADS_ENV, "1")
    out = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, THREADS_ENV: n}
    if warm:
        out[WARM_ENV] = warm
    return out


def warm_for(k: int, plan: tuple[str, ...]) -> str:
    """The env the ``k``-th worker a supervisor starts warms: the plan in turn."""
    return plan[k % len(plan)]


def prefer_warmed(idle: list[str], kind: str, warmed: dict[str, str],
                  warm: set[str], *, env: str = "",
                  pooled: dict[str, set[str]] | None = None) -> list[str]:
    """Idle workers in the order a workload of simulator ``kind`` (env ``env``) should
    take them: one keeping ``env`` built (``pooled``: instance -> env names it keeps)
    first, then warmed for its kind (one still starting will be; another kind's would
    pay this kind's first env, 18-40 s), started before still starting."""
    pooled = pooled or {}
    return sorted(idle, key=lambda i: (env not in pooled.get(i, ()), warmed.get(i) != kind,
                                       i not in warm))


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


def workers_wanted(rec: WorkloadRecord) -> int:
    return max(1, int(rec.spec.scheduling.max_active_rollouts))
