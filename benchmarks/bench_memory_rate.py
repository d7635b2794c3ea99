"""Control-step time of the two shipped memory policies side by side: history mode (`observations`) with the
chunked cache (``assets/mw-memory-openvla``, its card's cache: window 47, 128 chunks, ``chunk_mass``) and with the
full cache (``assets/mw-memory-full-openvla``, capacity 10452), in one process.

Each episode resets both sessions with the same instruction (two instructions of different lengths, alternating)
and steps them ``--steps`` times on the same frames, step by step, the order of the two alternating from step to
step, so that a drifting machine slows both alike. The memory tasks' episodes run 79-112 steps (95 by default
here). The first ``--warmup-episodes`` are untimed. Per ``--compile`` mode: each cache's step time (median, p10,
p90), its control rate (steps per second of policy time, 1000 / mean ms: what ``vla-runtime eval`` reports), and
the chunked cache's speed against the full cache's (full mean / chunked mean; > 1: the chunked cache is faster).
This is issue 15's "chunked control rate >= full's" measured without the simulator's noise between steps.

    python benchmarks/bench_memory_rate.py --compile off default
    vla-runtime bench memory_rate --steps 200 --compile default     # longer episodes than the tasks'
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from vla_runtime.api import Observation, load_policy
from vla_runtime.bench.harness import environment, print_ratio_table, ratio_table, seeded_main, write_json
from vla_runtime.config import CompileMode, SessionConfig
from vla_runtime.kv import KVConfig

ASSETS = Path(__file__).resolve().parents[1] / "assets"
INSTRUCTIONS = ("remember which object you saw first", "pick the one you saw")
CACHES = {  # name -> (default checkpoint, the card's cache)
    "chunked": (ASSETS / "mw-memory-openvla", {"mode": "chunked", "window": 47, "max_chunks": 128, "chunk_mass": True}),
    "full": (ASSETS / "mw-memory-full-openvla", {"mode": "full", "capacity": 10452}),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunked", type=Path, default=CACHES["chunked"][0], help="chunked-cache policy (default: %(default)s)")
    p.add_argument("--full", type=Path, default=CACHES["full"][0], help="full-cache policy (default: %(default)s)")
    p.add_argument("--compile", dest="compile_modes", nargs="+", type=CompileMode, default=[CompileMode.OFF],
                   help="compile modes to time, one after the other (off, default)")
    p.add_argument("--steps", type=int, default=95, help="control steps per episode (default: %(default)s)")
    p.add_argument("--episodes", type=int, default=4, help="timed episodes per mode (default: %(default)s)")
    p.add_argument("--warmup-episodes", type=int, default=1)
    p.add_argument("--resolution", type=int, default=84, help="frame side in pixels (the cards' eval: 84)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench_memory_rate"), help="writes <out>.json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.episodes < 1 or args.warmup_episodes < 0:
        p.error(f"--steps and --episodes must be >= 1 and --warmup-episodes >= 0, got {args.steps}, {args.episodes}, "
                f"{args.warmup_episodes}")
    for name in CACHES:
        if not (getattr(args, name) / "config.json").is_file():
            p.error(f"--{name} {getattr(args, name)} is not an OpenVLA checkpoint directory (no config.json)")
    return args


def time_episodes(sessions: dict, frames: dict[str, list[Observation]], args: argparse.Namespace) -> dict[str, list[float]]:
    """Milliseconds of every timed step of each session (``frames``: its observations, by the same name): episodes
    stepped in lockstep, the order alternating."""
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for episode in range(args.warmup_episodes + args.episodes):
        for session in sessions.values():
            session.reset(INSTRUCTIONS[episode % len(INSTRUCTIONS)])
        for step in range(args.steps):
            order = list(sessions.items()) if (episode + step) % 2 else list(sessions.items())[::-1]
            for name, session in order:
                start = time.perf_counter()
                session.step(frames[name][step % len(frames[name])])
                if episode >= args.warmup_episodes:
                    times[name].append((time.perf_counter() - start) * 1e3)
    return times


def proprio_state(policy) -> np.ndarray | None:
    """Zeros of the policy's proprio size (the memory policies take the gripper state), or None without one."""
    dim = policy.config.proprio_dim
    return None if dim is None else np.zeros(dim, dtype=np.float32)


def main(argv: list[str] | None = None) -> int:
    return seeded_main(parse_args, run, argv)


def run(args: argparse.Namespace) -> int:
    policies = {name: load_policy(getattr(args, name), device="cpu") for name in CACHES}
    rng = np.random.default_rng(args.seed)
    images = [rng.integers(0, 256, (args.resolution, args.resolution, 3), dtype=np.uint8) for _ in range(8)]
    frames = {name: [Observation(images={"primary": image}, state=proprio_state(policy)) for image in images]
              for name, policy in policies.items()}  # the same frames; the state the policy's proprio projector takes
    times, baselines, rates = {}, {}, {}
    for mode in args.compile_modes:
        sessions = {name: policies[name].new_session(INSTRUCTIONS[0], SessionConfig(
            kv=KVConfig.from_dict(CACHES[name][1]), history="observations", compile=mode)) for name in CACHES}  # fmt: skip
        measured = time_episodes(sessions, frames, args)
        for name, t in measured.items():
            row = f"{name}, compile {mode.value}"
            times[row], baselines[row] = t, f"full, compile {mode.value}"
            rates[row] = 1e3 / statistics.mean(t)
    results = ratio_table(times, baselines)
    print_ratio_table(results)
    for mode in args.compile_modes:
        chunked, full = rates[f"chunked, compile {mode.value}"], rates[f"full, compile {mode.value}"]
        print(f"compile {mode.value}: control rate chunked {chunked:.1f} Hz, full {full:.1f} Hz -> chunked / full "
              f"{chunked / full:.2f}x ({args.episodes} episodes of {args.steps} steps)")
    write_json(args.out.with_suffix(".json"), env=environment(device="cpu", dtype=None, threads=args.threads), args=args,
               results=results, control_rate_hz=rates)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
