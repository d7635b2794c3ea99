"""Recipe: the memory-suite policies (issue 15), single-frame vs history with every cache, one command.

Stages, each a command a user can also run by hand (the recipe prints them and records them with their
wall times in ``OUT/recipe.json``):

1. ``vla-runtime collect`` on ``--tasks`` (the memory tasks, plus Markovian ones if wanted).
2. a random OpenVLA-architecture checkpoint (``metaworld_demo.llm_geometry``; 84 px, LLaMA 128 x 4).
3. two trainings from scratch on the same data:
   (a) ``model-history``: whole episodes (``--window 0``) through the chunked cache's parallel form,
       the gate trained under the budget inference uses (``--max-chunks``, ``--gate-budget hard``), then
       continued (``--tune``, each round from the previous one) with ``--change-weight``: trained on plain
       cross-entropy, the policy copied its past actions and never left the hold at the go lamp;
   (b) ``model-single``: stock single-frame OpenVLA (no history);
   (c) with ``--full-model``, ``model-history-full``: the history model through the full cache.
   With ``--from-full`` (the path of ``assets/mw-memory-openvla``: its card has the commands), (a) is not trained
   from scratch; instead ``model-history-full`` gets a chunk gate fitted to it frozen (``--gates-only``,
   ``model-history-full-gated``),
   then every weight and the gate are fine-tuned through the chunked cache under the budget
   (``model-history-f2c``): a policy trained on raw tokens does not read the aggregated chunks until it is
   trained through them; with ``--widen-chunks N`` that model is fine-tuned once more under a budget of N chunks
   (``model-history-f2c<N>``), which evaluates at N; ``--cue-rounds K`` fine-tunes that K more times with the
   cue-count loss (``--cue-weight``: a probe regresses how many presses / cue frames came so far;
   ``model-history-f2c<N>-cue<k>``) and ``--mass-rounds K`` K more times with chunk keys weighted by their tokens
   (``--chunk-mass``; ``model-history-f2c<N>-mass<k>``, the shipped policy at K = 2), the last of which evaluates.
4. ``vla-runtime eval`` on held-out seeds: (b) single; (a) with the full cache; (a) with a sliding window
   (``sink_window``) holding the KV bytes of the chunked cache at its budget (``--kv-match-chunks``);
   (a) with the chunked cache (``--retention-plots``: what the gate kept, per episode); with ``--full-model`` the
   full condition runs (c), with ``--from-full`` the window and chunked conditions run ``model-history-f2c``.
   ``OUT/results.md`` tables success, control rate, p95 step latency and peak KV side by side.

    python -m vla_finetune.recipes.metaworld_memory --out runs/memory --tasks TASK1,TASK2
    python -m vla_finetune.recipes.metaworld_memory --out /tmp/m --tasks reach-v3 --episodes 1 --resolution 28 \\
        --llm-dim 64 --llm-layers 1 --max-steps 2 --eval-episodes 1 --eval-max-steps 4 --eval-workers 1   # smoke

The history training (all rounds) and the single-frame one each fit <= 1 hour on 2 CPU cores at the defaults (whole-episode training runs at
~3,900 tokens per CPU-second on one thread since the gate's LSTM runs fused (2,900 before), demo geometry: ``benchmarks/bench_episode_training.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from .metaworld_demo import add_common_args, eval_args, llm_geometry, run_stage, write_results

# the evaluated conditions, in table order (``eval_flags`` says what each runs)
CONDITIONS = ("single", "history-full", "history-window", "history-chunked")
WIDEN_STEPS = 293  # --widen-steps' default: the shipped 128-chunk fine-tune's step count
CUE_STEPS = 264  # --cue-steps' default: the cue-loss rounds' step count
MASS_STEPS = 264  # --mass-steps' default: the shipped chunk-mass rounds' step count
CHUNK = 16  # chunk size (KVConfig's default); `vla-runtime eval --kv chunked` takes it from the trained gate


def eval_flags(condition: str, args: argparse.Namespace, window: int, chunks: int) -> list[str]:
    """The ``vla-runtime eval`` flags of one condition; ``window``: the history model's raw window (tokens),
    ``chunks``: the chunk budget it was trained under."""
    capacity = (args.eval_max_steps + 1) * ((args.resolution // 14) ** 2 + 16)  # the full cache holds the episode
    if condition == "single":
        return ["--history", "single", "--kv", "full"]
    if condition == "history-full":
        return ["--history", args.context, "--kv", "full", "--kv-capacity", str(capacity)]
    budget = [str(window), "--kv-match-chunks" if condition == "history-window" else "--kv-max-chunks", str(chunks)]
    if condition == "history-window":  # the same KV bytes as the chunked cache at its budget
        return ["--history", args.context, "--kv", "sink_window", "--kv-window", *budget]
    return ["--history", args.context, "--kv", "chunked", "--kv-window", *budget, "--retention-plots"]


def tune_rounds(text: str) -> list[tuple[int, float]]:
    """``--tune`` ``"300:5e-4,400:3e-4"`` -> [(steps, lr), ...]; ``""`` -> none."""
    rounds = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        steps, _, lr = part.partition(":")
        try:
            rounds.append((int(steps), float(lr)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tune takes STEPS:LR pairs separated by commas, got {part!r}") from None
    return rounds


def results_table(out: Path) -> str:
    """Markdown: per task and condition, success, control rate, p95 step latency, peak KV."""
    rows = ["| task | condition | success | control rate (Hz) | step p95 (ms) | peak KV (KiB) |", "|---|---|---|---|---|---|"]
    summaries = {c: json.loads((out / f"eval-{c}" / "report.json").read_text())["summary"] for c in CONDITIONS}
    for task in [*summaries[CONDITIONS[0]]["tasks"], "overall"]:
        for c, s in summaries.items():
            m = s["overall"] if task == "overall" else s["tasks"][task]
            rows.append(f"| {task} | {c} | {m['successes']}/{m['episodes']} ({100 * m['success_rate']:.0f} %) "
                        f"| {m['control_rate_hz']:.1f} | {m['step_latency_ms']['p95']:.1f} | {m['kv_bytes_max'] / 1024:.0f} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vla_finetune.recipes.metaworld_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_common_args(p, tasks=None)
    p.add_argument("--context", choices=("history", "observations"), default="history",
                   help="the history model's context: history (frames and action tokens; the shipped policy) or "
                        "observations (frames only, no past actions to copy; try with --tune '')")
    p.add_argument("--max-chunks", type=int, default=32, help="retained chunks per layer, training and eval (default 32)")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps of each first training (default 300)")
    p.add_argument("--tune", type=tune_rounds, default=tune_rounds("300:5e-4,400:3e-4"), metavar="STEPS:LR,...",
                   help="history model: rounds continued from the previous one with --change-weight (default 300:5e-4,400:3e-4)")
    p.add_argument("--change-weight", type=float, default=5.0, help="loss weight of changing action tokens in the --tune rounds (default 5)")
    p.add_argument("--time-budget", type=float, default=None, metavar="MIN",
                   help="minutes per training stage: steps fitted to the measured rate, --max-steps and the --tune "
                        "steps become upper bounds (a GPU for a fixed lease)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="warm-up steps of each first training (default: --max-steps / 20; give it with --time-budget)")
    p.add_argument("--goal-weight", type=float, default=0.0,
                   help="every training: weight of the auxiliary goal loss (vla-runtime finetune --goal-weight; default 0)")
    p.add_argument("--full-model", action="store_true",
                   help="also train model-history-full, the history model through the full cache (--kv full), and "
                        "evaluate the history + full condition on it (default: on the chunked-trained model)")
    p.add_argument("--from-full", action="store_true",
                   help="the shipped policy's path (implies --full-model): a gate fitted to model-history-full, then every "
                        "weight fine-tuned through the chunked cache; no history model from scratch, no --tune rounds")
    p.add_argument("--gate-steps", type=int, default=820, help="--from-full: gate-fit steps (default 820, the shipped run's)")
    p.add_argument("--f2c-steps", type=int, default=501, help="--from-full: fine-tune steps through the chunked cache (default 501)")
    p.add_argument("--f2c-lr", type=float, default=2e-4, help="--from-full: the fine-tune's policy learning rate (default 2e-4)")
    p.add_argument("--f2c-gate-lr", type=float, default=1e-3, help="--from-full: the fine-tune's gate learning rate (default 1e-3)")
    p.add_argument("--widen-chunks", type=int, default=0, metavar="N",
                   help="--from-full: fine-tune model-history-f2c again under a budget of N chunks per layer "
                        "(model-history-f2c<N>, what the shipped policy is at N=128) and evaluate at N; 0 = no (default)")
    p.add_argument("--widen-steps", type=int, default=WIDEN_STEPS,
                   help=f"--widen-chunks: its fine-tune steps (default {WIDEN_STEPS}, the shipped run's)")
    p.add_argument("--cue-rounds", type=int, default=0, metavar="K",
                   help="--widen-chunks: K more rounds of that fine-tune with the cue-count loss (model-history-f2c<N>-cue<k>); "
                        "0 = none (default)")
    p.add_argument("--cue-weight", type=float, default=1.0, help="--cue-rounds: weight of the cue-count loss (default 1)")
    p.add_argument("--cue-steps", type=int, default=CUE_STEPS, help=f"--cue-rounds: steps per round (default {CUE_STEPS})")
    p.add_argument("--mass-rounds", type=int, default=0, metavar="K",
                   help="--widen-chunks: K more rounds of that fine-tune (after any --cue-rounds) with chunk keys weighted by "
                        "their tokens (--chunk-mass; model-history-f2c<N>-mass<k>, the shipped policy at K=2); 0 = none (default)")
    p.add_argument("--mass-steps", type=int, default=MASS_STEPS, help=f"--mass-rounds: steps per round (default {MASS_STEPS})")
    p.add_argument("--batch-size", type=int, default=4, help="whole episodes per step (default 4)")
    p.add_argument("--single-batch-size", type=int, default=64, help="single-frame samples per step (default 64)")
    p.add_argument("--eval-episodes", type=int, default=30, help="evaluation episodes per task and condition; 0 = skip")
    p.add_argument("--eval-seed", type=int, default=1000, help="first held-out seed (default 1000)")
    p.add_argument("--eval-workers", type=int, default=2, help="parallel evaluation processes (default 2)")
    args = p.parse_args(argv)
    args.full_model = args.full_model or args.from_full
    if args.widen_chunks and not args.from_full:
        p.error("--widen-chunks continues --from-full's model-history-f2c: give --from-full too")
    if args.widen_chunks < 0 or (args.widen_chunks and args.widen_chunks <= args.max_chunks):
        p.error(f"--widen-chunks must exceed --max-chunks ({args.max_chunks}), got {args.widen_chunks}")
    if (args.cue_rounds or args.mass_rounds) and not args.widen_chunks:
        p.error("--cue-rounds and --mass-rounds continue --widen-chunks's model: give --from-full --widen-chunks N too")
    return args


def gated_checkpoint(full: Path, gates: Path, out: Path) -> Path:
    """``full``'s files with the gate fitted to it (``gates``: a ``--gates-only`` run), its training logs as
    ``gates_*``: a policy that loads with its chunked cache."""
    out.mkdir(parents=True, exist_ok=True)
    for f in full.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    for name in ("gates.safetensors", "kv_config.json", "session_config.json"):
        shutil.copy2(gates / name, out / name)
    for name in ("train_log.jsonl", "finetune_config.yaml"):
        if (gates / name).is_file():
            shutil.copy2(gates / name, out / f"gates_{name}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla

    args.out.mkdir(parents=True, exist_ok=True)
    cli = [str(Path(sys.executable).with_name("vla-runtime"))]  # the console script beside this interpreter
    log: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "stages": []}
    data, init = args.out / "data", args.out / "init"
    models = {"single": args.out / "model-single"}
    if not args.from_full:  # --from-full's chunked model comes from the full one (from_full below)
        models = {"history": args.out / "model-history", **models}
    if args.full_model:
        models["history-full"] = args.out / "model-history-full"

    if not (data / "meta" / "info.json").exists():
        run_stage("collect", cli + ["collect", "--sim", "metaworld", "--tasks", args.tasks, "--episodes", str(args.episodes),
                                    "--camera", args.camera, "--resolution", str(args.resolution), "--seed", str(args.seed),
                                    "--out", str(data)], log)  # fmt: skip
    if not (init / "config.json").is_file():
        make_tiny_openvla(init, seed=args.seed, image_size=args.resolution, proprio_dim=4,
                          llm=llm_geometry(args.llm_dim, args.llm_layers), dtype=torch.float32)  # fmt: skip
    common = ["finetune", "--dataset", str(data), "--camera", args.camera, "--dataset-name", "metaworld_memory",
              "--max-steps", str(args.max_steps), "--lr", str(args.lr), "--lr-schedule", "cosine", "--warmup-steps", str(args.warmup_steps or max(args.max_steps // 20, 1)), "--threads", str(args.threads),
              "--save-dtype", "bfloat16", "--seed", str(args.seed), "--cache-dir", str(args.out / "frame-cache")]  # fmt: skip
    if args.time_budget is not None:
        common += ["--time-budget", str(args.time_budget)]
    if args.goal_weight:
        common += ["--goal-weight", str(args.goal_weight)]
    scratch = ["--from-scratch", "--checkpoint", str(init)]
    chunked = ["--history", args.context, "--kv", "chunked", "--window", "0", "--chunk", str(CHUNK), "--max-chunks",
               str(args.max_chunks), "--gate-budget", "hard", "--retention-weight", "0", "--batch-size", str(args.batch_size)]
    flags = {
        "history": chunked,
        "single": ["--history", "single", "--kv", "full", "--batch-size", str(args.single_batch_size)],
        "history-full": ["--history", args.context, "--kv", "full", "--window", "0", "--batch-size", str(args.batch_size)],
    }  # fmt: skip
    for name, model in models.items():
        if (model / "model.safetensors").is_file():
            log["stages"].append({"stage": f"train-{name}", "skipped": f"{model} exists"})
            continue
        run_stage(f"train-{name}", cli + common + scratch + flags[name] + ["--out", str(model)], log)
    if args.from_full:
        models["history"] = from_full(args, cli, common, chunked, models["history-full"], log)
    start = models["history"]
    for i, (steps, lr) in enumerate([] if args.from_full else args.tune, 1):
        model = args.out / f"model-history-tune{i}"
        if not (model / "model.safetensors").is_file():
            tune = [*common, "--from-scratch", *flags["history"], "--checkpoint", str(start), "--max-steps", str(steps), "--lr", str(lr),
                    "--warmup-steps", str(max(steps // 30, 1)), "--seed", str(args.seed + i),
                    "--change-weight", str(args.change_weight), "--out", str(model)]  # later flags override `common`'s
            run_stage(f"tune-history-{i}", cli + tune, log)
        start = models["history"] = model

    if args.eval_episodes > 0:
        window = json.loads((models["history"] / "kv_config.json").read_text())["kv"]["window"]
        for condition in CONDITIONS:
            model = models[condition if condition in ("single", "history-full") and condition in models else "history"]
            flags = ["--no-video", *eval_flags(condition, args, window, args.widen_chunks or args.max_chunks)]
            argv = eval_args(args, model, args.out / f"eval-{condition}", flags, seed=args.eval_seed, workers=args.eval_workers)
            run_stage(f"eval-{condition}", cli + argv, log)
        write_results(args.out, results_table(args.out))
    (args.out / "recipe.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"\nrecipe done: {models['history']} (history, chunked cache) and {models['single']} (single frame); log {args.out / 'recipe.json'}")
    return 0


def from_full(args: argparse.Namespace, cli: list[str], common: list[str], chunked: list[str], full: Path, log: dict) -> Path:
    """``--from-full``'s stages after ``model-history-full``; returns ``model-history-f2c`` (or, with
    ``--widen-chunks N``, ``model-history-f2c<N>``). Flags given here after ``common`` override it (argparse keeps
    the last value)."""
    gates, gated, f2c = args.out / "gates-history-full", args.out / "model-history-full-gated", args.out / "model-history-f2c"
    if not (gates / "gates.safetensors").is_file():
        argv = [*common, "--gates-only", "--checkpoint", str(full), *chunked, "--max-steps", str(args.gate_steps),
                "--warmup-steps", "10", "--goal-weight", "0", "--out", str(gates)]  # fmt: skip
        run_stage("gates-history-full", cli + argv, log)
    if not (gated / "gates.safetensors").is_file():
        gated_checkpoint(full, gates, gated)
    if not (f2c / "model.safetensors").is_file():
        argv = [*common, "--from-scratch", "--checkpoint", str(gated), *chunked, "--max-steps", str(args.f2c_steps),
                "--lr", str(args.f2c_lr), "--gate-lr", str(args.f2c_gate_lr), "--warmup-steps", "10",
                "--seed", str(args.seed + 1), "--out", str(f2c)]  # fmt: skip
        run_stage("train-history-f2c", cli + argv, log)
    if not args.widen_chunks:
        return f2c
    wide = args.out / f"model-history-f2c{args.widen_chunks}"
    if not (wide / "model.safetensors").is_file():
        argv = [*common, "--from-scratch", "--checkpoint", str(f2c), *chunked, "--max-chunks", str(args.widen_chunks),
                "--max-steps", str(args.widen_steps), "--lr", str(args.f2c_lr), "--gate-lr", str(args.f2c_gate_lr), "--warmup-steps", "10",
                "--seed", str(args.seed + 2), "--out", str(wide)]  # fmt: skip
        run_stage(f"train-history-f2c{args.widen_chunks}", cli + argv, log)
    from vla_runtime.data import LeRobotDataset
    from vla_runtime.sim.collect import record_cue_steps

    if args.cue_rounds and "episode_cue_steps" not in LeRobotDataset(args.out / "data").extra.get("per_episode", {}):
        record_cue_steps(args.out / "data")  # a dataset collected before collect recorded them
    rounds = [(f"cue{k}", args.cue_steps, ["--cue-weight", str(args.cue_weight)]) for k in range(1, args.cue_rounds + 1)]
    rounds += [(f"mass{k}", args.mass_steps, ["--chunk-mass"]) for k in range(1, args.mass_rounds + 1)]
    for i, (name, steps, extra) in enumerate(rounds, 1):
        start, wide = wide, args.out / f"model-history-f2c{args.widen_chunks}-{name}"
        if not (wide / "model.safetensors").is_file():
            argv = [*common, "--from-scratch", "--checkpoint", str(start), *chunked, "--max-chunks", str(args.widen_chunks),
                    "--max-steps", str(steps), "--lr", str(args.f2c_lr), "--gate-lr", str(args.f2c_gate_lr),
                    "--warmup-steps", "10", *extra, "--seed", str(args.seed + 2 + i), "--out", str(wide)]  # fmt: skip
            run_stage(f"train-history-f2c{args.widen_chunks}-{name}", cli + argv, log)
    return wide


if __name__ == "__main__":
    raise SystemExit(main())
