"""Ablation: which training objective makes the chunk gate keep the chunk the answer needs, under a budget?

Question: a token early in a sequence decides the target at its end; the chunked cache may hold only
``--budget`` chunks per layer (far fewer than form). Trained with each objective (the LLM and the gate
from the same initialisation, same data, same steps), does streaming inference with hard gates and
``max_chunks = budget`` keep the cue's chunk and answer right?

Task (cache + tiny LLaMA, no vision): a pinned 4-token prompt, then ``--steps`` control steps laid out as
the history sessions lay them out (a 12-token prefill + 3 single-token forwards each); one early step
(random among the first 3) carries ``[MARK, c, c, c]`` with the class c of ``--classes``, every other
token is a random distractor. Loss: cross-entropy of c at the last position of each of the last 3 steps.
Chunk 4, window one step (15 tokens): ~55 chunks form per layer, the cue's leaves the window early.

Objectives (``--variants``):
  soft-budget   soft gates + the relaxed top-M budget (``BudgetMode.SOFT``)
  hard-budget   soft gates, evicted chunks masked as inference does (``BudgetMode.HARD``; vla_finetune's default)
  penalty       no budget in training, a retention term pulls the mean keep probability to budget / chunks
Each is scored by streaming ``ChunkedGatedCache`` runs (hard gates, the budget) on held-out sequences:
accuracy (chance = 1 / classes), the fraction of layers still holding the cue's chunk at the end, and the
same model's accuracy with the full cache (what the LLM learnt to read when nothing is dropped).
Note the gate's LSTM reads every chunk, the cue's too, so its later keep/drop decisions can themselves
carry the cue (a side channel through which chunks are visible, not what they hold): high accuracy
with the cue's chunk gone is that channel, which is why "cue held" is reported beside accuracy.

usage: python benchmarks/ablate_gate_budget.py [--threads 1] [--train-steps 300] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from vla_runtime.bench.harness import environment, pinned_threads, write_json
from vla_runtime.kv import ChunkedGatedCache, ChunkGate, FullCache, FullParams, KVConfig, KVMode
from vla_runtime.kv.budget import BudgetMode
from vla_runtime.kv.chunked_parallel import parallel_forward, step_boundaries
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM

PROMPT, STEP, DECODES, CHUNK = 4, 12, 3, 4
MARK = 1  # cue marker id; class c is id 2 + c; distractors come after
VARIANTS = ("soft-budget", "hard-budget", "penalty")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ablate_gate_budget", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=16, help="control steps per sequence")
    p.add_argument("--budget", type=int, default=2, help="retained chunks per layer (max_chunks)")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval", type=int, default=200, help="held-out sequences per evaluation")
    p.add_argument("--out", default="results/ablate_gate_budget", help="writes <out>.json")
    return p.parse_args(argv)


def model_config() -> LlamaConfig:
    return LlamaConfig.from_name("tiny", vocab_size=64)


def sequences(n: int, *, steps: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [n, N], class [n], first token of the cue [n]."""
    g = torch.Generator().manual_seed(seed)
    bounds = step_boundaries(PROMPT, [STEP] * steps, DECODES)
    ids = torch.randint(2 + classes, 64, (n, sum(bounds)), generator=g)
    label = torch.randint(0, classes, (n,), generator=g)
    step = torch.randint(0, 3, (n,), generator=g)
    cue = PROMPT + (step * (STEP + DECODES) + 3) // CHUNK * CHUNK  # a chunk's start, inside the step's prefill
    for i in range(n):
        ids[i, cue[i] : cue[i] + 4] = torch.tensor([MARK, 2 + label[i], 2 + label[i], 2 + label[i]])
    return ids, label, cue


def targets(steps: int) -> torch.Tensor:
    """Positions whose next-token logits must name the class: the last position of the last 3 steps."""
    ends = torch.tensor(step_boundaries(PROMPT, [STEP] * steps, DECODES)).cumsum(0)
    return ends[[-1 - (1 + DECODES) * j for j in (2, 1, 0)]] - 1


