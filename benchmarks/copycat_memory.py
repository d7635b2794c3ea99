"""Does a history policy read its memory, or copy its own motion? ``memory-tally`` driven by the policy and by the expert.

In ``memory-tally`` the three pads lie in a row, 13 cm apart, and the hand starts between the middle and the last
one (3-9 cm from the middle one), so the ways to the first and the middle pad coincide until the hand is 4 cm from
the middle one: the expert moves at full speed (its gain saturates beyond 4 cm) and only then slows down to stop
there. Whether to stop at the middle pad (two flashes) or
go on to the first (one flash) is decided on the way, many steps after go. A policy can make that decision from
its memory of the flashes, or, trained on clean demonstrations, from its own recent motion: a hand that has
started to slow down near the middle pad stops there in every demonstration.

Each episode runs twice (float32 CPU, 1 thread):

- **expert-driven**: the expert's actions move the arm; the policy sees the same frames and its action is only
  compared. At every separable step (``vla_runtime.sim.memory.separable``: after go, the actions toward the true
  pad and toward each other pad differ by more than ``--separation``, metres per step), the policy's action is
  assigned to the pad whose action it is nearest: *right* when that is the true pad. Reported: the first such step and the share of all of them.
- **policy-driven** (closed loop, as ``vla-runtime eval``): success, the pad answered, and for two flashes how far
  the hand went past the middle pad toward the first (cm; the success radius is 6).

A policy that reads its memory is right from the first separable step and slows down at the middle pad on its own;
a policy that copies its motion is wrong at the first separable steps, right once the expert's frames show it
slowing down, and in closed loop sails past the middle pad.

With ``--probe-episodes N``, a softmax probe for the answer pad is fit on the hidden state that predicts each step's
first action token (``probe_memory.FirstTokenState``) at every step after go of N expert-driven episodes from
``--probe-seed``, and read on the evaluated episodes beside the policy's picks: at go, on the shared way, at the
first separable step and at all of them. A probe that is right where the policy is not says the memory is in the
state and the action tokens do not follow it. A second probe is fit on the states at go alone (one per episode),
before any motion can tell the pad: at chance there, the count is not in the state at all.

    python benchmarks/copycat_memory.py --checkpoint assets/mw-memory-openvla --kv chunked --episodes 30 --seed 1000
    python benchmarks/copycat_memory.py --checkpoint FULL --kv full --episodes 30 --seed 1000 --probe-episodes 60
    python benchmarks/copycat_memory.py --checkpoint FULL --kv full --memory-delays 1:8 --probe-episodes 60
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from vla_runtime.cli.policy_args import saved_gate_geometry
from vla_runtime.cli.sim_args import parse_delays
from vla_runtime.config import HistoryMode, SessionConfig
from vla_runtime.kv.config import KVConfig, KVMode
from vla_runtime.policies.registry import load_policy
from vla_runtime.sim.memory.base import move_toward
from vla_runtime.sim.memory.order import N_PADS
from vla_runtime.sim.memory.reach import OPEN, TARGET_Z
from vla_runtime.sim.memory.separable import separable
from vla_runtime.sim.metaworld_env import MetaWorldConfig, MetaWorldEnv

from probe_memory import FirstTokenState, fit_softmax  # a sibling script (benchmarks/ is on the path)

TASK = "memory-tally"
FULL_CAPACITY = 10452  # the memory cards' full cache


def pad_actions(env: MetaWorldEnv, hand: np.ndarray) -> np.ndarray:
    """[N_PADS, 3] the expert's position action (policy units) toward each pad from ``hand`` [3]."""
    episode = env.memory_episode
    natives = [move_toward(hand, np.array([*episode.pad_xy(k), TARGET_Z]), OPEN) for k in range(N_PADS)]
    return np.stack([env.config.actions.from_native(n)[:3] for n in natives])


