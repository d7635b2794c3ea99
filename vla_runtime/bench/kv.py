"""How long does one control step take with a long history: Full vs SinkWindow vs ChunkedGated cache?

One step = a frame prefill (``--frame`` tokens, ~256 image tokens) + ``--decode`` single-token forwards
(OpenVLA's 7 action tokens), on top of a history of L tokens (``--lengths``, default 1k..16k), timed
(a) through one decoder layer at LLaMA-2-7B geometry (dim 4096, 32 heads x 128, ffn 11008, fp32) and
(b) end to end through the tiny LLaMA. Beside each median time it prints the KV bytes held and the
analytic FLOPs of the KV-Efficient cost model (seed 002 §3.3: projections 8d², attention 4·N·d over
the N keys a token sees, SwiGLU 6·d·d_ff, plus the aggregator MLP and LSTM per chunk formed).

The chunked cache runs with C = ``--chunk`` (16), W = one frame, no budget, and a gate whose
readout weights are drawn N(0, 1) and whose ``tau`` is the median score of a calibration stream of
random chunks, so about half of the chunks are kept (the measured retention is printed). The history state is built
by streaming random q/k/v through the cache in frame-sized forwards (the full cache is filled
directly); each timed step runs on a fresh copy of that state, so compression work is timed.

Wall time (median) and the process CPU time are reported side by side: on a shared machine other
processes stretch wall time, not the CPU time of a single-threaded step.

usage:
    python benchmarks/bench_kv.py                      # ~5 min on a quiet 2-core machine
    python benchmarks/bench_kv.py --lengths 1024 4096 16384 --threads 2
    vla-runtime bench kv --parts layer --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from ..device import synchronize
from ..kv import ChunkGate, FullCache, KVConfig, KVMode, make_cache
from ..kv.gate import ChunkGateConfig
from ..models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM
from .harness import environment, pinned_threads, pyplot, save_figure, summarize, write_json

log = logging.getLogger(__name__)

METHODS = (KVMode.FULL, KVMode.SINK_WINDOW, KVMode.CHUNKED)
PARTS = ("layer", "e2e")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_kv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, pinned (1 is steadiest on a shared machine)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_kv", help="writes <out>.json and <out>.png")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384], help="history tokens")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--layer-model", default="llama2-7b", help="LLAMA_CONFIGS entry whose geometry the layer part uses")
    p.add_argument("--frame", type=int, default=256, help="prefill tokens per step (one frame)")
    p.add_argument("--decode", type=int, default=7, help="single-token decode forwards per step")
    p.add_argument("--prompt", type=int, default=20, help="pinned prompt tokens")
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--window", type=int, default=None, help="raw window W (default: one frame)")
    p.add_argument("--n-sink", type=int, default=4)
    args = p.parse_args(argv)
    for name in ("threads", "repeats", "frame", "chunk", "prompt"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.lengths) <= args.prompt:
        p.error(f"--lengths must exceed --prompt ({args.prompt})")
    args.window = args.window or args.frame
    return args


# ---- cost model ---------------------------------------------------------------------------------------
def token_flops(cfg: LlamaConfig, n_keys: int) -> float:
    """Seed 002's per-layer, per-token FLOPs: projections + attention over ``n_keys`` keys + SwiGLU MLP."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    proj = 2 * cfg.dim * (2 * q_dim + 2 * kv_dim)
    return proj + 4 * n_keys * q_dim + 6 * cfg.dim * cfg.ffn_dim


def chunk_flops(cfg: LlamaConfig, gate: ChunkGateConfig) -> float:
    """Per layer and chunk: the key and value aggregator MLPs and one LSTM step, for every KV head."""
    mlp = 2 * (gate.chunk * cfg.head_dim * gate.aggregator_hidden + gate.aggregator_hidden * cfg.head_dim)
    lstm = 2 * 4 * gate.gate_hidden * (2 * cfg.head_dim + gate.gate_hidden)
    return cfg.n_kv_heads * (2 * mlp + lstm)


def step_flops(
    cfg: LlamaConfig, held: int, frame: int, decode: int, *, chunks: int = 0, gate: ChunkGateConfig | None = None
) -> float:
    """All layers' FLOPs of one step starting with ``held`` keys (each new token also sees the earlier new ones)."""
    total = sum(token_flops(cfg, held + i + 1) for i in range(frame + decode))
    if chunks and gate is not None:
        total += chunks * chunk_flops(cfg, gate)
    return cfg.n_layers * total


