"""KV memory per robot: what one session's cache allocates (slot store + rotated view) when its store grows with
the episode (eager sessions: ``grow=True``) against the same cache allocated whole (compiled sessions; every
session before 2026-12-02), step by step through a history-mode episode of OpenVLA-7B's geometry.

The caches run their own bookkeeping, compression and attention on one decoder layer of the geometry (random
q/k/v, a session's forward lengths: the pinned prompt, then per control step a prefill of the last action token,
the frame's image tokens and the prompt's tail, and 6 single-token decodes). How many slots a store allocates does
not depend on the layer count or the dtype, so the bytes printed are slots x ``--layers`` x KV heads x head size x
2 (K and V) x the dtype's size, for the store and for the view beside it (the torch attention path keeps one).

``--policy-steps N`` adds what a growing store costs a robot's control step: two sessions of ``bench_serve.py``'s
policy (LLaMA 512 x 8, 56-px towers, float32, history mode, chunked cache without a budget, 8,193 positions), one
with a growing store and one with its store allocated whole, stepped alternately on the same frames for N steps
(threads pinned): step time p50 / p95 / max of each after 3 steps, the steps at which the store grew, and whether
the two sessions' last action tokens are equal.

    vla-runtime bench kv_memory                      # OpenVLA-7B in bf16, 2,048 positions, ~1 min
    python benchmarks/bench_kv_memory.py --steps 40 --max-chunks 64
    vla-runtime bench kv_memory --policy-steps 60 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_serve import make_policy  # a sibling script: the serve bench's policy (--policy-steps)

from vla_runtime.bench.harness import environment, percentile, pinned_threads, write_json
from vla_runtime.kv import KVConfig, KVMode, make_cache
from vla_runtime.kv.geometry import CacheGeometry
from vla_runtime.models.llama import LLAMA_CONFIGS

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama2-7b", help="LLAMA_CONFIGS entry whose geometry the caches take")
    p.add_argument("--layers", type=int, default=None, help="decoder layers the bytes are counted for (default: the model's)")
    p.add_argument("--bytes-per-value", type=int, default=2, help="2 = bf16 (default), 4 = fp32")
    p.add_argument("--prompt", type=int, default=20, help="pinned prompt tokens")
    p.add_argument("--image-tokens", type=int, default=256)
    p.add_argument("--tail", type=int, default=5, help="prefill tokens beside the image (last action token, 'Out:')")
    p.add_argument("--decodes", type=int, default=6, help="single-token forwards per step")
    p.add_argument("--steps", type=int, default=30, help="control steps (the full cache stops when it is full)")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--max-chunks", type=int, default=128, help="the chunked cache's budget (the serve example's)")
    p.add_argument("--policy-steps", type=int, default=0, help="also time this many steps of the serve bench's policy (above)")
    p.add_argument("--threads", type=int, default=1, help="--policy-steps: torch CPU threads (pinned)")
    p.add_argument("--out", type=Path, default=Path("results/bench_kv_memory"), help="writes <out>.json")
    return p.parse_args(argv)


def configs(args: argparse.Namespace) -> dict[str, KVConfig]:
    window = args.image_tokens + args.tail + args.decodes + 1  # one step's tokens: a session's default window
    return {
        "full": KVConfig.of(KVMode.FULL),
        f"chunked, budget {args.max_chunks}": KVConfig.of(KVMode.CHUNKED, window=window, chunk=args.chunk, max_chunks=args.max_chunks),
        "chunked, no budget": KVConfig.of(KVMode.CHUNKED, window=window, chunk=args.chunk),
        "sink window": KVConfig.of(KVMode.SINK_WINDOW, window=window, n_sink=4),
    }


@torch.no_grad()
def episode(cache, geometry: CacheGeometry, args: argparse.Namespace) -> list[int]:
    """Slots the store allocates after each step (the prompt's forward first) until the episode ends or the cache
    is full."""
    gen = torch.Generator().manual_seed(0)

    def forward(t: int, pin: bool = False) -> None:
        q, k, v = (torch.randn(1, geometry.n_kv_heads, t, geometry.head_dim, generator=gen) for _ in range(3))
        cache.attend(0, q, k, v)
        cache.end_forward(pin=pin)

    forward(args.prompt, pin=True)
    slots = [cache.store.slots]
    for _ in range(args.steps):
        per_step = args.image_tokens + args.tail + args.decodes
        if getattr(cache, "capacity", None) is not None and cache.length + per_step > cache.capacity:
            break
        forward(args.image_tokens + args.tail)
        for _ in range(args.decodes):
            forward(1)
        slots.append(cache.store.slots)
    return slots


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = LLAMA_CONFIGS[args.model]
    layers = args.layers or cfg.n_layers
    one_layer = CacheGeometry(n_layers=1, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, max_position=cfg.max_position,
                              rope=cfg.rope)  # fmt: skip
    per_slot = layers * cfg.n_kv_heads * cfg.head_dim * 2 * args.bytes_per_value  # K and V of one slot, every layer
    rows = {}
    print(f"{args.model}: {layers} layers x {cfg.n_kv_heads} KV heads x {cfg.head_dim}, {args.bytes_per_value} bytes per "
          f"value, {cfg.max_position} positions; per step {args.image_tokens + args.tail} + {args.decodes} x 1 tokens")  # fmt: skip
    print("| cache | steps | slots held at the end | allocated whole: MiB (store + view) | grown: MiB at the end | "
          "grown / whole | slots allocated, step by step |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, kv in configs(args).items():
        whole, grown = make_cache(kv, one_layer, grow=False), make_cache(kv, one_layer, grow=True)
        episode(whole, one_layer, args)
        slots = episode(grown, one_layer, args)
        views = 2 if getattr(grown, "view", None) is not None else 1
        whole_mib, grown_mib = (s * per_slot * views / MIB for s in (whole.store.slots, slots[-1]))
        held = grown.held_slots() // one_layer.n_layers
        assert grown.stats() == whole.stats(), name  # the same episode, whatever the allocation
        rows[name] = {"steps": len(slots) - 1, "held_slots": held, "whole_slots": whole.store.slots, "grown_slots": slots,
                      "whole_mib": whole_mib, "grown_mib": grown_mib, "store_and_view": views == 2}  # fmt: skip
        changes = [s for i, s in enumerate(slots) if i == 0 or s != slots[i - 1]]
        print(f"| {name} | {len(slots) - 1} | {held} | {whole_mib:,.1f} | {grown_mib:,.1f} | {grown_mib / whole_mib:.2f} | "
              f"{' -> '.join(map(str, changes))} |")  # fmt: skip
    steps = None
    if args.policy_steps:
        with pinned_threads(args.threads), tempfile.TemporaryDirectory() as tmp:
            steps = policy_steps(args.policy_steps, Path(tmp))
    write_json(args.out.with_suffix(".json"), env=environment(), args=args, rows=rows, policy_steps=steps)
    return 0


def policy_steps(n: int, root: Path) -> dict:
    """Step times (ms) of a growing and a whole store's session of the serve bench's policy, stepped alternately."""
    import numpy as np

    from vla_runtime.api import Observation
    from vla_runtime.config import SessionConfig

    policy = make_policy(argparse.Namespace(llm="small", seed=0, device="cpu", prepack=False), root)
    config = SessionConfig(history="history", kv=KVConfig(KVMode.CHUNKED))
    grown, whole = (policy.new_session("pick up the red block", config) for _ in range(2))
    whole.cache = make_cache(whole.kv_config, policy.gate_geometry, gate=policy.kv_gate)  # what a session got before
    frames = [np.random.default_rng(i).integers(0, 256, (96, 128, 3), dtype=np.uint8) for i in range(8)]
    times, grew = {"grown": [], "whole": []}, []
    for k in range(n):
        obs, before = Observation(images={"primary": frames[k % 8]}), grown.cache.store.slots
        for name, session in (("grown", grown), ("whole", whole)):
            start = time.perf_counter()
            session.step(obs)
            times[name].append(1e3 * (time.perf_counter() - start))
        if grown.cache.store.slots != before:
            grew.append({"step": k, "slots": [before, grown.cache.store.slots]})
    out = {"grew": grew, "tokens_equal": bool(np.array_equal(grown.last_tokens, whole.last_tokens))}
    print(f"\nthe serve bench's policy, {n} steps alternating (the first 3 not counted):")
    for name, session in (("grown", grown), ("whole", whole)):
        t = times[name][3:]
        out[name] = {"p50_ms": percentile(t, 50), "p95_ms": percentile(t, 95), "max_ms": max(t),
                     "reserved_mib": session.cache.store.reserved_bytes() / MIB}  # fmt: skip
        print(f"  {name:5s} store: step p50 {out[name]['p50_ms']:.1f} / p95 {out[name]['p95_ms']:.1f} / max "
              f"{out[name]['max_ms']:.1f} ms; K/V buffers {out[name]['reserved_mib']:.1f} MiB (store alone)")  # fmt: skip
    print(f"  grown / whole step p50: {out['grown']['p50_ms'] / out['whole']['p50_ms']:.3f}; the store grew at steps "
          f"{[g['step'] for g in grew]}; last action tokens equal: {out['tokens_equal']}")  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
