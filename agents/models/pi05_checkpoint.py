"""A LeRobot ``PI05Policy`` checkpoint as the resident π0.5 base and as a tenant's expert.

``checkpoint_geometry`` reads the sizes from the tensors' shapes alone (the Gemma
variant of the PaliGemma, its SigLIP tower and image side, the vocabulary rows, the
expert's width), never from a hub name: a shape that matches no variant of
``pi05_config`` is refused. ``load_pi05_base`` then loads, strictly, the PaliGemma part
of the state dict (``model.paligemma_with_expert.paligemma.*``: every tensor of the base
present, none left over, shapes equal, all finite) as a ``Pi05Base`` with the project's
own tokenizer (its ids index the first rows of the checkpoint's vocabulary).
``init_expert`` loads the expert part (``expert_from_lerobot``) into a tenant's
``pi05_expert``: ``WorkloadSpec.init_from_checkpoint``.

A checkpoint holds no continuous state token, so a head conditioned on one
(``expert_state="token"``, where that exists) is refused by ``check_lerobot_head``.

See docs/ARCHITECTURE.md, "Model families: the π0.5 base".
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from joynexus.agents.models.lerobot_checkpoint import (
    LeRobotCheckpoint,
    copy_tensors,
    family_of,
    load_expert,
    load_tensors,
    read_checkpoint,
)
from joynexus.agents.models.pi05_config import (
    EXPERT_OF,
    GEMMA_VARIANTS,
    MAX_ACTION_DIM,
    VISION_TOWERS,
)
from joynexus.schemas.errors import InvalidSpec

__all__ = [
    "BASE_PREFIX",
    "EXPERT_PREFIX",
    "check_lerobot_head",
    "checkpoint_geometry",
    "init_expert",
    "load_pi05_base",
    "read_pi05",
]

#: Where LeRobot's ``PI05Policy`` state dict keeps the PaliGemma and the expert.
BASE_PREFIX = "model.paligemma_with_expert.paligemma."
EXPERT_PREFIX = "model.paligemma_with_expert.gemma_expert."
_TEXT = BASE_PREFIX + "model.language_model."
_VISION = BASE_PREFIX + "model.vision_tower.vision_model."


def read_pi05(path: str) -> tuple[LeRobotCheckpoint, dict[str, Any]]:
    """``path`` checked as a π0.5 checkpoint (type ``pi05``), and its geometry."""
    ckpt = read_checkpoint(path)
    family_of(ckpt, "pi05")
    return ckpt, checkpoint_geometry(ckpt)


def _count(shapes: dict[str, tuple[int, ...]], pattern: str) -> int:
    rx = re.compile(re.escape(pattern) + r"(\d+)\.")
    found = {int(m.group(1)) for k in shapes if (m := rx.match(k))}
    if found != set(range(len(found))):
        return -1
    return len(found)


def checkpoint_geometry(ckpt: LeRobotCheckpoint) -> dict[str, Any]:
    """``paligemma_variant``, ``image_size``, ``vocab``, ``expert_width``, ``max_state_dim`` of a
    π0.5 checkpoint, read from its tensors' shapes (and ``max_state_dim`` from config.json)."""
    s = ckpt.shapes

    def shape(name: str, ndim: int) -> tuple[int, ...]:
        got = s.get(name)
        if got is None or len(got) != ndim:
            raise ckpt.bad(f"not a π0.5 PaliGemma: tensor {name!r} is missing or not {ndim}-d")
        return got

    # LeRobot 0.4.4's save_pretrained keeps the tied embeddings under ``lm_head`` only.
    emb = _TEXT + "embed_tokens.weight" if _TEXT + "embed_tokens.weight" in s else BASE_PREFIX + "lm_head.weight"
    vocab, width = shape(emb, 2)
    text = dict(width=width, depth=_count(s, _TEXT + "layers."),
                mlp_dim=shape(_TEXT + "layers.0.mlp.gate_proj.weight", 2)[0])
    q, k = shape(_TEXT + "layers.0.self_attn.q_proj.weight", 2)[0], shape(_TEXT + "layers.0.self_attn.k_proj.weight", 2)[0]
    variant = next((n for n, g in GEMMA_VARIANTS.items() if n in EXPERT_OF
                    and all(g[f] == v for f, v in text.items())
                    and g["num_heads"] * g["head_dim"] == q and g["num_kv_heads"] * g["head_dim"] == k), None)
    if variant is None:
        raise ckpt.bad(f"its PaliGemma (width {width}, {text['depth']} layers, MLP {text['mlp_dim']}, q {q}, kv {k}) "
                       f"is no size served here; sizes are {sorted(EXPERT_OF)}")
    tower = VISION_TOWERS["tiny" if variant == "tiny" else "so400m"]
    hidden, _, patch, _ = shape(_VISION + "embeddings.patch_embedding.weight", 4)
    patches, _ = shape(_VISION + "embeddings.position_embedding.weight", 2)
    vis = dict(hidden_size=hidden, patch_size=patch, num_hidden_layers=_count(s, _VISION + "encoder.layers."),
               intermediate_size=shape(_VISION + "encoder.layers.0.mlp.fc1.weight", 2)[0])
    side = math.isqrt(patches) * patch
    if any(tower[f] != v for f, v in vis.items()) or math.isqrt(patches) ** 2 != patches or side % 14:
        raise ckpt.bad(f"its SigLIP tower ({vis}, {patches} patches) is not the {variant} base's")
    proj = shape(BASE_PREFIX + "model.multi_modal_projector.linear.weight", 2)
    if proj != (width, hidden):
        raise ckpt.bad(f"its image projector maps {proj[1]} -> {proj[0]}, the text model is {width} wide")
    ew = shape("model.action_in_proj.weight", 2)
    expert = GEMMA_VARIANTS[EXPERT_OF[variant]]
    if ew != (expert["width"], MAX_ACTION_DIM) or _count(s, EXPERT_PREFIX + "model.layers.") != expert["depth"]:
        raise ckpt.bad(f"its action expert (action_in_proj {list(ew)}) is not the {EXPERT_OF[variant]} expert of "
                       f"a {variant} base (max_action_dim {MAX_ACTION_DIM})")
    msd = ckpt.config.get("max_state_dim", 32)
    if isinstance(msd, bool) or not isinstance(msd, int) or not 1 <= msd <= 256:
        raise ckpt.bad(f"config.json's max_state_dim={str(msd)[:20]!r} is not an integer in [1, 256]")
    return {"paligemma_variant": variant, "image_size": side, "vocab": vocab, "expert_width": expert["width"],
            "max_state_dim": msd}


