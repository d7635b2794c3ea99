"""Fused-RoPE chunked attention (Triton) vs gathering the regions and calling PyTorch SDPA, 1k-32k cached tokens.

Question: how long does one layer's attention take over a chunked cache of N keys (a slot list into one store,
keys without RoPE), for decode (T=1) and a frame's prefill (T=256), and what memory bandwidth does the kernel
reach as a fraction of the GPU's peak? Providers, all in one process on the same inputs:

- ``triton``: ``vla_kernels.chunked_attention`` (gather by slot, RoPE and GQA inside the kernel).
- ``gather+sdpa`` (the baseline): ``index_select`` the listed slots, rotate q and the keys (float32 math,
  the reference's rounding), SDPA (no mask for decode, where every key is visible; the [T, N] position mask
  for prefill).
- ``sdpa-contiguous``: SDPA alone over keys already gathered and rotated in contiguous memory, i.e. what a
  cache that kept rotated, compacted copies would pay per call (a floor for any non-fused approach).

Bandwidth counts the bytes the attention must move at least (gathered K and V rows, q, out, the slot and
position lists); the peak is the device's (memory clock x bus width x 2), beside a measured device copy.
Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs).

Usage:
    python benchmarks/bench_kernels.py [--geometry llama2-7b llama3-8b] [--contexts 1024 ... 32768]
        [--queries 1 256] [--dtype bfloat16] [--out results/bench_kernels]

On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vla_runtime.bench.harness import environment, pinned_threads, pyplot, save_figure, summarize, write_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Geometry:
    """Attention heads of one decoder layer."""

    q_heads: int
    kv_heads: int
    head_dim: int


GEOMETRIES = {
    "llama2-7b": Geometry(32, 32, 128),  # OpenVLA / CogACT / HybridVLA backbone
    "llama3-8b": Geometry(32, 8, 128),  # GQA 4
    "qwen2-0.5b": Geometry(14, 2, 64),  # GQA 7, head dim 64
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--geometry", nargs="+", default=["llama2-7b", "llama3-8b"], choices=list(GEOMETRIES))
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--queries", nargs="+", type=int, default=[1, 256], help="new tokens T per call")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up budget per provider")
    p.add_argument("--rep-ms", type=float, default=200.0, help="do_bench timing budget per provider")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_kernels")
    return p.parse_args(argv)


def make_case(geo: Geometry, n_keys: int, n_queries: int, *, batch: int, dtype, device, seed: int) -> dict:
    """A chunked-cache layout: N listed keys out of a store with 25% unlisted slots (dropped chunks), in slot
    order, compact positions; the T new tokens are the last listed keys."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    slots_total = n_keys + n_keys // 4
    slots = torch.randperm(slots_total, generator=gen)[:n_keys].sort().values
    store = (batch, geo.kv_heads, slots_total, geo.head_dim)
    d = geo.head_dim
    return dict(
        q=torch.randn(batch, geo.q_heads, n_queries, d, generator=gen).to(device=device, dtype=dtype),
        k_store=torch.randn(store, generator=gen).to(device=device, dtype=dtype),
        v_store=torch.randn(store, generator=gen).to(device=device, dtype=dtype),
        kv_slots=slots.to(device=device, dtype=torch.int32),
        kv_pos=torch.arange(n_keys, dtype=torch.int32, device=device),
        q_pos=torch.arange(n_keys - n_queries, n_keys, dtype=torch.int32, device=device),
        inv_freq=(1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(device),
    )


def gather_sdpa(q, k_store, v_store, kv_slots, kv_pos, q_pos, inv_freq):
    """Baseline: gather the listed slots, rotate (float32 math, one rounding), SDPA."""
    from vla_kernels.rope_ref import rope_angles, rotate

    idx = kv_slots.long()
    k = rotate(k_store.index_select(2, idx), *rope_angles(kv_pos, inv_freq))  # [B, Hkv, N, D]
    v = v_store.index_select(2, idx)  # [B, Hkv, N, D]
    q = rotate(q, *rope_angles(q_pos, inv_freq))  # [B, Hq, T, D]
    mask = None if q.shape[2] == 1 else kv_pos[None, :] <= q_pos[:, None]  # decode: every key is visible
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def contiguous_sdpa_fn(case: dict):
    """SDPA alone over pre-gathered, pre-rotated contiguous keys (built once, outside the timing)."""
    from vla_kernels.rope_ref import rope_angles, rotate

    idx = case["kv_slots"].long()
    k = rotate(case["k_store"].index_select(2, idx), *rope_angles(case["kv_pos"], case["inv_freq"])).contiguous()
    v = case["v_store"].index_select(2, idx).contiguous()
    q = rotate(case["q"], *rope_angles(case["q_pos"], case["inv_freq"]))
    mask = None if q.shape[2] == 1 else case["kv_pos"][None, :] <= case["q_pos"][:, None]
    gqa = q.shape[1] != k.shape[1]
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def min_bytes(case: dict) -> int:
    """Bytes any implementation must move: gathered K and V rows, q, out, slot and position lists."""
    b, hkv, _, d = case["k_store"].shape
    n = case["kv_slots"].shape[0]
    item = case["k_store"].element_size()
    return 2 * b * hkv * n * d * item + 2 * case["q"].numel() * item + 8 * n + 4 * case["q_pos"].numel()


def attention_flops(case: dict) -> int:
    """Multiply-adds x 2 of QK^T and PV over all listed keys."""
    b, hq, t, d = case["q"].shape
    return 4 * b * hq * t * case["kv_slots"].shape[0] * d


def peak_bandwidth(device: torch.device) -> tuple[float | None, float]:
    """(spec peak from the memory clock and bus width, or None; measured device-to-device copy), bytes/s."""
    import triton.testing

    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    spec = 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB, several times any L2
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return spec, 2 * src.numel() / (ms * 1e-3)


def time_ms(fn, args: argparse.Namespace) -> list[float]:
    import triton.testing

    return list(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="all"))


