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


def _in_space(base: str, requested: str) -> str:
    """``requested`` (relative to the space ``base``, or absolute) resolved, symlinks
    followed; ValueError unless it is a directory inside ``base``."""
    cand = Path(requested)
    if not cand.is_absolute():
        cand = Path(base) / cand
    real = os.path.realpath(cand)
    if not _inside(real, base) or not os.path.isdir(real):
        raise ValueError("outside the space")
    return real


def _file_in_space(base: str, real: str, name: str, most: int) -> str:
    """``real/name`` resolved: a regular file inside ``base`` of at most ``most``
    bytes (ValueError otherwise)."""
    path = os.path.realpath(os.path.join(real, name))
    if not _inside(path, base) or not os.path.isfile(path) or os.path.getsize(path) > most:
        raise ValueError(name)
    return path


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
        real = _in_space(base, requested)
        for part in _DATASET_PARTS:
            p = os.path.join(real, part)
            if os.path.lexists(p) and not _inside(os.path.realpath(p), base):
                raise fail
        _file_in_space(base, real, os.path.join("meta", "info.json"), MAX_INFO_BYTES)
    except InvalidSpec:
        raise fail from None
    except (OSError, ValueError):
        raise fail from None
    return real


#: An exported head's files (``Client.export``) and the largest of each read.
EXPORT_FILES: dict[str, int] = {"head.safetensors": 256 << 20, "manifest.json": 1 << 20}


def no_export(tenant: str, requested: str) -> InvalidSpec:
    """The one refusal of an exported head's name, whatever went wrong."""
    shown = requested if len(requested) <= 200 else requested[:200] + "..."
    return InvalidSpec(
        f"tenant {tenant!r} has no exported head {shown!r} in its dataset space (a directory "
        "holding head.safetensors and manifest.json, as Client.export writes it; name it by "
        "its path inside your dataset space)"
    )


def resolve_export(
    root: Path | str, tenant: str, requested: str, override: str = ""
) -> str:
    """The absolute, symlink-free path of an exported head in ``tenant``'s dataset
    space (``WorkloadSpec.init_from_export``): a directory inside the space whose
    ``head.safetensors`` and ``manifest.json`` are regular files inside it too, of
    bounded size (:data:`EXPORT_FILES`). One generic :class:`InvalidSpec` otherwise."""
    fail = no_export(tenant, requested if isinstance(requested, str) else "")
    return _dir_with_files(root, tenant, requested, override, EXPORT_FILES, fail)


def _dir_with_files(root: Path | str, tenant: str, requested: str, override: str, files: dict[str, int],
                    fail: InvalidSpec) -> str:
    """``requested`` resolved to a directory inside ``tenant``'s space holding each of
    ``files`` as a regular file inside the space of at most its bytes; ``fail`` otherwise."""
    if not isinstance(requested, str) or not requested.strip() or "\x00" in requested:
        raise fail
    try:
        base = os.path.realpath(tenant_root(root, tenant, override))
        real = _in_space(base, requested)
        for name, most in files.items():
            _file_in_space(base, real, name, most)
    except (OSError, ValueError):
        raise fail from None
    return real


#: A LeRobot policy checkpoint's files (``WorkloadSpec.init_from_checkpoint``) and the largest
#: of each accepted (π0.5 at gemma_2b in float32 is ~13 GB).
CHECKPOINT_FILES: dict[str, int] = {"config.json": 1 << 20, "model.safetensors": 64 << 30}


def resolve_checkpoint(root: Path | str, tenant: str, requested: str, override: str = "") -> str:
    """The absolute, symlink-free path of a LeRobot checkpoint in ``tenant``'s dataset space
    (``WorkloadSpec.init_from_checkpoint``): a directory inside the space whose ``config.json``
    and ``model.safetensors`` are regular files inside it too, of bounded size
    (:data:`CHECKPOINT_FILES`). One generic :class:`InvalidSpec` otherwise, whatever the cause."""
    shown = requested if isinstance(requested, str) and len(requested) <= 200 else "..."
    fail = InvalidSpec(
        f"tenant {tenant!r} has no LeRobot checkpoint {shown!r} in its dataset space (a directory "
        "holding config.json and model.safetensors; name it by its path inside your dataset space)"
    )
    return _dir_with_files(root, tenant, requested, override, CHECKPOINT_FILES, fail)


__all__ = [
    "CHECKPOINT_FILES",
    "DATASETS_ENV",
    "EXPORT_FILES",
    "default_root",
    "no_dataset",
    "no_export",
    "resolve_checkpoint",
    "resolve_dataset",
    "resolve_export",
    "tenant_root",
]
