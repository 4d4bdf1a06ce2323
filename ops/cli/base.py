"""``joynexus base pretrain``: the frozen base model the service serves to every
tenant (``ops/admin/pretrain_base.py``); ``joynexus base describe``: what a base family
costs (``agents/models/families.py``); ``joynexus base export-lerobot``: the base and a
tenant's exported ``pi05_expert`` (``smolvla_expert``) as a LeRobot ``PI05Policy``
(``SmolVLAPolicy``) checkpoint (``agents/models/pi05_export.py``, ``smolvla_export.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from joynexus.ops.admin.pretrain_base import LABELS, make_base
from joynexus.schemas.catalog import BASE_FAMILIES


def register(sub: Any) -> None:
    p = sub.add_parser(
        "base",
        help="make the frozen base model the service serves to every tenant",
        description="Make a frozen base model offline (nothing is downloaded).",
    )
    bsub = p.add_subparsers(dest="base", required=True, metavar="ACTION")
    g = bsub.add_parser(
        "pretrain",
        help="pre-train the tiny backbone on simulator renders so its features see where things are",
        description=(
            "Render ManiSkill scenes on the CPU (scripted expert plus action noise), pre-train "
            "the tiny Qwen2.5-VL backbone to predict the object, goal and gripper positions "
            "from the image through the mean-pooled features the heads read, and save it with "
            "save_pretrained (weights, BPE tokenizer, image processor) into DIR. Prints the "
            "held-out linear-probe error of the random and the pre-trained base. Serve it with "
            "--backbone-path DIR (inference and actor roles)."
        ),
    )
    g.add_argument("--out", required=True, metavar="DIR", help="where to save the base (new or empty)")
    g.add_argument("--task", action="append", default=None, metavar="TASK", choices=sorted(LABELS),
                   help=f"task to render, repeatable (default PushCube-v1); one of {sorted(LABELS)}")
    g.add_argument("--renders", type=int, default=3000, metavar="N",
                   help="frames rendered per task (default 3000; ~25/s on a 2-core CPU)")
    g.add_argument("--steps", type=int, default=1500, help="training steps (default 1500)")
    g.add_argument("--batch-size", type=int, default=32, help="frames per step (default 32)")
    g.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    g.add_argument("--image-size", type=int, default=56,
                   help="image side the base sees, a multiple of 28 (default 56); render datasets at it")
    g.add_argument("--seed", type=int, default=0, help="render and init seed (default 0)")
    g.add_argument("--json", action="store_true", help="print only the JSON report")
    g.set_defaults(run=run)
    d = bsub.add_parser(
        "describe",
        help="a base family's parameters, prefix tokens per sample and bytes per row",
        description=(
            "Describe a resident base family without building its weights (parameters counted on "
            "the meta device): parameters of the base and of one tenant's head (pi05, smolvla: its action "
            "expert), prefix tokens per sample and the bytes per row the shared forward hands a head "
            "(pi05, smolvla: the per-layer key/value cache)."
        ),
    )
    d.add_argument("--base", default="qwen2_5_vl", choices=BASE_FAMILIES, help="base family (default qwen2_5_vl)")
    d.add_argument("--size", default="tiny",
                   help="qwen2_5_vl: tiny, bench; pi05: tiny, gemma_300m, gemma_2b (paligemma_variant); "
                   "smolvla: tiny, smolvlm2_500m")
    d.add_argument("--path", default=None, metavar="DIR",
                   help="pi05, smolvla: describe a LeRobot PI05Policy or SmolVLAPolicy directory (config.json + "
                   "model.safetensors; its shapes fix the size, no tensor is read)")
    d.add_argument("--cameras", type=int, default=1, help="camera images per sample (default 1)")
    d.add_argument("--state-dim", type=int, default=8, help="state values per sample (default 8)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(run=run_describe)
    x = bsub.add_parser(
        "export-lerobot",
        help="write the base and a tenant's exported expert as a LeRobot PI05Policy (SmolVLAPolicy) checkpoint",
        description=(
            "Offline: the resident π0.5 base (built from its config as the service builds it, or "
            "loaded from --backbone-path) and a head exported by Client.export (--head) written as a "
            "directory LeRobot's PI05Policy.from_pretrained loads: config.json, model.safetensors, "
            "policy_preprocessor.json/policy_postprocessor.json (LeRobot's processor factories, the "
            "head's normalisation statistics, the project's tokenizer in tokenizer/). --base smolvla: "
            "the SmolVLA base and a smolvla_expert as a SmolVLAPolicy directory (the VLM's config and "
            "tokenizer in vlm/, named by vlm_model_name)."
        ),
    )
    x.add_argument("--base", default="pi05", choices=("pi05", "smolvla"),
                   help="base family: pi05 (a PI05Policy) or smolvla (a SmolVLAPolicy)")
    x.add_argument("--backbone", default="tiny",
                   help="base size built from its config (pi05: tiny, gemma_2b; smolvla: tiny, smolvlm2_500m)")
    x.add_argument("--backbone-path", default=None, metavar="DIR",
                   help="the deployment's base was loaded from this LeRobot checkpoint instead")
    x.add_argument("--head", required=True, metavar="DIR", help="a head exported by Client.export")
    x.add_argument("--out", required=True, metavar="DIR", help="where to write (new or empty)")
    x.add_argument("--json", action="store_true", help="print one JSON object")
    x.set_defaults(run=run_export_lerobot)


def run_describe(args: argparse.Namespace) -> int:
    from joynexus.agents.models.families import describe
    from joynexus.schemas.errors import InvalidSpec

    try:
        report = describe(args.base, args.size, cameras=args.cameras, state_dim=args.state_dim, path=args.path)
    except InvalidSpec as e:
        print(f"joynexus base describe: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def run_export_lerobot(args: argparse.Namespace) -> int:
    from joynexus.agents.models.families import build_base
    from joynexus.agents.models.pi05_export import export_lerobot, head_from_export
    from joynexus.schemas.errors import InvalidSpec

    try:
        module, manifest = head_from_export(args.head)
        base = build_base(args.base, args.backbone, args.backbone_path)
        if manifest.get("base_model") != base.config.base_model:
            raise InvalidSpec(f"the head was trained on {str(manifest.get('base_model'))[:64]!r}, this base is "
                              f"{base.config.base_model}")
        cameras = (manifest.get("feature_schema") or {}).get("camera_slots") or []
        export = export_lerobot
        if args.base == "smolvla":
            from joynexus.agents.models.smolvla_export import export_smolvla as export
        report = export(base, module, args.out, cameras=cameras, extra={
            k: manifest.get(k) for k in ("tenant_id", "workload", "version")})
    except InvalidSpec as e:
        print(f"joynexus base export-lerobot: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    report = make_base(
        args.out, tasks=tuple(args.task or ("PushCube-v1",)), renders=args.renders, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, image_size=args.image_size, seed=args.seed,
        log=log, progress=not args.json,
    )
    print(json.dumps(report, indent=None if args.json else 2))
    return 0
