"""``vla-runtime make-tiny --family openvla OUT``: a tiny random checkpoint in the family's real on-disk
layout (real safetensors, real parameter names and token ids), for tests, demos and trying the tools.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..device import DTYPES


def _openvla(out: Path, args: argparse.Namespace) -> Path:
    from ..checkpoints.tiny_openvla import make_tiny_openvla

    return make_tiny_openvla(
        out,
        seed=args.seed,
        image_size=args.image_size,
        vision_backbone_id=args.vision_backbone_id,
        proprio_dim=args.proprio_dim,
        dtype=DTYPES[args.dtype],
        max_shard_bytes=int(args.max_shard_mb * 2**20) if args.max_shard_mb else None,
    )


def _openvla_oft(out: Path, args: argparse.Namespace) -> Path:
    from ..checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
    from ..models.openvla_oft.configuration_oft import OFTPlatform

    return make_tiny_openvla_oft(
        out,
        seed=args.seed,
        image_size=args.image_size,
        platform=OFTPlatform(args.oft_platform),
        proprio=not args.no_proprio,
        dtype=DTYPES[args.dtype],
        film=args.film,
        diffusion=args.diffusion,
    )


def _cogact(out: Path, args: argparse.Namespace) -> Path:
    from ..checkpoints.tiny_prismatic import make_tiny_cogact

    return make_tiny_cogact(out, seed=args.seed, image_size=args.image_size, dtype=DTYPES[args.dtype])


def _hybridvla(out: Path, args: argparse.Namespace) -> Path:
    from ..checkpoints.tiny_prismatic import make_tiny_hybridvla

    return make_tiny_hybridvla(
        out, seed=args.seed, image_size=args.image_size, future_window=args.future_window, dtype=DTYPES[args.dtype]
    )


# family -> maker(out, args); adding a family = one function + one entry
MAKERS = {"openvla": _openvla, "openvla-oft": _openvla_oft, "cogact": _cogact, "hybridvla": _hybridvla}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny random checkpoint", description=__doc__)
    p.add_argument("out", type=Path, help="output directory (must not exist or be empty, unless --force)")
    p.add_argument("--family", required=True, choices=sorted(MAKERS), help="model family")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="stored dtype (default bfloat16, as upstream)")
    p.add_argument("--image-size", type=int, default=56, help="input image side in pixels (default 56; upstream 224)")
    p.add_argument("--vision-backbone-id", default="dinosiglip-vit-so-224px", help="openvla: upstream vision_backbone_id")
    p.add_argument("--proprio-dim", type=int, help="openvla: add a proprioception projector of this input size")
    p.add_argument("--max-shard-mb", type=float, help="write shards + model.safetensors.index.json past this size")
    p.add_argument("--future-window", type=int, default=0, help="hybridvla: future actions denoised per step (default 0, as upstream)")
    p.add_argument("--oft-platform", choices=("libero", "bridge", "aloha"), default="libero",
                   help="openvla-oft: the platform's sizes (chunk x action dims: libero 8x7, bridge 5x7, aloha 25x14)")
    p.add_argument("--no-proprio", action="store_true", help="openvla-oft: no proprio projector")
    p.add_argument("--film", action="store_true", help="openvla-oft: FiLM (OFT+): write vision_backbone--*checkpoint.pt")
    p.add_argument("--diffusion", action="store_true",
                   help="openvla-oft: the diffusion variant (noise-predicting head + noisy_action_projector--*checkpoint.pt)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.out.exists() and any(args.out.iterdir()) and not args.force:
        raise ValueError(f"{args.out} exists and is not empty (use --force to write into it)")
    path = MAKERS[args.family](args.out, args)
    print(f"wrote a tiny {args.family} checkpoint to {path}")
    return 0
