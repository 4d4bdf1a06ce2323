"""The resident base families and what each costs: ``describe`` (``joynexus base describe``).

``qwen2_5_vl`` (today's ``Backbone``: sizes ``tiny``, ``bench``), ``pi05`` (OpenPI's
PaliGemma prefix with a per-tenant action expert, ``Pi05Base``: ``tiny``, ``gemma_300m``,
``gemma_2b``) and ``smolvla`` (LeRobot SmolVLA's SmolVLM prefix with a per-tenant action
expert, ``SmolVLABase``: ``tiny``, ``smolvlm2_500m``, or a LeRobot policy directory).
Parameters are counted on the meta device, so a real-size description allocates no weights; prefix tokens come from the family's own tokenizer and layout.

See docs/ARCHITECTURE.md, "Model families: the π0.5 base" and "Model families: the SmolVLA base".
"""

from __future__ import annotations

import os
from typing import Any

import torch

from joynexus.schemas.catalog import BASE_FAMILIES, FAMILY_SIZES
from joynexus.schemas.errors import InvalidSpec

__all__ = ["KV_BUDGET_ENV", "build_base", "cache_row_cap", "check_base", "describe", "init_expert_head", "kv_budget_bytes"]

_INSTRUCTION = "push the cube to the goal region"


#: The memory one engine batch's prefix caches may take, in MB (``$JOYNEXUS_KV_BUDGET_MB``,
#: default 2048): a π0.5 engine's ``max_rows`` is cut so a full batch fits.
KV_BUDGET_ENV = "JOYNEXUS_KV_BUDGET_MB"


def kv_budget_bytes() -> int:
    raw = os.environ.get(KV_BUDGET_ENV, "2048") or "2048"
    try:
        mb = float(raw)
    except ValueError as e:
        raise InvalidSpec(f"${KV_BUDGET_ENV}={raw!r}: a number of MB") from e
    if not mb > 0:
        raise InvalidSpec(f"${KV_BUDGET_ENV}={raw!r}: must be > 0")
    return int(mb * 2**20)


