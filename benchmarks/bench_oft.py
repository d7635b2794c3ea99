"""Actions per second of OpenVLA-OFT's parallel decoding vs our OpenVLA autoregressive step, same backbone.

One random checkpoint in OFT's real on-disk layout (an OpenVLA directory plus ``action_head--*.pt``) is
loaded twice: as ``openvla-oft`` (one bidirectional forward -> a chunk of ``chunk x action_dim`` actions)
and as plain ``openvla`` (prefill, then ``action_dim`` greedy tokens -> one action). Both see the same
image and instruction, single-frame mode, no proprio token. Timed rounds interleave the two; the table
gives milliseconds per *action* (a step's time over the actions it returns), so the ratio is OFT's
actions/s over OpenVLA's (> 1: OFT delivers actions faster). ``--llm small``: a 512-wide, 8-layer decoder
so the LLM dominates; ``tiny``: the test geometry.

    python benchmarks/bench_oft.py --threads 2 --repeats 20
    python benchmarks/bench_oft.py --llm tiny --repeats 3 --warmup 1   # a quick look
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np

from vla_runtime.api import Observation
from vla_runtime.bench.harness import (
    environment, pinned_threads, positive_int, print_ratio_table, ratio_table, time_interleaved, write_json,
)  # fmt: skip
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.device import resolve_device, resolve_dtype
from vla_runtime.kv.rope import RopeConfig
from vla_runtime.models.llama import LLAMA_CONFIGS, LlamaConfig
from vla_runtime.models.openvla_oft.configuration_oft import OFTPlatform
from vla_runtime.policies.openvla import load_openvla_policy
from vla_runtime.policies.openvla_oft import load_openvla_oft_policy

log = logging.getLogger("bench_oft")
INSTRUCTION = "put the red cube in the blue bowl"
LLMS = {
    "tiny": LLAMA_CONFIGS["tiny"],
    "small": LlamaConfig(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=1376, vocab_size=32064, max_position=8192,
        rope=RopeConfig(head_dim=64, original_max_position=8192),
    ),
}  # fmt: skip
BASELINE = "openvla autoregressive (1 action/step)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm", choices=sorted(LLMS), default="small", help="decoder geometry of the random checkpoint")
    p.add_argument("--platform", choices=[x.value for x in OFTPlatform], default="libero",
                   help="OFT chunk x action dims: libero 8x7, bridge 5x7, aloha 25x14 (default %(default)s)")  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench_oft"), help="writes <out>.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    platform = OFTPlatform(args.platform)
    image = np.random.default_rng(args.seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    obs = Observation(images={"primary": image})
    with pinned_threads(args.threads), tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_openvla_oft(Path(tmp) / "oft", seed=args.seed, platform=platform, proprio=False, llm=LLMS[args.llm])
        oft = load_openvla_oft_policy(path, device=device, dtype=dtype, platform=platform).new_session(INSTRUCTION)
        ar = load_openvla_policy(path, device=device, dtype=dtype).new_session(INSTRUCTION)
        chunk, single = oft.step(obs).actions, ar.step(obs).actions
        if chunk.shape != (oft.policy.chunk_size, oft.policy.action_dim) or single.shape[0] != 1:
            raise SystemExit(f"unexpected action shapes: OFT {chunk.shape}, OpenVLA {single.shape}")
        if not (np.isfinite(chunk).all() and np.isfinite(single).all()):
            raise SystemExit("non-finite actions before timing")
        name = f"openvla-oft parallel (chunk {len(chunk)}/step)"
        fns = {BASELINE: lambda: ar.step(obs), name: lambda: oft.step(obs)}
        times = time_interleaved(fns, warmup=args.warmup, repeats=args.repeats, device=device)
    actions = {BASELINE: 1, name: len(chunk)}
    per_action = {k: [t / actions[k] for t in v] for k, v in times.items()}  # ms per action
    results = ratio_table(per_action, BASELINE)
    for k, r in results.items():
        r["actions_per_step"] = actions[k]
        r["actions_per_s"] = 1e3 / r["median_ms"]
        r["step_median_ms"] = float(np.median(times[k]))
    print(f"ms per action (step time / actions per step), {args.llm} LLM, {device}, {dtype}, {args.threads} thread(s):")
    print_ratio_table(results)
    for k, r in results.items():
        print(f"{k}: {r['actions_per_s']:.1f} actions/s, {r['step_median_ms']:.2f} ms/step")
    write_json(args.out.with_suffix(".json"), env=environment(device=device, dtype=dtype, threads=args.threads), args=args,
               results=results)  # fmt: skip
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(main())
