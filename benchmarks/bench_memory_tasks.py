"""Memory suite: scripted-expert success and episode lengths, chance levels (stated and a guessing expert's measured
rate), and collection throughput, measured side by side in one process.

Questions: does every expert reach >= 95 % over 50 seeds, how long are the episodes, what does an expert that guesses
the cue achieve next to the stated chance level, and how many frames/s does ``collect`` record at 84 px?

    python benchmarks/bench_memory_tasks.py --episodes 50 --collect-episodes 10 --out results/bench_memory_tasks
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vla_runtime.bench.harness import environment, write_json


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=50, help="expert and guessing-expert episodes per task")
    p.add_argument("--collect-episodes", type=int, default=10, help="episodes per task in the timed collection")
    p.add_argument("--camera", default="corner")
    p.add_argument("--resolution", type=int, default=84)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guess-seed", type=int, default=1_000_000, help="the guessing expert's cue of seed s is that of guess-seed + s")
    p.add_argument("--out", default="results/bench_memory_tasks")
    return p.parse_args(argv)


def run(env, episode, belief=None) -> tuple[bool, int]:
    env.reset_memory(episode, belief=belief)
    done = success = False
    while not done:
        _, done, success, info = env.step(env.expert_action())
    return success, info.step


def experts(args) -> dict:
    """Expert and guessing expert on seeds seed .. seed + episodes - 1 (state only: the judges need no images)."""
    from vla_runtime.sim import MEMORY_TASKS, MetaWorldConfig, MetaWorldEnv

    out = {}
    with MetaWorldEnv(MetaWorldConfig(cameras=())) as env:
        for name, cls in MEMORY_TASKS.items():
            seeds = range(args.seed, args.seed + args.episodes)
            expert = [run(env, cls.sample(s)) for s in seeds]
            guess = [run(env, cls.sample(s), belief=cls.guess_cue(cls.sample(s), args.guess_seed + s)) for s in seeds]
            lengths = [n for _, n in expert]
            out[name] = {
                "kind": cls.kind,
                "expert_success": float(np.mean([ok for ok, _ in expert])),
                "length_mean": float(np.mean(lengths)),
                "length_min": int(min(lengths)),
                "length_max": int(max(lengths)),
                "step_limit": cls.max_steps,
                "chance_level": cls.chance_level(),
                "guessing_expert_success": float(np.mean([ok for ok, _ in guess])),
            }
    return out


def collection(args) -> dict:
    """Wall time of ``collect`` per task (rendering + PNG encoding + parquet), frames/s."""
    from vla_runtime.sim import MEMORY_TASKS, MetaWorldConfig
    from vla_runtime.sim.collect import CollectConfig, collect

    out = {}
    tmp = Path(tempfile.mkdtemp())
    try:
        env = MetaWorldConfig(cameras=(args.camera,), resolution=(args.resolution, args.resolution))
        for name in MEMORY_TASKS:
            t0 = time.perf_counter()
            result = collect(CollectConfig([name], args.collect_episodes, tmp / name, seed=args.seed, env=env), progress=False)[name]
            wall = time.perf_counter() - t0
            out[name] = {"episodes": result.kept, "failed": result.failed, "frames": result.frames, "seconds": wall,
                         "frames_per_s": result.frames / wall}  # fmt: skip
    finally:
        shutil.rmtree(tmp)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    ex, co = experts(args), collection(args)
    print(f"memory suite, {args.episodes} seeds from {args.seed}; collection {args.collect_episodes} episodes/task, "
          f"{args.camera} {args.resolution}px")  # fmt: skip
    print(f"{'task':<18} {'kind':<10} {'expert':>7} {'len mean':>8} {'min':>4} {'max':>4} {'limit':>5} {'chance':>7} "
          f"{'guessing':>8} {'collect fr/s':>12}")  # fmt: skip
    for name, r in ex.items():
        print(f"{name:<18} {r['kind']:<10} {r['expert_success']:>7.0%} {r['length_mean']:>8.1f} {r['length_min']:>4} "
              f"{r['length_max']:>4} {r['step_limit']:>5} {r['chance_level']:>7.1%} {r['guessing_expert_success']:>8.0%} "
              f"{co[name]['frames_per_s']:>12.1f}")  # fmt: skip
    out = write_json(Path(args.out).with_suffix(".json"), env=environment(), args=args,
                     results={"experts": ex, "collection": co})  # fmt: skip
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
