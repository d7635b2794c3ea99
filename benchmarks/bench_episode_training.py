"""Whole-episode training throughput: tokens/s and minutes per epoch on the demo policy's geometry.

Question: how fast does ``vla_finetune`` train history windows that cover whole episodes (``--window 0``,
the chunked cache's parallel form, a budget) against the 8-step windows the demo policy was trained on?
Every variant trains the demo geometry from scratch (``make_tiny_openvla``: 84 px tiny DINO + SigLIP,
LLaMA 128 x 4, proprio 4; chunk 16, raw window one step) on one synthetic LeRobot dataset of
``--episodes`` episodes of 100..150 steps, for ``--warmup + --repeats`` optimizer steps in this process.
Per step, the trainer's own log gives wall time, this process's CPU time (the steadier number on a shared
machine) and the real tokens trained (padding excluded). Minutes per epoch = real tokens of the dataset's
epoch (whole episodes: every step once; windows: every window, stride 4) / tokens per CPU-second.

Variants: ``window8`` (8-step windows, batch 8; the demo recipe), ``episode`` (whole episodes, batch
``--batch-size``, a budget of ``--max-chunks``, the default hard budget objective), ``episode-soft``
(the relaxed top-M budget: every chunk is a key), ``episode-ckpt`` (gradient checkpointing),
``episode-observations`` (``HistoryMode.OBSERVATIONS``: each step's decodes are causal query blocks).

usage: python benchmarks/bench_episode_training.py [--threads 1] [--episodes 12] [--repeats 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench_finetune import train_logged, write_dataset
from vla_finetune.recipes.metaworld_demo import llm_geometry
from vla_runtime.bench.harness import environment, pinned_threads, write_json
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla

VARIANTS = {
    "window8": {"data": {"window": 8, "stride": 4}, "batch_size": 8},
    "episode": {},
    "episode-soft": {"gate": {"budget": "soft"}},
    "episode-ckpt": {"gradient_checkpointing": True},
    "episode-observations": {"history": "observations"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_episode_training", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (pinned for every variant)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--episodes", type=int, default=12, help="synthetic episodes of 100..150 steps")
    p.add_argument("--batch-size", type=int, default=2, help="whole episodes per step")
    p.add_argument("--max-chunks", type=int, default=32, help="retained-chunk budget per layer")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default="results/bench_episode_training", help="writes <out>.json")
    return p.parse_args(argv)


def run_variant(name: str, args: argparse.Namespace, ckpt: Path, dataset: Path, work: Path) -> dict:
    base = {
        "checkpoint": ckpt, "dataset": dataset, "out": work / name, "trainable": "all", "batch_size": args.batch_size,
        "max_steps": args.warmup + args.repeats, "log_every": 1, "save_every": 10**6, "seed": args.seed, "lr": 1e-3,
        "kv": {"chunk": 16, "max_chunks": args.max_chunks}, "gate": {"retention_weight": 0.0},
        "data": {"window": 0, "cache_dir": work / "cache"},
    }  # fmt: skip
    trainer, records = train_logged(base, VARIANTS[name], warmup=args.warmup)
    tokens = [r["tokens_per_s"] / r["steps_per_s"] for r in records]  # real tokens of each step
    cpu_s = [r["cpu_ms_per_step"] / 1e3 for r in records]
    data = trainer.data
    epoch_tokens = sum(data.real_tokens(data.layouts[data.bucket_key(w)], w) for w in data.windows)
    cpu_rate = sum(tokens) / sum(cpu_s)
    return {
        "tokens_per_cpu_s": cpu_rate,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "median_cpu_ms": 1e3 * statistics.median(cpu_s),
        "tokens_per_step": statistics.median(tokens),
        "epoch_tokens": epoch_tokens,
        "minutes_per_epoch": epoch_tokens / cpu_rate / 60,
        "final_loss": records[-1]["loss"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    lengths = np.random.default_rng(args.seed).integers(100, 151, args.episodes).tolist()
    with pinned_threads(args.threads), tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = make_tiny_openvla(work / "ckpt", seed=0, image_size=84, proprio_dim=4, llm=llm_geometry(128, 4), dtype=torch.float32)
        dataset = write_dataset(work / "data", lengths=lengths, image=84, seed=args.seed)
        results = {name: run_variant(name, args, ckpt, dataset, work) for name in args.variants}
    base = results[args.variants[0]]["tokens_per_cpu_s"]
    print(f"demo geometry (84 px, LLaMA 128x4), {args.episodes} episodes of {min(lengths)}..{max(lengths)} steps, "
          f"threads {args.threads}, budget {args.max_chunks} chunks/layer")  # fmt: skip
    print(f"{'variant':<13} | {'tokens/CPU-s':>12} | {'tokens/s wall':>13} | {'CPU ms/step':>11} | {'tokens/step':>11} | {'min/epoch':>9} | {'ratio':>5}")
    for name, r in results.items():
        r["ratio"] = r["tokens_per_cpu_s"] / base
        print(f"{name:<13} | {r['tokens_per_cpu_s']:>12.0f} | {r['tokens_per_s']:>13.0f} | {r['median_cpu_ms']:>11.0f} | "
              f"{r['tokens_per_step']:>11.0f} | {r['minutes_per_epoch']:>9.2f} | {r['ratio']:>5.2f}")  # fmt: skip
    write_json(f"{args.out}.json", env=environment(dtype="float32", threads=args.threads), args=args, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