def cache_row_cap(base: Any, max_rows: int, budget_bytes: int) -> int:
    """``max_rows`` cut so one batch's caches (each row at its largest prefix) fit in
    ``budget_bytes``; unchanged for a base that hands heads no per-layer cache."""
    if not getattr(base, "reads_state", False):
        return max_rows
    per_row = base.kv_bytes_per_row(base.max_prefix_tokens())
    return max(1, min(max_rows, budget_bytes // per_row))


def check_base(family: str, size: str, path: str | None = None) -> None:
    """``InvalidSpec`` unless ``family`` at ``size`` (or from ``path``: pi05, a LeRobot ``PI05Policy``
    checkpoint, ``pi05_checkpoint``) can be built here."""
    if family not in BASE_FAMILIES:
        raise InvalidSpec(f"base family {family!r}: choose one of {list(BASE_FAMILIES)}")
    if size not in FAMILY_SIZES[family]:
        raise InvalidSpec(f"{family} size {size!r}: choose one of {list(FAMILY_SIZES[family])}")
    if family == "pi05" and path is not None:  # its size is read from the tensors' shapes, not ``size``
        from joynexus.agents.models.pi05_checkpoint import read_pi05

        read_pi05(path)  # config.json and the safetensors header only: cheap, before any role starts


def build_base(family: str = "qwen2_5_vl", size: str = "tiny", path: str | None = None,
               threads: int | None = None) -> Any:
    """The resident base of a deployment: ``Backbone`` (qwen2_5_vl), ``Pi05Base`` (pi05) or
    ``SmolVLABase`` (smolvla). All serve the one interface the roles use: ``encode_tokens``,
    ``feature_dim``, ``config.base_model``, ``family``, ``num_params`` (and ``reads_state``,
    ``kv_bytes_per_row``, ``max_prefix_tokens`` for the prefix-cache families)."""
    check_base(family, size, path)
    if family == "pi05" and path is not None:
        from joynexus.agents.models.pi05_checkpoint import load_pi05_base

        return load_pi05_base(path, threads=threads)
    if family == "smolvla" and path is not None:  # a LeRobot policy directory: its shapes fix the size
        from joynexus.agents.models.smolvla_checkpoint import load_smolvla_base

        return load_smolvla_base(path, threads=threads)
    if family == "smolvla":
        from joynexus.agents.models.smolvla_base import SmolVLABase
        from joynexus.agents.models.smolvla_config import SmolVLABaseConfig

        return SmolVLABase.build(SmolVLABaseConfig(size=size, threads=threads))  # type: ignore[arg-type]
    if family == "pi05":
        from joynexus.agents.models.pi05_base import Pi05Base
        from joynexus.agents.models.pi05_config import Pi05BaseConfig

        return Pi05Base.build(Pi05BaseConfig(paligemma_variant=size, threads=threads,  # type: ignore[arg-type]
                                             image_size=56 if size == "tiny" else 224))
    from joynexus.agents.models.backbone import Backbone
    from joynexus.agents.models.backbone_config import BackboneConfig

    return Backbone.build(BackboneConfig(size=size, path=path, threads=threads))  # type: ignore[arg-type]


def _count(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def describe(family: str, size: str = "tiny", cameras: int = 1, state_dim: int = 8, action_dim: int = 7,
             action_horizon: int = 8, path: str | None = None) -> dict[str, Any]:
    """Family, parameters of the base and of one tenant's default head, prefix tokens per
    sample and the bytes per row a head receives from the shared forward (float32). ``path``
    (pi05, smolvla): a LeRobot policy directory, described from its config and shapes."""
    if path is not None and family == "qwen2_5_vl":
        raise InvalidSpec("describe --path: only a pi05 or smolvla base is described from a directory "
                          "(a LeRobot policy's), not qwen2_5_vl")
    check_base(family, size)
    if not 1 <= cameras <= 8 or not 1 <= state_dim <= 256:
        raise InvalidSpec("cameras must be in [1, 8] and state_dim in [1, 256]")
    from joynexus.agents.models.heads.base import HeadConfig, build_head

    if family == "smolvla":
        from joynexus.agents.models.smolvla_describe import describe_smolvla

        return describe_smolvla(size, cameras, state_dim, action_dim, action_horizon, kv_budget_bytes(), path)
    if family == "pi05":
        from joynexus.agents.models.pi05_describe import describe_pi05

        return describe_pi05(size, cameras, state_dim, action_dim, action_horizon, kv_budget_bytes(), path)
    # qwen2_5_vl
    from transformers import Qwen2_5_VLModel

    from joynexus.agents.models.backbone_config import build_qwen_config
    from joynexus.agents.models.tokenizer import train_tokenizer

    tok = train_tokenizer()
    qcfg = build_qwen_config(size, tok)
    with torch.device("meta"):
        base_params = _count(Qwen2_5_VLModel(qcfg))
    width = int(qcfg.text_config.hidden_size)
    tokens = 1 + cameras * (2 + (56 // 28) ** 2) + len(tok(_INSTRUCTION, add_special_tokens=False)["input_ids"]) + 1
    head_type, hcfg = "gr00t_flow", HeadConfig(width, state_dim, action_dim, action_horizon)
    row_bytes = tokens * (width + 1) * 4
    extra: dict[str, Any] = {"feature": "last hidden states", "feature_dim": width, "image_size": 56}
    with torch.device("meta"):
        head_params = _count(build_head(head_type, hcfg))
    return {"family": family, "size": size, "params": {"base": base_params, "head": head_params},
            "head": head_type, "cameras": cameras, "state_dim": state_dim,
            "prefix_tokens_per_sample": tokens, "kv_bytes_per_row": row_bytes, **extra}


def init_expert_head(head: torch.nn.Module, path: str) -> None:
    """``head`` (a ``pi05_expert`` or a ``smolvla_expert``) starts from the action expert of the
    LeRobot checkpoint at ``path``, read by its family's loader, which refuses a checkpoint of
    another policy type, a base of another size, another width or a tensor with NaN/inf."""
    if getattr(head, "type_name", "") == "smolvla_expert":
        from joynexus.agents.models.smolvla_checkpoint import init_smolvla_expert

        init_smolvla_expert(head, path)
    else:  # pi05_expert; any other head is refused there (check_lerobot_head)
        from joynexus.agents.models.pi05_checkpoint import init_expert

        init_expert(head, path)