# ---- caches and history ----------------------------------------------------------------------------
def kv_configs(args: argparse.Namespace, length: int) -> dict[KVMode, KVConfig]:
    """Each timed step runs on a fresh copy of the history, so room for the history plus one step suffices;
    the chunked cache gets a chunk slot for every chunk the history can form (no budget)."""
    step = args.frame + args.decode
    sink_slots = args.prompt + args.n_sink + 2 * args.window + step
    chunk_slots = (length + step) // args.chunk + 1
    return {
        KVMode.FULL: KVConfig.of(KVMode.FULL, capacity=length + step),
        KVMode.SINK_WINDOW: KVConfig.of(KVMode.SINK_WINDOW, window=args.window, n_sink=args.n_sink, capacity=sink_slots),
        KVMode.CHUNKED: KVConfig.of(
            KVMode.CHUNKED, window=args.window, chunk=args.chunk, capacity=3 * (args.window + args.chunk) + chunk_slots
        ),
    }


def benchmark_gate(kv_cfg: KVConfig, cfg: LlamaConfig, seed: int, *, calibration_chunks: int = 256) -> ChunkGate:
    """A gate that keeps about half of the chunks: readout weights ~ N(0, 1) and, per layer, ``tau`` set to
    the median score the gate gives a calibration stream of random chunks (the history is random too)."""
    torch.manual_seed(seed)
    gate = ChunkGate(kv_cfg.gate_config(cfg.geometry))
    with torch.no_grad():
        gate.readout_weight.normal_()
        shape = (cfg.n_layers, 1, cfg.n_kv_heads, calibration_chunks, gate.cfg.chunk, cfg.head_dim)
        k_rep, v_rep = gate.aggregate(torch.randn(shape), torch.randn(shape))  # [L, 1, Hkv, n, D]
        scores, _ = gate.score(k_rep, v_rep, gate.init_state(1, cfg.n_kv_heads))  # [L, 1, n]
        gate.tau.copy_(scores[:, 0].median(dim=1).values)
    return gate


def fill_history(cache, cfg: LlamaConfig, length: int, *, prompt: int, frame: int, gen: torch.Generator, dtype,
                 device: torch.device | str = "cpu") -> None:
    """Bring ``cache`` to the state after ``length`` history tokens (random q/k/v on ``device``, the prompt pinned)."""
    if isinstance(cache, FullCache):  # holds everything: write it directly (rotated keys are just numbers)
        for buf in cache.buffers(length):
            buf.normal_(generator=gen)
        cache.hold(length)
        return
    done = 0
    while done < length:
        n = prompt if done == 0 else min(frame, length - done)
        for layer in range(cfg.n_layers):
            q = torch.randn(1, cfg.n_heads, n, cfg.head_dim, generator=gen).to(device, dtype)
            k, v = (torch.randn(1, cfg.n_kv_heads, n, cfg.head_dim, generator=gen).to(device, dtype) for _ in range(2))
            cache.attend(layer, q, k, v)
        cache.end_forward(pin=done == 0)
        done += n


def clone_cache(cache):
    """A deep copy of the episode state that shares the gate's weights."""
    gate = getattr(cache, "gate", None)
    return copy.deepcopy(cache, memo={id(gate): gate} if gate is not None else None)


# ---- timing ---------------------------------------------------------------------------------------------
def run_step(forward, cache, frame_x: torch.Tensor, decode_x: torch.Tensor) -> tuple[float, float, float]:
    """One step; returns wall-clock (prefill ms, decode ms) and the process CPU ms of the whole step.

    CPU time is reported beside wall time because this machine is shared: other processes stretch wall
    time but not the CPU time this process spends (with ``--threads 1`` it is the step's own work).
    """
    device = frame_x.device
    synchronize(device)
    c0, t0 = time.process_time(), time.perf_counter()
    forward(frame_x, cache)
    synchronize(device)  # on CUDA the clock would read launch time only
    t1 = time.perf_counter()
    for i in range(decode_x.shape[1]):
        forward(decode_x[:, i : i + 1], cache)
    synchronize(device)
    t2, c2 = time.perf_counter(), time.process_time()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (c2 - c0) * 1e3


def time_interleaved(forward, snapshots: dict, frame_x, decode_x, *, warmup: int, repeats: int) -> tuple[dict, dict]:
    """Per method, ``repeats`` ``run_step`` results, each step on a fresh copy of its snapshot
    (copying is not timed). Methods take turns within every repeat, so drifting load hits them alike."""
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in snapshots}
    last = {}
    for r in range(warmup + repeats):
        for name, snapshot in snapshots.items():
            cache = clone_cache(snapshot)
            split = run_step(forward, cache, frame_x, decode_x)
            if r >= warmup:
                times[name].append(split)
            last[name] = cache
    return times, last


