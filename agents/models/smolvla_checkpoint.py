"""A SmolVLA base loaded from a LeRobot policy directory (``--backbone-path DIR``): the layout
LeRobot's ``SmolVLAPolicy.save_pretrained`` writes, ``config.json`` and ``model.safetensors``.

The VLM's sizes are read from the tensors' shapes (never from ``vlm_model_name``, a hub
name): the text model's width, vocabulary, kept layers, key/value width and MLP width; the
vision tower's width, patch, positions, depth and MLP width; the connector's pixel shuffle;
``state_proj``'s state width. They must be one of ``SMOLVLM_SIZES`` (the sizes specs
name: ``smolvla-tiny``, ``smolvla-smolvlm2_500m``), which also fixes what shapes cannot
tell (heads, head size); the base is then built at that size and every VLM weight and
``state_proj`` loaded strictly. The expert's weights stay in the file: a tenant's
``smolvla_expert`` takes them (``init_smolvla_expert``: ``WorkloadSpec.init_from_checkpoint``,
the policy type, the base's size, the expert's width and every tensor checked). The instruction is tokenized with
the project's tokenizer, not the checkpoint's (nothing is downloaded), so a checkpoint
trained elsewhere reads different text ids.

See docs/ARCHITECTURE.md, "Model families: the SmolVLA base".
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from joynexus.agents.models.heads.smolvla import (
    EXPERT_PREFIX,
    PROJECTIONS,
    smolvla_expert_from_lerobot,
)
from joynexus.agents.models.lerobot_checkpoint import (
    family_of,
    load_expert,
    load_tensors,
    read_checkpoint,
)
from joynexus.agents.models.smolvla_base import SmolVLABase
from joynexus.agents.models.smolvla_config import SMOLVLM_SIZES, SmolVLABaseConfig
from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "VLM_PREFIX", "checkpoint_config", "checkpoint_geometry", "init_smolvla_expert", "load_smolvla_base", "size_geometry",
]

#: Where LeRobot's SmolVLAPolicy state dict keeps the VLM (``SmolVLMModel``'s own names follow).
VLM_PREFIX = "model.vlm_with_expert.vlm.model."
_STATE_PROJ = "model.state_proj."
#: A config.json larger than this is refused unread.
_MAX_CONFIG_BYTES = 1 << 20


def _count(keys: list[str], stem: str) -> int:
    pat = re.compile(re.escape(stem) + r"(\d+)\.")
    return len({m.group(1) for k in keys if (m := pat.match(k))})


def checkpoint_geometry(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The VLM's sizes as the tensors' shapes give them (``InvalidSpec`` if a tensor is missing)."""
    p = VLM_PREFIX
    try:
        vocab, width = shapes[p + "text_model.embed_tokens.weight"]
        vis, _, patch, _ = shapes[p + "vision_model.embeddings.patch_embedding.weight"]
        positions = shapes[p + "vision_model.embeddings.position_embedding.weight"][0]
        proj_in = shapes[p + "connector.modality_projection.proj.weight"][1]
        geo = {
            "vocab": vocab, "width": width,
            "layers": _count(list(shapes), p + "text_model.layers."),
            "kv_width": shapes[p + "text_model.layers.0.self_attn.k_proj.weight"][0],
            "q_width": shapes[p + "text_model.layers.0.self_attn.q_proj.weight"][0],
            "mlp": shapes[p + "text_model.layers.0.mlp.up_proj.weight"][0],
            "vision_width": vis, "patch": patch, "image_size": math.isqrt(positions) * patch,
            "vision_layers": _count(list(shapes), p + "vision_model.encoder.layers."),
            "vision_mlp": shapes[p + "vision_model.encoder.layers.0.mlp.fc1.weight"][0],
            "scale_factor": math.isqrt(proj_in // vis),
        }
        geo["state_dim"] = shapes[_STATE_PROJ + "weight"][1]
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        raise InvalidSpec(f"not a LeRobot SmolVLA checkpoint: a VLM tensor is missing or misshapen ({e})") from e
    return {k: int(v) for k, v in geo.items()}


def size_geometry(size: str, vocab: int) -> dict[str, int]:
    """``checkpoint_geometry``'s keys for a table size (less ``state_dim``)."""
    s = SMOLVLM_SIZES[size]
    t, v = s["text"], s["vision"]
    return {
        "vocab": t["vocab_size"] or vocab, "width": t["hidden_size"], "layers": s["num_vlm_layers"],
        "kv_width": t["num_key_value_heads"] * t["head_dim"], "q_width": t["num_attention_heads"] * t["head_dim"],
        "mlp": t["intermediate_size"], "vision_width": v["hidden_size"], "patch": v["patch_size"],
        "image_size": v["image_size"], "vision_layers": v["num_hidden_layers"],
        "vision_mlp": v["intermediate_size"], "scale_factor": s["scale_factor"],
    }


def checkpoint_config(path: str, threads: int | None = None, seed: int = 0) -> SmolVLABaseConfig:
    """The base config of a LeRobot SmolVLA policy directory, from its config.json and its
    tensors' shapes (no tensor is read): ``InvalidSpec`` unless it is one of the hosted sizes."""
    from safetensors import SafetensorError, safe_open

    from joynexus.agents.models.tokenizer import train_tokenizer

    cfg_file, weights = _files(path)
    if cfg_file.stat().st_size > _MAX_CONFIG_BYTES:
        raise InvalidSpec(f"{cfg_file}: larger than {_MAX_CONFIG_BYTES} bytes; not a policy config")
    try:
        conf: Any = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidSpec(f"{cfg_file}: not JSON ({e})") from e
    if not isinstance(conf, dict) or conf.get("type", "smolvla") != "smolvla":
        raise InvalidSpec(f"{cfg_file}: not a SmolVLA policy config (type {conf.get('type') if isinstance(conf, dict) else '?'!r})")
    text_max = conf.get("tokenizer_max_length", 48)
    if not isinstance(text_max, int) or isinstance(text_max, bool):
        raise InvalidSpec(f"{cfg_file}: tokenizer_max_length={text_max!r} is not an integer")
    try:
        with safe_open(str(weights), "pt") as f:
            geo = checkpoint_geometry({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    except SafetensorError as e:
        raise InvalidSpec(f"{weights}: not a safetensors file ({e})") from e
    vocab = len(train_tokenizer())
    size = next((s for s in SMOLVLM_SIZES
                 if size_geometry(s, vocab) == {k: v for k, v in geo.items() if k != "state_dim"}), None)
    if size is None:
        raise InvalidSpec(f"{weights}: its VLM ({geo}) is none of the hosted SmolVLM sizes "
                          f"{sorted(SMOLVLM_SIZES)}; specs could not name it")
    return SmolVLABaseConfig(size=size, max_state_dim=geo["state_dim"], max_text_tokens=text_max,  # type: ignore[arg-type]
                             threads=threads, seed=seed)


def _files(path: str) -> tuple[Path, Path]:
    d = Path(path)
    cfg_file, weights = d / "config.json", d / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise InvalidSpec(f"--backbone-path {path!r}: expected a LeRobot policy directory (config.json and "
                          "model.safetensors, as SmolVLAPolicy.save_pretrained writes)")
    return cfg_file, weights


def load_smolvla_base(path: str, threads: int | None = None, seed: int = 0) -> SmolVLABase:
    """The resident base of a LeRobot SmolVLA policy directory (see the module's doc)."""
    from safetensors import safe_open

    cfg = checkpoint_config(path, threads, seed)
    _, weights = _files(path)
    with safe_open(str(weights), "pt") as f:
        keys = list(f.keys())
        vlm = {k[len(VLM_PREFIX):]: f.get_tensor(k) for k in keys if k.startswith(VLM_PREFIX)}
        proj = {k[len(_STATE_PROJ):]: f.get_tensor(k) for k in keys if k.startswith(_STATE_PROJ)}
    base = SmolVLABase.build(cfg)
    try:
        base.model.load_state_dict({k: v.to(base.dtype) for k, v in vlm.items()}, strict=True)
        base.state_proj.load_state_dict({k: v.to(base.dtype) for k, v in proj.items()}, strict=True)
    except RuntimeError as e:
        raise InvalidSpec(f"{weights}: the VLM's weights do not load into smolvla-{cfg.size} ({e})") from e
    base.model.requires_grad_(False)
    base.state_proj.requires_grad_(False)
    return base


def init_smolvla_expert(head: Any, path: str) -> None:
    """``head`` (a ``smolvla_expert``) starts from the expert of the LeRobot ``SmolVLAPolicy``
    checkpoint at ``path``: its type ``smolvla``, its VLM's cache (kept layers, query and
    key/value widths) the one this head attends to, its expert as wide as ``head_hidden``;
    every expert weight loaded, finite, shapes equal. The normalisation buffers stay the head's."""
    if getattr(head, "type_name", "") != "smolvla_expert":
        raise InvalidSpec(f"a LeRobot SmolVLA checkpoint holds a smolvla_expert, not a "
                          f"{str(getattr(head, 'type_name', '?'))[:40]!r} head")
    ckpt = read_checkpoint(path)
    family_of(ckpt, "smolvla")
    try:
        geo = checkpoint_geometry(ckpt.shapes)
    except InvalidSpec as e:
        raise ckpt.bad(str(e)) from None
    g, c = head.geometry, head.cfg
    ours = (c.kv_layers, g["heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"])
    if (geo["layers"], geo["q_width"], geo["kv_width"]) != ours:
        raise ckpt.bad(f"its VLM ({geo['layers']} layers, q {geo['q_width']}, kv {geo['kv_width']}) is not this "
                       f"workload's base ({ours[0]} layers, q {ours[1]}, kv {ours[2]}): its expert cannot attend "
                       "to it (base_model must be the checkpoint's)")
    width = ckpt.shapes.get("model.action_in_proj.weight", (0, 0))[0]
    if width != c.hidden:
        raise ckpt.bad(f"its action expert is {width} wide, this workload's head_hidden is {c.hidden}; "
                       "give the checkpoint's width")
    sd = smolvla_expert_from_lerobot(load_tensors(ckpt, (EXPERT_PREFIX, *(f"model.{p}." for p in PROJECTIONS))))
    load_expert(ckpt, head, sd, "smolvla_expert")
