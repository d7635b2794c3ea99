"""Recipe: a small policy for Markovian Meta-World tasks, trained from scratch on this machine (it trained
the retired ``assets/mw-tiny-openvla``; ``make demo`` now runs the memory policy, ``metaworld_memory``).

Four stages, each a command a user can also run by hand (the recipe prints them):

1. ``vla-runtime collect``: Meta-World's scripted experts on ``--tasks`` (seeds 0..N-1 cover the task's
   50 scene variations), camera ``corner`` (the reach goal is visible there), ``--resolution`` pixels.
2. a random OpenVLA-architecture checkpoint in the upstream on-disk layout (tiny DINO + SigLIP towers,
   a small LLaMA, a proprio projector for the robot's own ``[hand xyz, gripper opening]``).
3. ``vla-runtime finetune --from-scratch`` in ``history`` mode with the chunked cache: every weight,
   the chunk aggregator and the LSTM gate train together through the parallel form.
4. ``vla-runtime eval`` with ``--kv full`` and ``--kv chunked`` (optional, ``--eval-episodes``).

    python -m vla_finetune.recipes.metaworld_demo --out runs/demo-recipe              # the run that trained mw-tiny-openvla
    python -m vla_finetune.recipes.metaworld_demo --out /tmp/r --episodes 2 --max-steps 3 --eval-episodes 0  # smoke

The trained checkpoint is ``OUT/model``; ``OUT/recipe.json`` records the commands and wall times.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

TASKS = "reach-v3,button-press-topdown-v3,drawer-close-v3"


def llm_geometry(dim: int, layers: int):
    """A small LLaMA: ``dim`` wide, ``layers`` deep, head size 32, GQA 2:1, SwiGLU 3x, LLaMA-2 vocabulary."""
    from vla_runtime.models.llama import LlamaConfig, RopeConfig

    heads = max(dim // 32, 1)
    return LlamaConfig(
        dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=max(heads // 2, 1), head_dim=32, ffn_dim=3 * dim,
        vocab_size=32064, max_position=2048, rope=RopeConfig(head_dim=32, theta=10000.0, original_max_position=2048),
    )  # fmt: skip


def add_common_args(p: argparse.ArgumentParser, *, tasks: str | None) -> None:
    """The flags every Meta-World recipe takes (``tasks=None``: ``--tasks`` is required)."""
    p.add_argument("--out", type=Path, required=True, help="run directory (data/, init/, model*/, eval-*/)")
    if tasks is None:
        p.add_argument("--tasks", required=True, help="comma-separated Meta-World tasks")
    else:
        p.add_argument("--tasks", default=tasks, help=f"Meta-World tasks (default {tasks})")
    p.add_argument("--episodes", type=int, default=50, help="expert episodes per task (default 50: every scene variation)")
    p.add_argument("--resolution", type=int, default=84, help="camera image side, a multiple of 14 (default 84)")
    p.add_argument("--camera", default="corner", help="Meta-World camera (default corner)")
    p.add_argument("--llm-dim", type=int, default=128, help="LLaMA width (default 128)")
    p.add_argument("--llm-layers", type=int, default=4, help="LLaMA depth (default 4)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, cosine schedule (default 1e-3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for training (default 2)")
    p.add_argument("--eval-max-steps", type=int, default=200, help="step limit per evaluation episode (default 200)")
    p.add_argument("--seed", type=int, default=0)


def eval_args(args: argparse.Namespace, checkpoint: Path, out: Path, flags: list[str], *, seed: int = 1000, workers: int = 2) -> list[str]:
    """``vla-runtime eval`` arguments for the recipe's tasks, camera, resolution and step limit, plus ``flags``."""
    return ["eval", "--checkpoint", str(checkpoint), "--sim", "metaworld", "--tasks", args.tasks, "--episodes", str(args.eval_episodes),
            "--camera", args.camera, "--resolution", str(args.resolution), "--max-steps", str(args.eval_max_steps),
            "--seed", str(seed), "--workers", str(workers), *flags, "--out", str(out)]  # fmt: skip


def write_results(out: Path, table: str) -> None:
    """``OUT/results.md``, echoed."""
    (out / "results.md").write_text(table)
    print(f"\n{table}")


def run_stage(name: str, argv: list[str], log: dict) -> None:
    """Run one stage as a subprocess (its output streams through), record the command and its wall time."""
    print(f"\n== {name}: {shlex.join(argv)}", flush=True)
    start = time.perf_counter()
    subprocess.run(argv, check=True)
    log["stages"].append({"stage": name, "command": shlex.join(argv), "seconds": round(time.perf_counter() - start, 1)})


