"""Meta-World throughput and dataset image fidelity, measured side by side in one process.

Questions: how many frames/s does headless rendering give at the default 224x224 (fast vs full
quality), how many env steps/s with and without rendering, and which dataset image storage reads
back bit-identically (PNG in parquet, lossless H.264, standard H.264 yuv420p)?

    python benchmarks/bench_sim.py --repeats 5 --out results/bench_sim
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vla_runtime.bench.harness import environment, pinned_threads, time_ms, write_json


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="drawer-open-v3")
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--frames", type=int, default=40, help="renders / steps per timed repeat")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench_sim")
    return p.parse_args(argv)


def throughput(args) -> dict:
    """One env at a time (one GL context alive), same task, seed and expert actions for every variant."""
    from vla_runtime.sim import MetaWorldConfig, MetaWorldEnv

    res = (args.resolution, args.resolution)
    variants = {
        "render fast (default)": (MetaWorldConfig(resolution=res), "render"),
        "render full quality": (MetaWorldConfig(resolution=res, fast_render=False), "render"),
        "step, no render": (MetaWorldConfig(cameras=()), "step"),
        "step + render (default)": (MetaWorldConfig(resolution=res), "step"),
    }
    results = {}
    for name, (config, kind) in variants.items():
        with MetaWorldEnv(config) as env:
            env.reset(args.task, args.seed)

            def render(env=env):
                for _ in range(args.frames):
                    env.render()

            def step(env=env):
                env.reset(args.task, args.seed)
                for _ in range(args.frames):
                    env.step(env.expert_action())

            times = time_ms(render if kind == "render" else step, warmup=args.warmup, repeats=args.repeats)
        rate = [args.frames * 1e3 / t for t in times]
        results[name] = {"per_s": rate, "median_per_s": float(np.median(rate))}
    base = results["step, no render"]["median_per_s"]
    for r in results.values():
        r["ratio_vs_no_render_step"] = r["median_per_s"] / base
    results["gl_backend"] = os.environ.get("MUJOCO_GL")
    return results


def fidelity(args) -> dict:
    """Writes one expert episode with each storage and compares what reads back with what was rendered."""
    from vla_runtime.data import DatasetFeatures, LeRobotDataset, LeRobotWriter, WriterConfig
    from vla_runtime.sim import POLICY_ACTION_NAMES, MetaWorldConfig, MetaWorldEnv
    from vla_runtime.sim.collect import run_expert_episode

    with MetaWorldEnv(MetaWorldConfig(resolution=(args.resolution, args.resolution))) as env:
        episode = run_expert_episode(env, args.task, args.seed).episode
        features = DatasetFeatures({"corner2": (args.resolution,) * 2}, env.state_names, list(POLICY_ACTION_NAMES))
    out = {}
    tmp = Path(tempfile.mkdtemp())
    try:
        for name, codec in {"png in parquet": None, "hevc_lossless mp4": "hevc_lossless", "h264 mp4 (yuv420p)": "h264", "av1 mp4": "av1"}.items():
            root = tmp / name.replace(" ", "_")
            t0 = time.perf_counter()
            with LeRobotWriter(root, features, WriterConfig(fps=80, video_codec=codec)) as w:
                w.add_episode(episode)
            write_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = LeRobotDataset(root).episode(0).images["corner2"]
            read_s = time.perf_counter() - t0
            diff = np.abs(back.astype(np.int16) - episode.images["corner2"].astype(np.int16))
            mse = float(np.mean(diff.astype(np.float64) ** 2))
            size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "meta" not in p.parts)
            out[name] = {
                "identical": bool(diff.max() == 0),
                "max_abs_diff": int(diff.max()),
                "psnr_db": None if mse == 0 else float(10 * np.log10(255**2 / mse)),
                "bytes_per_frame": size / len(episode),
                "write_ms_per_frame": write_s * 1e3 / len(episode),
                "read_ms_per_frame": read_s * 1e3 / len(episode),
            }
    finally:
        shutil.rmtree(tmp)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    with pinned_threads(args.threads):
        tp = throughput(args)
        fd = fidelity(args)
    print(f"Meta-World {args.task} {args.resolution}x{args.resolution}, MUJOCO_GL={tp['gl_backend']}, {args.repeats} repeats x {args.frames}")
    print(f"{'measure':<26} {'median /s':>10} {'ratio vs no-render step':>24}")
    for name, r in tp.items():
        if isinstance(r, dict):
            print(f"{name:<26} {r['median_per_s']:>10.1f} {r['ratio_vs_no_render_step']:>24.3f}")
    print(f"\n{'storage':<22} {'identical':>9} {'max|d|':>7} {'PSNR dB':>8} {'B/frame':>9} {'write ms':>9} {'read ms':>8}")
    for name, r in fd.items():
        psnr = "inf" if r["psnr_db"] is None else f"{r['psnr_db']:.1f}"
        print(f"{name:<22} {str(r['identical']):>9} {r['max_abs_diff']:>7} {psnr:>8} {r['bytes_per_frame']:>9.0f} "
              f"{r['write_ms_per_frame']:>9.2f} {r['read_ms_per_frame']:>8.2f}")
    out = write_json(Path(args.out).with_suffix(".json"), env=environment(threads=args.threads), args=args,
                     results={"throughput": tp, "fidelity": fd})  # fmt: skip
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
