"""Fine-tune a policy on a local LeRobot dataset: LoRA + the chunked cache's gate (or gates only, or
every weight from scratch).

    python -m vla_finetune.train --checkpoint CKPT --dataset DATASET --out RUN [--config run.yaml] [flags]
    torchrun --nproc_per_node 2 -m vla_finetune.train ...        # DDP (gloo on CPU, nccl on CUDA)
    vla-runtime finetune ...                                      # the same command

Then ``load_policy(CKPT, adapter=RUN)`` (or ``load_policy(RUN)`` after ``--from-scratch``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from vla_runtime.api import detect_family

from .args import add_arguments, config_from_args
from .config import FinetuneConfig
from .oft_trainer import OFTTrainer
from .trainer import DistEnv, Trainer

log = logging.getLogger(__name__)


def dist_env_from_environ() -> DistEnv:
    """torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (read here, at the entry point, only)."""
    return DistEnv(
        int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    )


def make_trainer(cfg: FinetuneConfig, env: DistEnv) -> "Trainer | OFTTrainer":
    """The trainer of the checkpoint's family: ``OFTTrainer`` for ``openvla-oft`` (L1 regression of action
    chunks), else ``Trainer`` (OpenVLA's action tokens; it names the families it refuses)."""
    if detect_family(cfg.checkpoint) == "openvla-oft":
        return OFTTrainer(cfg, world=env.world)
    return Trainer(cfg, env)


def run_training(cfg: FinetuneConfig, env: DistEnv) -> int:
    """Train ``cfg`` in this process (joining the process group when ``env.world > 1``)."""
    if env.world > 1:
        cuda = torch.cuda.is_available() and (cfg.device is None or cfg.device.startswith("cuda"))
        if cuda:
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    try:
        make_trainer(cfg, env).train()
    finally:
        if env.world > 1:
            dist.destroy_process_group()
    return 0


def run(args: argparse.Namespace) -> int:
    """``vla-runtime finetune`` / ``python -m vla_finetune.train`` after parsing."""
    env = dist_env_from_environ()
    if not env.is_main:  # one set of log lines and progress bars per job
        logging.getLogger().setLevel(logging.WARNING)
    return run_training(config_from_args(args), env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vla_finetune.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks on errors")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return run(args)
    except (FileNotFoundError, ValueError, KeyError) as e:
        if args.verbose:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"vla_finetune.train: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