def run(
    env: MetaWorldEnv, policy, config: SessionConfig, seed: int, *, expert_drives: bool, separation: float,
    hook: FirstTokenState | None = None,
) -> dict:
    """One episode -> the picks at separable steps (expert-driven) or the outcome and overshoot (policy-driven).
    With ``hook`` (expert-driven), ``out["steps"]``: per step from go, ``(hidden state [dim], separable, pick)``."""
    obs = env.reset(TASK, seed)
    episode = env.memory_episode
    true_pad = episode.count - 1
    session = policy.new_session(obs.instruction, config)
    picks, steps, past_middle, done, t, success, info = [], [], 0.0, False, 0, False, None
    while not done:
        if hook is not None:
            hook.arm()
        action = np.asarray(session.step(obs.to_policy()).actions)[0]
        if t >= episode.go_step:
            hand = np.asarray(obs.state[:3], dtype=np.float64)  # the state starts with the hand's x, y, z
            sep = separable(episode, hand, separation=separation * env.config.actions.position_scale)
            if sep:
                candidates = pad_actions(env, hand)
                picks.append(int(np.argmin(np.linalg.norm(candidates - action[:3], axis=1))))
            if hook is not None:
                steps.append((hook.state, sep, picks[-1] if sep else None))
            middle_x = episode.pad_xy(1)[0]
            past_middle = max(past_middle, middle_x - hand[0])
        obs, done, success, info = env.step(env.expert_action() if expert_drives else action)
        t += 1
    out = {"seed": seed, "count": episode.count}
    if expert_drives:
        right = [p == true_pad for p in picks]
        out |= {"first_right": bool(right[0]) if right else None, "share_right": float(np.mean(right)) if right else None}
        if hook is not None:
            out["steps"] = steps
    else:
        pad = info.extra.get("pad")  # 1..3, counted like the flashes; absent without an answer
        out |= {"success": bool(success), "answered": None if pad is None else int(pad), "past_middle_cm": 100 * past_middle}
    return out


def fit_pad_probe(states: torch.Tensor, pads: torch.Tensor):
    """A softmax probe for the answer pad fit on hidden ``states`` [N, dim] (standardised by their own mean and
    std) with ``pads`` [N] in 0..N_PADS-1 -> ``predict(states [M, dim]) -> pads [M]``."""
    states = states.float()
    mean, std = states.mean(0), states.std(0) + 1e-6
    predict = fit_softmax((states - mean) / std, pads, N_PADS)
    return lambda test: predict((test.float() - mean) / std)


def probe_table(fit: list[dict], test: list[dict]) -> dict:
    """A softmax probe for the answer pad, fit on the hidden states after go of the ``fit`` episodes (``run`` rows
    with ``steps``) and read on the ``test`` ones, beside the policy's picks. Per flash count: the probe at go, on the
    shared way (from go to the first separable step), at the first separable step and at all of them; the policy
    at the last two."""
    predict = fit_pad_probe(
        torch.stack([state for row in fit for state, _, _ in row["steps"]]),
        torch.tensor([row["count"] - 1 for row in fit for _ in row["steps"]]),
    )
    table = {}
    for count in (1, 2, 3):
        groups = {"at go": [], "shared way": [], "first separable step": [], "separable steps": []}
        for row in (r for r in test if r["count"] == count):
            steps = row["steps"]
            first = next((i for i, (_, sep, _) in enumerate(steps) if sep), len(steps))
            groups["at go"] += steps[:1]
            groups["shared way"] += steps[:first]
            groups["first separable step"] += steps[first : first + 1]
            groups["separable steps"] += [s for s in steps if s[1]]
        line = {}
        for name, rows in groups.items():
            if not rows:
                line[name] = "-"
                continue
            probe = predict(torch.stack([state for state, _, _ in rows])) == count - 1
            policy = [pick == count - 1 for _, sep, pick in rows if sep]
            line[name] = f"probe {probe.float().mean():.0%}" + (f", policy {np.mean(policy):.0%}" if policy else "") + f" (n={len(rows)})"
        table[count] = line
    return table


def probe_at_go(fit: list[dict], test: list[dict]) -> dict:
    """A softmax probe for the answer pad fit on the ``fit`` episodes' hidden states at go only (one per episode)
    and read on the ``test`` ones' states at go: is the count in the state before any motion shows it? (The probe
    of ``probe_table`` is fit on every step after go, where the hand's heading also tells the pad.) -> per flash
    count ``"right/episodes"`` and ``"all"``, the share right."""
    fit, test = [row for row in fit if row["steps"]], [row for row in test if row["steps"]]
    at_go = [row["steps"][0][0] for row in fit]
    predict = fit_pad_probe(torch.stack(at_go), torch.tensor([row["count"] - 1 for row in fit]))
    picks = predict(torch.stack([row["steps"][0][0] for row in test])).tolist()
    out = {}
    for count in (1, 2, 3):
        right = [pick == count - 1 for pick, row in zip(picks, test) if row["count"] == count]
        out[count] = f"{sum(right)}/{len(right)}"
    out["all"] = f"{np.mean([pick == row['count'] - 1 for pick, row in zip(picks, test)]):.0%}"
    return out


