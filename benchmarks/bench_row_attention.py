"""Several robots' decode attention on a CPU: one SDPA call per row (what ``RowsCache`` runs) vs one call for all
rows, side by side in one process (interleaved call by call, medians, threads pinned), and whether the one call
gives each row what its own call gives, bit for bit.

Each row holds its own number of keys (``--keys``, one count per row) in its own cache's rotated view
(``[1, Hkv, S, D]``, the first n valid, S = ``--capacity``), and attends with one query token (a decode forward of
one layer). Variants:

- ``per-row calls``: each row over its own view (``RotatedView.attend_rotated``): the baseline;
- ``one call, padded copy``: the rows' keys and values copied into one ``[B, Hkv, Lmax, D]`` buffer (allocated
  once), masked;
- ``one call, pooled views``: the views are rows of one ``[B, Hkv, S, D]`` buffer (a pool a server would own),
  attended in place up to Lmax, masked: no copy;
- ``one call, kernel only``: a padded buffer made beforehand, the call alone: what no layout gets below.

Exactness (``--exact-cases`` random cases of key counts and query lengths): SDPA's output for the same keys
depends on the key length it is given, masked padding included. Printed: in how many cases the unpadded call
equals a masked call at its own length; in how many padding the keys to ``--pad-lengths`` more keys gives one
result; and in how many a row batched with others at one padded length equals that row alone at that length.

    python benchmarks/bench_row_attention.py --threads 1
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from vla_runtime.bench.harness import environment, ratio_table, seeded_main, time_interleaved, write_json

PER_ROW, COPY = "per-row calls", "one call, padded copy"
POOLED, KERNEL = "one call, pooled views", "one call, kernel only"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, nargs="+", default=[64, 72, 80, 84, 88, 96, 104, 112],
                   help="keys each row holds, one count per row (default: eight robots of the serve bench)")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--capacity", type=int, default=8193, help="slots of each row's view (the serve bench's caches)")
    p.add_argument("--exact-cases", type=int, default=20)
    p.add_argument("--pad-lengths", type=int, nargs="+", default=[3, 64, 1024], help="extra keys of the padded calls")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--block", type=int, default=1,
                   help="calls of a variant in a row (1: each call finds the others' data in the caches, as a decode "
                        "forward finds its keys after the layer's weights; more: its own data warm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench_row_attention"), help="writes <out>.json")
    return p.parse_args(argv)


def visible(keys: list[int], length: int) -> torch.Tensor:
    """[B, 1, 1, length] bool: row i sees its first ``keys[i]`` keys."""
    return (torch.arange(length)[None, :] < torch.tensor(keys)[:, None])[:, None, None, :]


def variants(args: argparse.Namespace, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """The four calls (module doc) over the same rows, and the baseline's output [B, Hq, 1, D]."""
    rows, hkv, d, cap = len(args.keys), args.kv_heads, args.head_dim, args.capacity
    pool_k, pool_v = torch.zeros(rows, hkv, cap, d), torch.zeros(rows, hkv, cap, d)  # row i = robot i's view
    for i, n in enumerate(args.keys):
        pool_k[i, :, :n] = torch.randn(hkv, n, d, generator=gen)
        pool_v[i, :, :n] = torch.randn(hkv, n, d, generator=gen)
    own_k, own_v = [], []  # each robot's own buffer, as the caches hold them now
    for i, n in enumerate(args.keys):
        for own, pool in ((own_k, pool_k), (own_v, pool_v)):
            own.append(torch.empty(1, hkv, cap, d))
            own[-1][:, :, :n] = pool[i, :, :n]
    q = torch.randn(rows, args.heads, 1, d, generator=gen)
    longest = max(args.keys)
    mask = visible(args.keys, longest)
    gqa = args.heads != hkv
    padded_k, padded_v = pool_k[:, :, :longest].contiguous(), pool_v[:, :, :longest].contiguous()

    def per_row() -> torch.Tensor:
        outs = [F.scaled_dot_product_attention(q[i : i + 1], own_k[i][:, :, :n], own_v[i][:, :, :n], enable_gqa=gqa)
                for i, n in enumerate(args.keys)]  # fmt: skip
        return torch.cat(outs)

    # allocated once, zeroed: the masked padding must be finite (a masked key's weight is 0, and 0 * NaN is NaN)
    copy_k, copy_v = torch.zeros(rows, hkv, longest, d), torch.zeros(rows, hkv, longest, d)

    def copy() -> torch.Tensor:
        for i, n in enumerate(args.keys):
            copy_k[i, :, :n], copy_v[i, :, :n] = own_k[i][0, :, :n], own_v[i][0, :, :n]
        return F.scaled_dot_product_attention(q, copy_k, copy_v, attn_mask=mask, enable_gqa=gqa)

    def pooled() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, pool_k[:, :, :longest], pool_v[:, :, :longest], attn_mask=mask,
                                              enable_gqa=gqa)  # fmt: skip

    def kernel() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, padded_k, padded_v, attn_mask=mask, enable_gqa=gqa)

    return {PER_ROW: per_row, COPY: copy, POOLED: pooled, KERNEL: kernel}, per_row()