def results_table(out: Path) -> str:
    """Markdown table of ``OUT/eval-full`` beside ``OUT/eval-chunked`` (their ``report.json`` summaries)."""
    summaries = {kv: json.loads((out / f"eval-{kv}" / "report.json").read_text())["summary"] for kv in ("full", "chunked")}
    rows = ["| task | success, full | success, chunked | control rate full / chunked (Hz) | step p50 full / chunked (ms) "
            "| peak KV full / chunked (KiB) |", "|---|---|---|---|---|---|"]  # fmt: skip
    tasks = list(summaries["full"]["tasks"]) + ["overall"]
    for task in tasks:
        m = {kv: s["overall"] if task == "overall" else s["tasks"][task] for kv, s in summaries.items()}
        cells = [f"{m[kv]['successes']}/{m[kv]['episodes']} ({100 * m[kv]['success_rate']:.0f} %)" for kv in ("full", "chunked")]
        rate = " / ".join(f"{m[kv]['control_rate_hz']:.1f}" for kv in ("full", "chunked"))
        p50 = " / ".join(f"{m[kv]['step_latency_ms']['p50']:.1f}" for kv in ("full", "chunked"))
        kib = " / ".join(f"{m[kv]['kv_bytes_max'] / 1024:.0f}" for kv in ("full", "chunked"))
        rows.append(f"| {'**overall**' if task == 'overall' else task} | {cells[0]} | {cells[1]} | {rate} | {p50} | {kib} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vla_finetune.recipes.metaworld_demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_common_args(p, tasks=TASKS)
    p.add_argument("--max-steps", type=int, default=1500, help="optimizer steps (default 1500)")
    p.add_argument("--batch-size", type=int, default=8, help="history windows per step (default 8)")
    p.add_argument("--eval-episodes", type=int, default=20, help="evaluation episodes per task and cache; 0 = skip")
    args = p.parse_args(argv)

    import torch
    from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla

    args.out.mkdir(parents=True, exist_ok=True)
    cli = [str(Path(sys.executable).with_name("vla-runtime"))]  # the console script beside this interpreter
    log: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "stages": []}
    data, init, model = args.out / "data", args.out / "init", args.out / "model"

    if not (data / "meta" / "info.json").exists():
        run_stage("collect", cli + ["collect", "--sim", "metaworld", "--tasks", args.tasks, "--episodes", str(args.episodes),
                                    "--camera", args.camera, "--resolution", str(args.resolution), "--seed", str(args.seed),
                                    "--out", str(data)], log)  # fmt: skip

    if (model / "model.safetensors").is_file():
        print(f"\n== init, train: {model} exists (its train_log.jsonl has the run), skipped; delete it to retrain")
        log["stages"].append({"stage": "train", "skipped": f"{model} exists"})
    else:
        llm = llm_geometry(args.llm_dim, args.llm_layers)
        print(f"\n== init: random OpenVLA, {args.resolution}px tiny DINO+SigLIP, LLaMA {llm.dim}x{llm.n_layers}, proprio 4")
        make_tiny_openvla(init, seed=args.seed, image_size=args.resolution, proprio_dim=4, llm=llm, dtype=torch.float32)
        run_stage("train", cli + ["finetune", "--from-scratch", "--checkpoint", str(init), "--dataset", str(data), "--out", str(model),
                                  "--history", "history", "--kv", "chunked", "--camera", args.camera, "--dataset-name", "metaworld_mt3", "--max-steps", str(args.max_steps),
                                  "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--lr-schedule", "cosine",
                                  "--warmup-steps", str(max(args.max_steps // 20, 1)), "--threads", str(args.threads),
                                  "--save-dtype", "bfloat16", "--seed", str(args.seed)], log)  # fmt: skip

    if args.eval_episodes > 0:
        # the full cache keeps every token of the episode: step limit x (frame + proprio + prompt + 7 actions) + prompt
        kv_capacity = (args.eval_max_steps + 1) * ((args.resolution // 14) ** 2 + 16)
        for kv in ("full", "chunked"):
            flags = ["--kv", kv, "--history", "history", "--kv-capacity", str(kv_capacity)]
            run_stage(f"eval-{kv}", cli + eval_args(args, model, args.out / f"eval-{kv}", flags), log)
        write_results(args.out, results_table(args.out))
    (args.out / "recipe.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"\nrecipe done: checkpoint {model}, log {args.out / 'recipe.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