def summarise(rows: list[dict]) -> dict:
    """Per flash count: episodes, first separable step right, mean share right, closed-loop successes, overshoot."""
    table = {}
    for count in (1, 2, 3):
        r = [x for x in rows if x["count"] == count]
        first = [x["first_right"] for x in r if x.get("first_right") is not None]
        share = [x["share_right"] for x in r if x.get("share_right") is not None]
        closed = [x for x in r if "success" in x]
        table[count] = {
            "episodes": len(closed),
            "expert-driven: first separable step right": f"{sum(first)}/{len(first)}",
            "expert-driven: separable steps right": f"{np.mean(share):.0%}" if share else "-",
            "closed loop: success": f"{sum(x['success'] for x in closed)}/{len(closed)}",
            "closed loop: pads answered": dict(sorted(Counter(str(x["answered"] or "none") for x in closed).items())),
            "closed loop: past the middle pad, cm (median)":
                f"{np.median([x['past_middle_cm'] for x in closed]):.1f}" if closed else "-",
        }
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--kv", choices=["full", "chunked"], default="chunked",
                   help="full: a full cache of the cards' capacity; chunked: the checkpoint's gate, window 47, budget 128")
    p.add_argument("--episodes", type=int, default=30)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--separation", type=float, default=0.003, help="metres per step (0.01 = full speed)")
    p.add_argument("--probe-episodes", type=int, default=0,
                   help="also fit a probe for the answer pad on the hidden state of N expert-driven episodes from "
                        "--probe-seed and read it on the evaluated ones (0 = off)")
    p.add_argument("--probe-seed", type=int, default=0)
    p.add_argument("--memory-delays", type=parse_delays, default=None, metavar="LOW:HIGH",
                   help="draw each episode's delay over LOW..HIGH steps instead of the trained 20..60 (as eval's)")
    p.add_argument("--out", type=Path, default=None, help="write the per-episode rows and the summary as JSON")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.kv == "full":
        kv = KVConfig.of(KVMode.FULL, capacity=FULL_CAPACITY)
    else:
        kv = KVConfig.from_dict({"mode": "chunked", "window": 47, "max_chunks": 128, **saved_gate_geometry(args.checkpoint)})
    policy = load_policy(args.checkpoint, device="cpu", kv=kv)
    config = SessionConfig(kv=kv, history=HistoryMode.OBSERVATIONS)
    hook = FirstTokenState(policy) if args.probe_episodes else None
    rows, fit = [], []
    world = MetaWorldConfig(cameras=("corner",), resolution=(84, 84), max_steps=200, memory_delays=args.memory_delays)
    with MetaWorldEnv(world) as env:
        for seed in tqdm(range(args.seed, args.seed + args.episodes), desc="episodes", unit="ep"):
            for expert_drives in (True, False):
                rows.append(run(env, policy, config, seed, expert_drives=expert_drives, separation=args.separation, hook=hook))
        probe_seeds = range(args.probe_seed, args.probe_seed + args.probe_episodes)
        for seed in tqdm(probe_seeds, desc="probe episodes", unit="ep", disable=not args.probe_episodes):
            fit.append(run(env, policy, config, seed, expert_drives=True, separation=args.separation, hook=hook))
    table = summarise(rows)
    print(f"{args.checkpoint} ({args.kv} cache), {TASK}, seeds {args.seed}-{args.seed + args.episodes - 1}")
    for count, row in table.items():
        print(f"  {count} flash{'es' if count > 1 else ''}: " + "; ".join(f"{k} {v}" for k, v in row.items()))
    result = {"rows": rows, "summary": table}
    if fit:
        result["probe"] = probe_table(fit, [r for r in rows if "steps" in r])
        print(f"probe for the answer pad (fit on seeds {probe_seeds.start}-{probe_seeds.stop - 1}, expert-driven):")
        for count, row in result["probe"].items():
            print(f"  {count} flash{'es' if count > 1 else ''}: " + "; ".join(f"{k}: {v}" for k, v in row.items()))
        result["probe_at_go"] = probe_at_go(fit, [r for r in rows if "steps" in r])
        print("probe fit on the states at go only (one per episode), read at go, by flash count: "
              + "; ".join(f"{k}: {v}" for k, v in result["probe_at_go"].items()))
    for row in rows:
        row.pop("steps", None)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
