"""``vla-runtime finetune``: fine-tune a policy on a local LeRobot dataset (``vla_finetune.train``).

vla-runtime finetune --checkpoint CKPT --dataset DATASET --out RUN
torchrun --nproc_per_node 2 -m vla_finetune.train ...   (several processes: DDP)
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from vla_finetune.args import add_arguments

    p = sub.add_parser(
        "finetune",
        help="fine-tune a policy (LoRA + chunk gate, gates only, or from scratch) on a LeRobot dataset",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vla_finetune.train import run as run_finetune

    return run_finetune(args)