def train(variant: str, args: argparse.Namespace, seed: int) -> tuple[LlamaForCausalLM, ChunkGate, KVConfig, float]:
    torch.manual_seed(seed)
    cfg = model_config()
    model = LlamaForCausalLM(cfg)
    window = STEP + DECODES
    kv = KVConfig.of(KVMode.CHUNKED, chunk=CHUNK, window=window, max_chunks=args.budget, capacity=args.budget + 4 * window)
    gate = ChunkGate(kv.gate_config(cfg.geometry))
    train_kv = kv if variant != "penalty" else KVConfig.of(KVMode.CHUNKED, chunk=CHUNK, window=window, max_chunks=512, capacity=1024)
    budget = BudgetMode.HARD if variant == "hard-budget" else BudgetMode.SOFT
    bounds = step_boundaries(PROMPT, [STEP] * args.steps, DECODES)
    n_chunks = (sum(bounds) - PROMPT - window) // CHUNK
    opt = torch.optim.AdamW([{"params": model.parameters(), "lr": 3e-3}, {"params": gate.parameters(), "lr": 1e-2}])
    pos = targets(args.steps)
    start = time.perf_counter()
    for step in range(args.train_steps):
        ids, label, _ = sequences(args.batch, steps=args.steps, classes=args.classes, seed=seed * 100_003 + step)
        temperature = 0.1 ** (step / max(args.train_steps - 1, 1))  # 1 -> 0.1, as vla_finetune anneals
        x = model.model.embed_tokens(ids)
        logits, aux = parallel_forward(model, x, bounds, PROMPT, gate, train_kv, soft=True, temperature=temperature, budget=budget)
        loss = F.cross_entropy(logits[:, pos, 2 : 2 + args.classes].flatten(0, 1), label.repeat_interleave(len(pos)))
        if variant == "penalty":
            loss = loss + (aux.kept_ratio - args.budget / n_chunks) ** 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), gate.eval(), kv, time.perf_counter() - start


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, gate: ChunkGate, kv: KVConfig, args: argparse.Namespace, seed: int) -> dict:
    """Streaming runs, one sequence at a time (the cache's batch rows share one layout)."""
    bounds = step_boundaries(PROMPT, [STEP] * args.steps, DECODES)
    ids, label, cue = sequences(args.eval, steps=args.steps, classes=args.classes, seed=10**6 + seed)
    right = held = right_full = 0
    for i in range(args.eval):
        caches = {
            "chunked": ChunkedGatedCache(model.cfg.geometry, kv.params, gate=gate),
            "full": FullCache(model.cfg.geometry, FullParams(capacity=sum(bounds))),
        }
        answers = {}
        for name, cache in caches.items():
            start = 0
            for n in bounds:
                logits = model(ids[i : i + 1, start : start + n], cache=cache, pin=start + n <= PROMPT, last_only=True)
                start += n
            answers[name] = int(logits[0, -1, 2 : 2 + args.classes].argmax())
        right += answers["chunked"] == int(label[i])
        right_full += answers["full"] == int(label[i])
        layers = caches["chunked"].retained_starts()
        held += sum(int(cue[i]) in layer for layer in layers) / len(layers)
    return {"accuracy": right / args.eval, "cue_held": held / args.eval, "accuracy_full_cache": right_full / args.eval}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, list[dict]] = {}
    with pinned_threads(args.threads):
        for variant in args.variants:
            for seed in args.seeds:
                model, gate, kv, seconds = train(variant, args, seed)
                r = {"seed": seed, "train_s": round(seconds, 1), **evaluate(model, gate, kv, args, seed)}
                results.setdefault(variant, []).append(r)
                print(f"{variant} seed {seed}: {r}", flush=True)
    print(f"\nrecall under a budget of {args.budget} chunks/layer ({args.steps} steps, {args.classes} classes, "
          f"chance {1 / args.classes:.2f}, {args.train_steps} training steps x {args.batch}, threads {args.threads})")  # fmt: skip
    print(f"{'objective':<12} | {'accuracy':>8} | {'cue held':>8} | {'full-cache acc':>14} | {'train s':>7}")
    for variant, rows in results.items():
        mean = {k: statistics.mean(r[k] for r in rows) for k in ("accuracy", "cue_held", "accuracy_full_cache", "train_s")}
        print(f"{variant:<12} | {mean['accuracy']:>8.2f} | {mean['cue_held']:>8.2f} | {mean['accuracy_full_cache']:>14.2f} | {mean['train_s']:>7.0f}")
    write_json(f"{args.out}.json", env=environment(threads=args.threads), args=args, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