def run(args: argparse.Namespace, device: torch.device, *, timer=time_ms, providers=None) -> dict:
    """Time every provider on every (geometry, T, N); check outputs agree first. Returns the results dict."""
    from vla_kernels import chunked_attention, chunked_attention_ref

    dtype = DTYPES[args.dtype]
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    results = {}
    for geo_name in args.geometry:
        geo = GEOMETRIES[geo_name]
        for t in args.queries:
            for n in args.contexts:
                case = make_case(geo, n, t, batch=args.batch, dtype=dtype, device=device, seed=args.seed)
                fns = providers(case) if providers else {
                    "gather+sdpa": lambda c=case: gather_sdpa(**c),
                    "triton": lambda c=case: chunked_attention(**c),
                    "sdpa-contiguous": contiguous_sdpa_fn(case),
                }
                expected = chunked_attention_ref(**case).float()
                for name, fn in fns.items():
                    torch.testing.assert_close(fn().float(), expected, atol=tol, rtol=tol, msg=lambda m, p=name: f"{p}: {m}")
                base = None
                for name, fn in fns.items():
                    entry = summarize(timer(fn, args))
                    base = base or entry["median_ms"]
                    seconds = entry["median_ms"] * 1e-3
                    entry.update(
                        geometry=geo_name, queries=t, context=n, provider=name,
                        speedup_vs_baseline=base / entry["median_ms"],
                        gbps=min_bytes(case) / seconds / 1e9, tflops=attention_flops(case) / seconds / 1e12,
                    )
                    results[f"{geo_name}/T={t}/N={n}/{name}"] = entry
                del case
    return results


def add_peak_fractions(results: dict, spec: float | None, copy: float) -> None:
    for entry in results.values():
        entry["frac_of_peak"] = entry["gbps"] * 1e9 / spec if spec else None
        entry["frac_of_copy"] = entry["gbps"] * 1e9 / copy


def print_table(results: dict) -> None:
    print(f"{'geometry':<11} {'T':>4} {'N':>6} {'provider':<16} {'median ms':>10} {'p10':>8} {'p90':>8} "
          f"{'GB/s':>7} {'%peak':>6} {'TFLOP/s':>8} {'x vs gather+sdpa':>16}")
    for e in results.values():
        frac = f"{100 * e['frac_of_peak']:.0f}" if e.get("frac_of_peak") is not None else "-"
        print(f"{e['geometry']:<11} {e['queries']:>4} {e['context']:>6} {e['provider']:<16} {e['median_ms']:>10.4f} "
              f"{e['p10_ms']:>8.4f} {e['p90_ms']:>8.4f} {e['gbps']:>7.0f} {frac:>6} {e['tflops']:>8.1f} "
              f"{e['speedup_vs_baseline']:>16.2f}")


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(e["geometry"], e["queries"]) for e in results.values()})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (geo, t) in zip(axes[0], panels):
        for provider in dict.fromkeys(e["provider"] for e in results.values()):
            rows = [e for e in results.values() if (e["geometry"], e["queries"], e["provider"]) == (geo, t, provider)]
            ax.plot([e["context"] for e in rows], [e["median_ms"] for e in rows], marker="o", label=provider)
        ax.set(xscale="log", yscale="log", xlabel="cached tokens N", ylabel="ms", title=f"{geo}, T={t}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    save_figure(fig, path)


def kernel_environment(device: torch.device, dtype: str, threads: int, spec: float | None, copy: float) -> dict:
    """The harness's record plus the Triton version and the device's peak and measured copy bandwidth."""
    import triton

    return environment(
        device=device, dtype=dtype, threads=threads, triton=triton.__version__,
        peak_bandwidth_gbps=spec / 1e9 if spec else None, copy_bandwidth_gbps=copy / 1e9,
    )  # fmt: skip


def write(results: dict, args: argparse.Namespace, env: dict) -> Path:
    out = Path(args.out)
    write_json(out.with_suffix(".json"), env=env, args=args, results=results)
    plot(results, out.with_suffix(".png"))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU (the Triton kernels run only there); none here, nothing measured.")
        return 0
    torch.manual_seed(args.seed)
    with pinned_threads(args.threads):
        spec, copy = peak_bandwidth(device)
        results = run(args, device)
    add_peak_fractions(results, spec, copy)
    env = kernel_environment(device, args.dtype, args.threads, spec, copy)
    print(f"# {env['device_name']}: peak {env['peak_bandwidth_gbps'] or math.nan:.0f} GB/s (spec), "
          f"copy {env['copy_bandwidth_gbps']:.0f} GB/s (measured); {args.dtype}, batch {args.batch}")
    print_table(results)
    out = write(results, args, env)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
