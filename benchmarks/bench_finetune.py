"""Training throughput of ``vla_finetune`` for the tiny OpenVLA: optimizer steps per second by mode.

Question: how fast does fine-tuning run on this machine, and what do the chunked cache's parallel form,
LoRA and full training cost? Every variant trains the same tiny checkpoint (``make_tiny_openvla``,
proprio projector) on the same synthetic LeRobot v3 dataset (written with ``vla_runtime.data``) for
``--warmup + --repeats`` steps in this process; the time of each step comes from the trainer's own
JSONL log (``log_every=1``: data, forward, backward and optimizer; checkpoint saving excluded), wall
time and this process's CPU time (the steadier number on a shared machine; with ``--threads 1`` it is the
wall time an idle core would take).

Variants (``--variants``): ``lora-chunked`` (the default recipe: LoRA + gate, history mode, parallel
form; the baseline), ``lora-full`` (history mode, plain causal attention), ``gates`` (gates only),
``scratch`` (every weight), ``lora-single`` (stock single-step samples), ``lora-chunked-fullvocab``
(cross-entropy over the whole vocabulary, as upstream). All but the last use the action-token loss.

usage: python benchmarks/bench_finetune.py [--threads 2] [--batch-size 8] [--window 8] [--image-size 56]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from vla_finetune.config import FinetuneConfig
from vla_finetune.trainer import Trainer
from vla_runtime.bench.harness import environment, pinned_threads, pyplot, save_figure, summarize, write_json
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import from_dict
from vla_runtime.data import DatasetFeatures, Episode, LeRobotWriter, WriterConfig

VARIANTS = {
    "lora-chunked": {},
    "lora-full": {"kv": {"mode": "full"}},
    "gates": {"trainable": "gates"},
    "scratch": {"trainable": "all"},
    "lora-chunked-fullvocab": {"action_vocab_loss": False},
    "lora-single": {"history": "single"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_finetune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (pinned for every variant)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_finetune", help="writes <out>.json and <out>.png")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--batch-size", type=int, default=8, help="windows per step")
    p.add_argument("--window", type=int, default=8, help="control steps per history window")
    p.add_argument("--image-size", type=int, default=56, help="tiny checkpoint's image side (56 px = 16 patches)")
    p.add_argument("--chunk", type=int, default=16, help="chunk size C")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--episode-length", type=int, default=40)
    args = p.parse_args(argv)
    for name in ("threads", "repeats", "batch_size", "window", "episodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.episode_length < args.window:
        p.error("--episode-length must be >= --window")
    return args


def write_dataset(root: Path, *, lengths: list[int], image: int, seed: int) -> Path:
    """A LeRobot v3 dataset of ``len(lengths)`` episodes of random frames and smooth actions."""
    rng = np.random.default_rng(seed)
    features = DatasetFeatures(
        cameras={"front": (image, image)}, state_names=list("abcd"), action_names=[f"a{i}" for i in range(7)]
    )
    with LeRobotWriter(root, features, WriterConfig(fps=10)) as writer:
        for e, length in enumerate(lengths):
            t = np.arange(length)
            action = np.concatenate([0.02 * np.sin(0.3 * t[:, None] + np.arange(6)), (t[:, None] % 10 < 5)], axis=1)
            writer.add_episode(Episode(
                images={"front": rng.integers(0, 256, (length, image, image, 3), dtype=np.uint8)},
                state=rng.normal(size=(length, 4)).astype(np.float32), action=action.astype(np.float32),
                task=("reach the goal", "push the puck to the goal", "open the drawer")[e % 3],
            ))  # fmt: skip
    return root


def train_logged(base: dict, overrides: dict, *, warmup: int) -> tuple[Trainer, list[dict]]:
    """Train ``base`` (a ``FinetuneConfig`` mapping, ``log_every=1``) with ``overrides`` merged one level deep;
    returns the trainer and its log records after the first ``warmup`` steps."""
    config = dict(base)
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    cfg = from_dict(FinetuneConfig, config)
    trainer = Trainer(cfg)
    trainer.train()
    return trainer, [json.loads(line) for line in (cfg.out / "train_log.jsonl").read_text().splitlines()][warmup:]


def run_variant(name: str, args: argparse.Namespace, ckpt: Path, dataset: Path, work: Path) -> dict:
    base = {
        "checkpoint": ckpt, "dataset": dataset, "out": work / name, "batch_size": args.batch_size, "device": args.device,
        "max_steps": args.warmup + args.repeats, "log_every": 1, "save_every": 10**6, "seed": args.seed,
        "kv": {"chunk": args.chunk}, "data": {"window": args.window, "stride": max(1, args.window // 2), "cache_dir": work / "cache"},
    }  # fmt: skip
    trainer, records = train_logged(base, VARIANTS[name], warmup=args.warmup)
    times = [1e3 / r["steps_per_s"] for r in records]
    cpu = [r["cpu_ms_per_step"] for r in records]
    layout = next(iter(trainer.data.layouts.values()))
    return {
        **summarize(times),
        "cpu_ms": cpu,
        "median_cpu_ms": statistics.median(cpu),
        "windows_per_s": statistics.median(r["windows_per_s"] for r in records),
        "tokens_per_window": layout.n_tokens,
        "trainable": sum(p.numel() for p in trainer.module.parameters() if p.requires_grad),
    }


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(results)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(names, [1e3 / results[n]["median_ms"] for n in names])
    ax.set(ylabel="optimizer steps / s", title="vla_finetune, tiny OpenVLA")
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with pinned_threads(args.threads), tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = make_tiny_openvla(work / "ckpt", dtype=torch.float32, image_size=args.image_size, proprio_dim=4)
        dataset = write_dataset(
            work / "data", lengths=[args.episode_length] * args.episodes, image=args.image_size, seed=args.seed
        )
        results = {name: run_variant(name, args, ckpt, dataset, work) for name in args.variants}
    baseline = results[args.variants[0]]["median_ms"]
    print(f"threads {args.threads}, batch {args.batch_size} windows x {args.window} steps, "
          f"image {args.image_size}px, chunk {args.chunk}")  # fmt: skip
    width = max(len(n) for n in results)
    columns = ["median ms/step", "p10", "p90", "CPU ms", "steps/s", "windows/s", "tokens/win", "ratio"]
    widths = [max(10, len(c)) for c in columns]
    print(" | ".join([f"{'variant':<{width}}", *(f"{c:>{w}}" for c, w in zip(columns, widths))]))
    for name, r in results.items():
        r["ratio"] = r["median_ms"] / baseline
        values = [r["median_ms"], r["p10_ms"], r["p90_ms"], r["median_cpu_ms"], 1e3 / r["median_ms"], r["windows_per_s"]]
        cells = [f"{v:>{w}.{2 if i == 4 else 1}f}" for i, (v, w) in enumerate(zip(values, widths))]
        print(" | ".join([f"{name:<{width}}", *cells, f"{r['tokens_per_window']:>{widths[6]}}", f"{r['ratio']:>{widths[7]}.2f}"]))
    env = environment(device=args.device, dtype="float32", threads=args.threads)
    write_json(f"{args.out}.json", env=env, args=args, results=results)
    plot(results, Path(f"{args.out}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