def bench_part(part: str, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    """Every method at every length for one part; returns ``{f"{part}/{method}/{L}": record}``."""
    if part == "layer":
        cfg = LlamaConfig.from_name(args.layer_model, n_layers=1)
        torch.manual_seed(args.seed)
        module = DecoderLayer(cfg, 0).to(device=args.device, dtype=dtype).eval()

        def forward(x, cache):
            y = module(x, cache)
            cache.end_forward()
            return y
    else:
        cfg = LlamaConfig.from_name("tiny")
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(cfg).to(device=args.device, dtype=dtype).eval()

        def forward(x, cache):
            return model(inputs_embeds=x, cache=cache, last_only=True)

    gen = torch.Generator().manual_seed(args.seed)
    frame_x = torch.randn(1, args.frame, cfg.dim, generator=gen).to(args.device, dtype)
    decode_x = torch.randn(1, args.decode, cfg.dim, generator=gen).to(args.device, dtype)
    results = {}
    for length in args.lengths:
        snapshots, gates = {}, {}
        for method, kv_cfg in kv_configs(args, length).items():
            needs_gate = kv_cfg.gate_config(cfg.geometry) is not None
            gates[method] = benchmark_gate(kv_cfg, cfg, args.seed) if needs_gate else None
            extra = {"gate": gates[method]} if gates[method] is not None else {}
            cache = make_cache(kv_cfg, cfg.geometry, device=args.device, dtype=dtype, **extra)
            fill_history(cache, cfg, length, prompt=args.prompt, frame=args.frame, gen=gen, dtype=dtype, device=args.device)
            snapshots[method] = cache
        times, last = time_interleaved(forward, snapshots, frame_x, decode_x, warmup=args.warmup, repeats=args.repeats)
        base = None
        for method, cache in snapshots.items():
            before, after = cache.stats(), last[method].stats()
            held = before.tokens_raw + round(before.tokens_compressed)
            formed = getattr(last[method], "chunks_formed", 0) - getattr(cache, "chunks_formed", 0)
            gate_cfg = gates[method].cfg if gates[method] is not None else None
            flops = step_flops(cfg, held, args.frame, args.decode, chunks=formed, gate=gate_cfg)
            total = [p + d for p, d, _ in times[method]]
            record = {
                **summarize(total),
                "prefill_ms": statistics.median(p for p, _, _ in times[method]),
                "decode_ms": statistics.median(d for _, d, _ in times[method]),
                "cpu_ms": statistics.median(c for _, _, c in times[method]),
                "kv_bytes": before.bytes,
                "keys_held": held,
                "gflops": flops / 1e9,
                "chunks_per_step": formed,
                "positions_used": after.positions_used,
                "retained_ratio": before.retained_ratio,
                "stats": before.as_dict(),
            }
            base = base or record
            record["ratio"] = base["median_ms"] / record["median_ms"]
            record["decode_ratio"] = base["decode_ms"] / record["decode_ms"]
            record["cpu_ratio"] = base["cpu_ms"] / record["cpu_ms"]
            record["bytes_ratio"] = base["kv_bytes"] / record["kv_bytes"]
            record["flops_ratio"] = base["gflops"] / record["gflops"]
            results[f"{part}/{method.value}/{length}"] = record
            log.info("%s %s L=%d: %.1f ms", part, method.value, length, record["median_ms"])
        del snapshots, last
    return results


def check_agreement(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, float]:
    """Before timing: with a window covering the episode, the decoupled caches equal the full cache."""
    cfg = LlamaConfig.from_name("tiny")
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(device=args.device, dtype=dtype).eval()
    x = torch.randn(1, args.prompt + 2 * (args.frame + args.decode), cfg.dim).to(args.device, dtype)
    bounds = [args.prompt] + ([args.frame] + [1] * args.decode) * 2
    big = len(x[0]) + 8
    configs = {
        KVMode.FULL: KVConfig.of(KVMode.FULL, capacity=big),
        KVMode.SINK_WINDOW: KVConfig.of(KVMode.SINK_WINDOW, window=big, capacity=2 * big),
        KVMode.CHUNKED: KVConfig.of(KVMode.CHUNKED, window=big, chunk=args.chunk, capacity=4 * big),
    }
    outs = {}
    for mode, kv_cfg in configs.items():
        cache = make_cache(kv_cfg, cfg.geometry, device=args.device, dtype=dtype)
        start, pieces = 0, []
        for n in bounds:
            pieces.append(model(inputs_embeds=x[:, start : start + n], cache=cache, pin=start == 0))
            start += n
        outs[mode] = torch.cat(pieces, dim=1)
    full = outs.pop(KVMode.FULL)
    diffs = {mode.value: float((out - full).abs().max()) for mode, out in outs.items()}
    for name, diff in diffs.items():
        if diff > 1e-3:
            raise RuntimeError(f"{name} with a window covering the episode differs from the full cache by {diff}")
    return diffs


# ---- report -----------------------------------------------------------------------------------------
def print_table(results: dict) -> None:
    head = (
        f"{'part':5} {'L':>6} {'method':12} {'median ms':>10} {'p10':>8} {'p90':>8} {'x full':>7} {'prefill':>8} "
        f"{'decode':>8} {'dec x':>6} {'cpu ms':>8} {'cpu x':>6} {'KV MiB':>8} {'x less':>7} {'GFLOP':>7} {'x flops':>7} "
        f"{'keys':>6} {'kept':>5}"
    )
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        part, method, length = name.split("/")
        print(
            f"{part:5} {length:>6} {method:12} {r['median_ms']:10.1f} {r['p10_ms']:8.1f} {r['p90_ms']:8.1f} {r['ratio']:7.2f} "
            f"{r['prefill_ms']:8.1f} {r['decode_ms']:8.1f} {r['decode_ratio']:6.2f} {r['cpu_ms']:8.1f} {r['cpu_ratio']:6.2f} "
            f"{r['kv_bytes'] / 2**20:8.2f} {r['bytes_ratio']:7.1f} {r['gflops']:7.1f} {r['flops_ratio']:7.2f} "
            f"{r['keys_held']:6d} {r['retained_ratio']:5.2f}"
        )


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    parts = sorted({name.split("/")[0] for name in results}, key=PARTS.index)
    fig, axes = plt.subplots(2, len(parts), figsize=(6 * len(parts), 8), squeeze=False)
    for col, part in enumerate(parts):
        for method in (m.value for m in METHODS):
            rows = sorted((int(n.split("/")[2]), r) for n, r in results.items() if n.startswith(f"{part}/{method}/"))
            if not rows:
                continue
            xs = [length for length, _ in rows]
            line = axes[0][col].plot(xs, [r["median_ms"] for _, r in rows], marker="o", label=f"{method} (wall)")[0]
            axes[0][col].plot(xs, [r["cpu_ms"] for _, r in rows], ls="--", color=line.get_color(), label=f"{method} (CPU time)")
            axes[1][col].plot(xs, [r["kv_bytes"] / 2**20 for _, r in rows], marker="o", label=method)
        title = "one decoder layer" if part == "layer" else "tiny LLaMA end to end"
        axes[0][col].set(title=f"step latency: {title}", xlabel="history tokens", ylabel="median ms / step", xscale="log")
        axes[0][col].set_ylim(bottom=0)
        axes[1][col].set(title="KV bytes held", xlabel="history tokens", ylabel="MiB", xscale="log", yscale="log")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with pinned_threads(args.threads):
        return run(args)


def run(args: argparse.Namespace) -> int:
    """Check agreement, time every part, print the table and the summary lines, write the record."""
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    with torch.inference_mode():
        agreement = check_agreement(args, dtype)
        print("window >= episode, max |logits - full|: " + ", ".join(f"{k} {v:.2e}" for k, v in agreement.items()))
        results: dict = {}
        for part in args.parts:
            results.update(bench_part(part, args, dtype))
    print_table(results)
    for part in args.parts:
        for length in args.lengths:
            r = results[f"{part}/chunked/{length}"]
            s = results[f"{part}/sink_window/{length}"]
            print(
                f"{part} L={length}: chunked {r['ratio']:.2f}x faster than full (CPU time {r['cpu_ratio']:.2f}x, cost model "
                f"{r['flops_ratio']:.2f}x), "
                f"{r['bytes_ratio']:.1f}x less KV, retention {r['retained_ratio']:.2f}; sink-window {s['ratio']:.2f}x"
            )
    env = environment(device=args.device, dtype=args.dtype, threads=args.threads)
    write_json(out.with_suffix(".json"), env=env, args=args, agreement=agreement, results=results)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