def load_pi05_base(path: str, threads: int | None = None, dtype: str = "float32") -> Any:
    """The resident ``Pi05Base`` of a LeRobot π0.5 checkpoint's PaliGemma (strict; see the module's doc)."""
    from transformers import PaliGemmaForConditionalGeneration
    from transformers.modeling_utils import no_init_weights

    from joynexus.agents.models.pi05_base import Pi05Base
    from joynexus.agents.models.pi05_config import Pi05BaseConfig, build_paligemma_config
    from joynexus.agents.models.tokenizer import train_tokenizer

    ckpt, geo = read_pi05(path)
    cfg = Pi05BaseConfig(paligemma_variant=geo["paligemma_variant"], image_size=geo["image_size"],
                         max_state_dim=geo["max_state_dim"], threads=threads, dtype=dtype)  # type: ignore[arg-type]
    if threads is not None:
        torch.set_num_threads(threads)
    tok = train_tokenizer()
    if len(tok) > geo["vocab"]:
        raise ckpt.bad(f"its vocabulary has {geo['vocab']} rows, the project's tokenizer {len(tok)}")
    pcfg = build_paligemma_config(cfg, tok)
    pcfg.text_config.vocab_size = pcfg.vocab_size = geo["vocab"]
    pcfg.image_token_index = geo["vocab"]
    pcfg.text_config._attn_implementation = pcfg.vision_config._attn_implementation = "eager"
    with no_init_weights():
        model = PaliGemmaForConditionalGeneration(pcfg)
    own = model.state_dict()  # tied names share one tensor
    src = {k[len(BASE_PREFIX):]: k for k in ckpt.shapes if k.startswith(BASE_PREFIX)}
    emb, head = "model.language_model.embed_tokens.weight", "lm_head.weight"
    if (emb in src) != (head in src):  # tied (LeRobot writes them once, as lm_head): one holds both
        src[emb if head in src else head] = src[head if head in src else emb]
    missing, unexpected = sorted(set(own) - set(src)), sorted(set(src) - set(own))
    if missing or unexpected:
        raise ckpt.bad(f"its PaliGemma does not match the {cfg.base_model} base: missing {missing[:4]}, "
                       f"unexpected {unexpected[:4]}")
    wrong = [f"{k} {list(ckpt.shapes[src[k]])} (want {list(t.shape)})" for k, t in own.items()
             if ckpt.shapes[src[k]] != tuple(t.shape)]
    if wrong:
        raise ckpt.bad(f"its PaliGemma's shapes differ from the {cfg.base_model} base's: {wrong[:3]}")
    copy_tensors(ckpt, [(src[k], t) for k, t in own.items()])  # one tensor in memory at a time
    model.tie_weights()
    return Pi05Base(model, tok, cfg)


