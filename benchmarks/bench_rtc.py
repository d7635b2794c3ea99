"""Chunk transitions on the control loop: how much the executed action jumps with each blend mode.

A CogACT policy (random, in its real on-disk layout; chunk 16) drives a simulated robot through
``RealtimeEpisode`` (``vla_runtime/sim/realtime.py``): one tick per period whatever the policy does, each step
taking ``--step-periods`` periods of simulated time (default 3, so chunks overlap and refill while the previous
one runs; fixed, so runs repeat exactly). Per blend mode (``none``, ``temporal``, ``adaptive``, ``rtc``) it reports, over the executed
actions of every episode (dimensions 0-5, robot units):

* jitter: mean and p95 of ``|a_k - a_{k-1}|`` over consecutive ticks;
* plan change: when a chunk lands, how much the action queued for the next tick changes (what a robot feels
  as a jerk at the switch), mean over switches;
* empty ticks (the fallback ran).

The weights are random, so the actions are not a task's; what the table shows is how each mode joins
one chunk to the next. ``rtc`` hands every step the queued actions (``ControlLoop.guidance``) and CogACT's
DDIM sampler inpaints them (``models/diffusion.py``: frozen rows replaced, later ones pulled with decaying
weights), so a new chunk continues the old one instead of starting afresh.

    python benchmarks/bench_rtc.py --episodes 4 --ticks 80
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import numpy as np

from vla_runtime.api import load_policy
from vla_runtime.bench.harness import environment, pinned_threads, write_json
from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact
from vla_runtime.config import SessionConfig
from vla_runtime.control import ControlConfig
from vla_runtime.sim.base import SimObservation, StepInfo
from vla_runtime.sim.realtime import RealtimeEpisode

log = logging.getLogger("bench_rtc")
MODES = ("none", "temporal", "adaptive", "rtc")


class DriftingCamera:
    """A scene that changes a little every tick (so every step sees a new frame); ends after ``ticks``."""

    fps = 10

    def __init__(self, ticks: int, size: int, seed: int) -> None:
        self.ticks, self.size, self.rng = ticks, size, np.random.default_rng(seed)
        self.image = self.rng.integers(0, 256, (size, size, 3)).astype(np.int16)
        self.k, self.applied = 0, []

    def observe(self) -> SimObservation:
        self.image = np.clip(self.image + self.rng.integers(-8, 9, self.image.shape), 0, 255)
        return SimObservation({"primary": self.image.astype(np.uint8)}, np.zeros(7), "pick up the block", t=self.k)

    def step(self, action):
        self.applied.append(np.asarray(action, dtype=np.float64))
        self.k += 1
        done = self.k >= self.ticks
        return self.observe(), done, False, StepInfo(self.k, done, np.asarray(action))


class FixedStepTimer:
    """A step timer under which every step takes ``step_s`` (called once before and once after each step):
    runs repeat exactly, whatever the machine's speed."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.calls = step_s, 0

    def __call__(self) -> float:
        self.calls += 1
        return (self.calls // 2) * self.step_s


def run_mode(policy, mode: str, args: argparse.Namespace) -> dict:
    jumps, plan_changes, empty, ticks = [], [], 0, 0
    for episode in range(args.episodes):
        world = DriftingCamera(args.ticks, args.image_size, seed=episode)
        session = policy.new_session("pick up the block", SessionConfig(seed=episode))
        cfg = ControlConfig(rate_hz=args.rate, blend=mode, refill_threshold=args.refill_threshold, align_to_frames=False)
        driver = RealtimeEpisode(world, session, cfg, chunked=True, action_dim=policy.action_dim,
                                 timer=FixedStepTimer(args.step_periods / args.rate))  # fmt: skip
        loop, land = driver.loop, driver.loop.on_result

        def on_result(actions, **kw):  # the next tick's action before and after a chunk lands
            nxt = loop.served + 1
            before = loop.broker.peek(nxt)
            out = land(actions, **kw)
            after = loop.broker.peek(nxt)
            if before is not None and after is not None:
                plan_changes.append(float(np.abs(after[:6] - before[:6]).mean()))
            return out

        loop.on_result = on_result
        _, _, stats, _ = driver.run(world.observe())
        empty, ticks = empty + stats["fallbacks"], ticks + stats["ticks"]
        actions = [a[:6] for a in world.applied]
        jumps += [float(np.abs(b - a).mean()) for a, b in zip(actions, actions[1:])]
    return {
        "jitter_mean": float(np.mean(jumps)), "jitter_p95": float(np.percentile(jumps, 95)),
        "plan_change_mean": float(np.mean(plan_changes)) if plan_changes else None, "switches": len(plan_changes),
        "empty_ticks": empty, "ticks": ticks,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--ticks", type=int, default=80, help="control ticks per episode")
    p.add_argument("--rate", type=float, default=10.0, help="control rate, Hz")
    p.add_argument("--step-periods", type=float, default=3.0, help="simulated time of every step, in periods (default 3)")
    p.add_argument("--refill-threshold", type=int, default=4)
    p.add_argument("--image-size", type=int, default=56)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("results/bench_rtc"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with pinned_threads(args.threads), tempfile.TemporaryDirectory() as tmp:
        policy = load_policy(make_tiny_cogact(Path(tmp) / "cogact", image_size=args.image_size), device="cpu")
        results = {mode: run_mode(policy, mode, args) for mode in MODES}
    print(f"CogACT (random, chunk {policy.chunk_size}) at {args.rate:g} Hz, each step {args.step_periods:g} periods, "
          f"refill threshold {args.refill_threshold}, {args.episodes} episodes x {args.ticks} ticks")
    print(f"{'blend':>9} | {'jitter mean':>11} | {'jitter p95':>10} | {'plan change':>11} | empty ticks")
    for mode, r in results.items():
        switch = f"{r['plan_change_mean']:.4f}" if r["plan_change_mean"] is not None else "-"
        print(f"{mode:>9} | {r['jitter_mean']:11.4f} | {r['jitter_p95']:10.4f} | {switch:>11} | {r['empty_ticks']}/{r['ticks']}")
    path = write_json(args.out.with_suffix(".json"), env=environment(threads=args.threads), args=args, results=results)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
