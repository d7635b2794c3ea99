"""How far is stored per-segment KV from in-context KV, layer by layer, and how does it pull the
query's attention? (issue 20: why reused KV damages answers.)

For KitchenWorld prompts (40 segments) on SmolLM2-135M: each segment's stored KV (prefilled right
after the system prefix, as every stored-KV method does) against the KV a full prefill computes for
the same tokens, as the relative L2 deviation of keys (pre-RoPE) and values per layer; and the
attention mass the last ``--ref-rows`` query rows put on the memory when the memory rows read
their stored KV ("stale") against the full prefill ("fresh"), heads averaged.

Usage: python benchmarks/keep_stale_kv.py [--prompts 4] [--context] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kitchen_world  # noqa: E402

from vla_runtime.bench.harness import pinned_threads  # noqa: E402
from vla_runtime.checkpoints.causal_lm import load_causal_lm  # noqa: E402
from vla_runtime.checkpoints.gguf import cached_conversion  # noqa: E402
from vla_runtime.kv.rope import apply_rope, rope_cos_sin  # noqa: E402
from vla_runtime.memory import EmbodiedMemory, KVStore, MemoryConfig, MemoryPrefill, PrefillConfig, PromptBuilder, SentenceEncoder  # noqa: E402


class MassProbe:
    """One causal forward over the prompt at positions 0..S-1 (the ``attend`` protocol). With
    ``k_mem, v_mem: [L, Hkv, M, D]`` (pre-RoPE) the memory rows ``[start, start + M)`` read them instead
    of their own k/v. Records per layer the query rows' attention mass on the memory (heads and rows
    averaged) and the k/v the memory rows used."""

    def __init__(self, rope, start: int, end: int, ref_rows: int, k_mem=None, v_mem=None) -> None:
        self.rope, self.start, self.end, self.ref_rows = rope, start, end, ref_rows
        self.k_mem, self.v_mem = k_mem, v_mem
        self.mass: list[float] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a, b = self.start, self.end
        if self.k_mem is not None:
            k_raw, v = k_raw.clone(), v.clone()
            k_raw[0][:, a:b], v[0][:, a:b] = self.k_mem[layer], self.v_mem[layer]
        self.k.append(k_raw[0][:, a:b])
        self.v.append(v[0][:, a:b])
        s = q.shape[2]
        cos, sin = rope_cos_sin(torch.arange(s), self.rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k_raw, cos, sin)
        rows = torch.arange(s - self.ref_rows, s)
        kq = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [1, Hq, S, D]
        scores = (q[:, :, rows] @ kq.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [1, Hq, R, S]
        scores = scores.masked_fill(torch.arange(s)[None, :] > rows[:, None], float("-inf"))
        self.mass.append(float(scores.softmax(-1)[..., a:b].sum(-1).mean()))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def end_forward(self, *, pin: bool = False) -> None:
        pass


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4, help="KitchenWorld questions (one prompt each), averaged")
    p.add_argument("--ref-rows", type=int, default=3, help="last query rows whose attention mass is measured")
    p.add_argument("--context", action="store_true", help="prefill stored units after kitchen_world.UNIT_CONTEXT")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/vla-runtime"))
    args = p.parse_args(argv)
    with pinned_threads(args.threads), torch.no_grad():
        llm = load_causal_lm(str(cached_conversion(None, args.cache, progress=True)))
        model, cfg = llm.model, llm.model.cfg
        memory = EmbodiedMemory(SentenceEncoder(), MemoryConfig(top_k=40))
        world, builder = kitchen_world.KitchenWorld(seed=0), PromptBuilder(llm.tokenizer)
        rows = []  # per prompt: [L, 4] (dev k, dev v, mass fresh, mass stale)
        for step in range(12 + args.prompts):
            world.step()
            memory.advance()
            for sid, text in world.segment_texts().items():
                memory.upsert(sid, text)
            if step < 12:
                continue
            q = world.question(kitchen_world.KINDS[step % 3])
            query = f"Question: {q.text}<|im_end|>\n<|im_start|>assistant\n{q.answer_prefix}"
            context = kitchen_world.UNIT_CONTEXT if args.context else ""
            prompt = builder.build(kitchen_world.SYSTEM, memory.retrieve(q.text), query, context=context)
            a, b, n = prompt.n_prefix, prompt.memory_end, prompt.n_tokens
            res = MemoryPrefill(model, KVStore(), PrefillConfig(method="reuse")).run(prompt)  # stored KV, re-rotated
            k_rot, v_st = (t[:, 0, :, a:b].clone() for t in res.cache.buffers(n))  # [L, Hkv, M, D]
            cos, sin = rope_cos_sin(torch.arange(a, b), cfg.rope)
            k_st = apply_rope(k_rot, cos, -sin)  # back to pre-RoPE
            ids = torch.tensor([prompt.token_ids()])
            fresh = MassProbe(cfg.rope, a, b, args.ref_rows)
            stale = MassProbe(cfg.rope, a, b, args.ref_rows, k_st, v_st)
            model(ids, cache=fresh)
            model(ids, cache=stale)
            rows.append(torch.tensor([[rel(k_st[l], fresh.k[l]), rel(v_st[l], fresh.v[l]), fresh.mass[l], stale.mass[l]] for l in range(cfg.n_layers)]))
        mean = torch.stack(rows).mean(0)
    print(f"{args.prompts} KitchenWorld prompts, 40 segments; stored KV{' (after the context filler)' if args.context else ''} vs a full "
          f"prefill (relative L2), and the last {args.ref_rows} query rows' attention mass on the memory")  # fmt: skip
    print(f"layers 10-{cfg.n_layers - 1} mean: dev v {mean[10:, 1].mean():.2f}, mass fresh {mean[10:, 2].mean():.2f}, stale {mean[10:, 3].mean():.2f}")
    print(f"{'layer':>5} {'dev k':>6} {'dev v':>6} {'mass fresh':>10} {'mass stale':>10}")
    for layer, (dk, dv, mf, ms) in enumerate(mean.tolist()):
        print(f"{layer:5d} {dk:6.2f} {dv:6.2f} {mf:10.2f} {ms:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