def exactness(args: argparse.Namespace, gen: torch.Generator) -> dict[str, int]:
    """Counts over ``--exact-cases`` random cases (module doc)."""
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    counts = {"cases": args.exact_cases, "unpadded_equals_masked": 0, "paddings_agree": 0, "batched_equals_alone": 0}
    for _ in range(args.exact_cases):
        n = int(torch.randint(8, 600, (), generator=gen))
        t = int(torch.randint(1, 9, (), generator=gen))
        q = torch.randn(1, hq, t, d, generator=gen)
        k, v = torch.randn(1, hkv, n, d, generator=gen), torch.randn(1, hkv, n, d, generator=gen)
        causal = torch.ones(t, n, dtype=torch.bool).tril(n - t)  # query j sees keys 0 .. n - t + j

        def padded(extra: int, others: int = 0) -> torch.Tensor:
            """The row (row 0 of ``others + 1``) at ``n + extra`` keys, the other rows random with random counts."""
            s = n + extra
            kp = torch.randn(others + 1, hkv, s, d, generator=gen)
            vp = torch.randn(others + 1, hkv, s, d, generator=gen)
            kp[0, :, n:], vp[0, :, n:] = 0, 0
            kp[0, :, :n], vp[0, :, :n] = k[0], v[0]
            m = torch.zeros(others + 1, 1, t, s, dtype=torch.bool)
            m[0, 0, :, :n] = causal
            for r in range(1, others + 1):
                m[r, 0, :, : int(torch.randint(1, s + 1, (), generator=gen))] = True
            qs = torch.cat([q, torch.randn(others, hq, t, d, generator=gen)])
            return F.scaled_dot_product_attention(qs, kp, vp, attn_mask=m, enable_gqa=hq != hkv)[:1]

        plain = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=hq != hkv)
        at_own = padded(0)
        counts["unpadded_equals_masked"] += torch.equal(plain, at_own)
        counts["paddings_agree"] += all(torch.equal(at_own, padded(extra)) for extra in args.pad_lengths)
        longest = args.pad_lengths[-1]
        counts["batched_equals_alone"] += torch.equal(padded(longest), padded(longest, others=3))
    return counts


def run(args: argparse.Namespace) -> int:
    if any(n < 1 or n > args.capacity for n in args.keys):
        raise SystemExit(f"--keys must each be 1..--capacity ({args.capacity}), got {args.keys}")
    gen = torch.Generator().manual_seed(args.seed)
    calls, reference = variants(args, gen)
    agreement = {name: float((fn() - reference).abs().max()) for name, fn in calls.items()}
    results = ratio_table(time_interleaved(calls, warmup=args.warmup, repeats=args.repeats, block=args.block), PER_ROW)
    exact = exactness(args, gen)
    print(f"{len(args.keys)} rows of {args.keys} keys, {args.heads} / {args.kv_heads} heads of {args.head_dim}, "
          f"views of {args.capacity} slots, block {args.block}: one layer's decode attention")  # fmt: skip
    print(f"{'variant':24s} | median us |  p10 |  p90 | per-row calls / variant | largest difference")
    for name, r in results.items():
        print(f"{name:24s} | {r['median_ms'] * 1e3:9.1f} | {r['p10_ms'] * 1e3:4.0f} | {r['p90_ms'] * 1e3:4.0f} | "
              f"{r['ratio']:23.2f} | {agreement[name]:.1e}")  # fmt: skip
    print(f"exactness, {exact['cases']} cases: "
          f"unpadded == masked at its own length in {exact['unpadded_equals_masked']}; "
          f"padded by {args.pad_lengths} more keys, one result in {exact['paddings_agree']}; "
          f"a row batched == alone at one padded length in {exact['batched_equals_alone']}")  # fmt: skip
    write_json(args.out.with_suffix(".json"), env=environment(threads=args.threads), args=args, results=results,
               max_abs_diff=agreement, exactness=exact)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    return seeded_main(parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
