"""Tenants' dataset spaces: where an SFT workload's ``dataset`` may point.

A workload's ``dataset`` names a LeRobot dataset inside the tenant's own
directory (``<root>/<tenant>``, root ``$JOYNEXUS_DATASETS`` or
``.jnx/datasets``, or the quota's ``dataset_root``). The control plane resolves
it once, at create time (symlinks followed, containment checked), and stores
the absolute path; producers, the initializer and the evaluator read only that.
Every refusal is the same sentence whatever the cause, so a tenant learns
nothing about the machine's files from it.

See docs/ARCHITECTURE.md, "Tenants fenced by the broker".
"""

from __future__ import annotations

import os
from pathlib import Path

from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.jobs import check_name

DATASETS_ENV = "JOYNEXUS_DATASETS"
DEFAULT_DATASETS_ROOT = ".jnx/datasets"

#: Top-level entries of a LeRobot dataset that must not lead out of the tenant's space.
_DATASET_PARTS = ("meta", "data", "images", "videos")
#: A meta/info.json bigger than this is not a dataset's (it is read whole later).
MAX_INFO_BYTES = 4 << 20


def default_root() -> Path:
    """The service's datasets root: ``$JOYNEXUS_DATASETS``, else ``.jnx/datasets``."""
    return Path(os.environ.get(DATASETS_ENV) or DEFAULT_DATASETS_ROOT)


def tenant_root(root: Path | str, tenant: str, override: str = "") -> Path:
    """The directory of ``tenant``'s datasets: ``override`` (the operator's
    ``Quota.dataset_root``) if set, else ``<root>/<tenant>``."""
    check_name("tenant", tenant)  # a single path component, never '..' or '/'
    if override:
        return Path(override)
    return Path(root) / tenant


def no_dataset(tenant: str, requested: str) -> InvalidSpec:
    """The one refusal of a dataset name, whatever went wrong."""
    shown = requested if len(requested) <= 200 else requested[:200] + "..."
    return InvalidSpec(
        f"tenant {tenant!r} has no dataset {shown!r} (datasets live under your dataset "
        "space: name one by its path inside it; ask your operator)"
    )


def _inside(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


def resolve_dataset(
    root: Path | str, tenant: str, requested: str, override: str = ""
) -> str:
    """The absolute, symlink-free path of ``tenant``'s dataset ``requested``.

    ``requested`` is a path relative to the tenant's dataset space (see
    :func:`tenant_root`), or an absolute path inside it. The resolved path
    must stay inside the space and be a LeRobot dataset (``meta/info.json``
    a file); its top-level parts must not lead out of the space either.
    Anything else raises :class:`InvalidSpec` with one generic message.
    """
    fail = no_dataset(tenant, requested if isinstance(requested, str) else "")
    if not isinstance(requested, str) or not requested.strip() or "\x00" in requested:
        raise fail
    try:
        base = os.path.realpath(tenant_root(root, tenant, override))
        cand = Path(requested)
        if not cand.is_absolute():
            cand = Path(base) / cand
        real = os.path.realpath(cand)
        if not _inside(real, base) or not os.path.isdir(real):
            raise fail
        for part in _DATASET_PARTS:
            p = os.path.join(real, part)
            if os.path.lexists(p) and not _inside(os.path.realpath(p), base):
                raise fail
        info = os.path.join(real, "meta", "info.json")
        info_real = os.path.realpath(info)
        if not _inside(info_real, base) or not os.path.isfile(info_real):
            raise fail
        if os.path.getsize(info_real) > MAX_INFO_BYTES:
            raise fail
    except InvalidSpec:
        raise fail from None
    except (OSError, ValueError):
        raise fail from None
    return real


__all__ = [
    "DATASETS_ENV",
    "default_root",
    "no_dataset",
    "resolve_dataset",
    "tenant_root",
]
