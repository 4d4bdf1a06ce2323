"""CPU rendering for ManiSkill: the Vulkan loader pointed at lavapipe, one renderer kept alive.

A module of its own because it must act first: the Vulkan loader reads
``VK_ICD_FILENAMES`` when SAPIEN is first imported, so ``configure_cpu_rendering``
runs when ``joynexus.agents.envs.maniskill`` is imported, before anything can
import sapien. Why and what it costs: docs/ARCHITECTURE.md, "Simulators by name:
ManiSkill and LIBERO" (ManiSkill on the CPU).
"""

from __future__ import annotations

import glob
import os
from typing import Any


def configure_cpu_rendering() -> str | None:
    """Point the Vulkan loader at lavapipe (Mesa's CPU driver) if nothing is set.

    Returns the ICD file in use, or None when lavapipe is not installed or an
    NVIDIA driver is (then SAPIEN uses whatever Vulkan driver the machine has).
    Idempotent; the caller's own ``VK_ICD_FILENAMES`` always wins.
    """
    if os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES"):
        return os.environ.get("VK_ICD_FILENAMES") or os.environ.get("VK_DRIVER_FILES")
    # A machine with an NVIDIA driver renders on its GPU; leave the loader alone.
    # (Mesa's other ICDs, intel/radeon, come with lavapipe everywhere, so only
    # NVIDIA's says that a real device is there.)
    for icd_dir in ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d"):
        if glob.glob(f"{icd_dir}/nvidia_icd*.json"):
            return None
    # Mesa 25 names it lvp_icd.json, older packages lvp_icd.<arch>.json.
    for pattern in ("/usr/share/vulkan/icd.d/lvp_icd*.json", "/etc/vulkan/icd.d/lvp_icd*.json"):
        found = sorted(glob.glob(pattern))
        if found:
            os.environ["VK_ICD_FILENAMES"] = found[0]
            return found[0]
    return None


configure_cpu_rendering()


_RENDER_KEEPALIVE: list[Any] = []


def keep_renderer_alive() -> None:
    """Hold one SAPIEN render system for the life of the process.

    SAPIEN tears its Vulkan renderer down when the last env that uses it is
    closed, and the first picture after a restart compiles every shader
    pipeline again: ~10 s on lavapipe (30 s on a busy 2-core machine). With
    this reference alive, later rgb envs start in < 1 s.
    """
    if not _RENDER_KEEPALIVE:
        import sapien

        _RENDER_KEEPALIVE.append(sapien.render.RenderSystem(sapien.Device("cpu")))


def quiet_maniskill_logs() -> None:
    import logging

    # "panda_wristcam is not in the task's list of supported robots": it is the
    # same arm with a camera; the warning repeats per env.
    logging.getLogger("mani_skill").setLevel(logging.ERROR)