def check_lerobot_head(head_type: str, head_config: Any) -> None:
    """``InvalidSpec`` unless a head of ``head_type`` and ``head_config`` (a dict or a
    ``HeadConfig``) is what a LeRobot π0.5 checkpoint holds: a ``pi05_expert`` that reads
    the state only through the prompt. The hook for a continuous state token
    (``expert_state="token"``): LeRobot's ``PI05Pytorch`` has no place for it."""
    if head_type != "pi05_expert":
        raise InvalidSpec(f"a LeRobot π0.5 checkpoint holds a pi05_expert, not a {head_type[:40]!r} head")
    state = head_config.get("expert_state") if isinstance(head_config, dict) else getattr(head_config, "expert_state", None)
    if state == "token":
        raise InvalidSpec("a pi05_expert with expert_state='token' (a continuous state token) has no LeRobot π0.5 "
                          "form: LeRobot's PI05Pytorch reads the state only in the prompt")


def init_expert(head: torch.nn.Module, path: str) -> None:
    """``head`` (a ``pi05_expert``) starts from the expert of the checkpoint at ``path``: every
    expert weight loaded, shapes equal; the head's normalisation buffers stay its own."""
    from joynexus.agents.models.heads.pi05 import expert_from_lerobot

    check_lerobot_head(getattr(head, "type_name", "pi05_expert"), getattr(head, "cfg", {}))
    ckpt, geo = read_pi05(path)
    hidden = int(head.cfg.hidden)  # type: ignore[union-attr,arg-type]
    g = GEMMA_VARIANTS[geo["paligemma_variant"]]
    if (head.cfg.kv_layers, head.head_dim) != (g["depth"], g["head_dim"]):  # type: ignore[union-attr]
        raise ckpt.bad(f"it is a pi05-{geo['paligemma_variant']} policy; its expert cannot attend to this "
                       "workload's base (base_model must be the checkpoint's)")
    if geo["expert_width"] != hidden:
        raise ckpt.bad(f"its action expert is {geo['expert_width']} wide, this workload's head_hidden is {hidden}; "
                       "give the checkpoint's width")
    names = (EXPERT_PREFIX + "model.", "model.action_in_proj.", "model.action_out_proj.", "model.time_mlp_in.",
             "model.time_mlp_out.")
    sd = expert_from_lerobot(load_tensors(ckpt, names))
    load_expert(ckpt, head, sd, "pi05_expert")
