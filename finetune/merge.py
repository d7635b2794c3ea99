"""Merge a fine-tuning run's LoRA adapter into its base checkpoint, in the base's on-disk format.

    python -m vla_finetune.merge --checkpoint BASE --adapter RUN_DIR --out MERGED

The merged directory loads with ``load_policy(MERGED)`` and gives the same actions as
``load_policy(BASE, adapter=RUN_DIR)`` (up to the stored dtype's rounding): the gate, KV config,
statistics and session config are copied beside the weights.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

import torch

from vla_runtime.checkpoints.adapter import has_lora, merge_lora
from vla_runtime.checkpoints.export import save_openvla_like
from vla_runtime.checkpoints.openvla import load_openvla
from vla_runtime.device import DTYPES
from vla_runtime.kv.gate_io import GATE_CONFIG, GATE_WEIGHTS
from vla_runtime.models.prismatic.configuration_prismatic import read_json

from .outputs import SESSION_CONFIG, STATISTICS

log = logging.getLogger(__name__)

BESIDE = (GATE_WEIGHTS, GATE_CONFIG, SESSION_CONFIG)  # copied from the run directory when present


def merge_adapter(
    checkpoint: str | Path, adapter: str | Path, out: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Base + LoRA -> ``out`` (float32 merge, stored as ``dtype``; ``None`` = the base's ``torch_dtype``)."""
    checkpoint, adapter, out = Path(checkpoint), Path(adapter), Path(out)
    if not has_lora(adapter):
        raise FileNotFoundError(f"{adapter} has no LoRA adapter (adapter_config.json); nothing to merge")
    base = load_openvla(checkpoint, device="cpu", dtype=torch.float32)
    model = merge_lora(base.model, adapter)
    statistics = adapter / STATISTICS
    norm_stats = read_json(statistics) if statistics.is_file() else None
    save_openvla_like(model, out, source=checkpoint, norm_stats=norm_stats, dtype=dtype)
    for name in BESIDE:
        if (adapter / name).is_file():
            shutil.copy2(adapter / name, out / name)
    log.info("merged %s + %s -> %s", checkpoint, adapter, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vla_finetune.merge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, required=True, help="the base checkpoint the run fine-tuned")
    parser.add_argument("--adapter", type=Path, required=True, help="the run's output directory")
    parser.add_argument("--out", type=Path, required=True, help="directory for the merged checkpoint")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="stored dtype (default: the base checkpoint's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    merge_adapter(args.checkpoint, args.adapter, args.out, dtype=DTYPES[args.dtype] if args.dtype else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
