"""``vla-runtime collect``: scripted-expert demonstrations from Meta-World as a LeRobot v3 dataset.

    vla-runtime collect --sim metaworld --tasks reach-v3,button-press-v3 --episodes 20 --out runs/mw-demos
    vla-runtime collect --sim metaworld --tasks memory --episodes 50 --resolution 84 --out runs/mw-memory
    vla-runtime collect ... --out runs/mw-demos --resume      # after a crash: same flags plus --resume
    vla-runtime collect --sim metaworld --tasks memory ... --detours 0.5   # half the episodes with a detour after go
    vla-runtime collect --sim metaworld --tasks memory ... --slowdowns 0.5 # half with speed noise after go
    vla-runtime collect --sim metaworld --tasks memory ... --driver CKPT --driven 0.5  # half driven by a policy after go
    vla-runtime collect --sim metaworld --tasks memory-reference ... --seed-file seeds.json  # these seeds only
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..data import VIDEO_CODECS
from ..sim.collect import CollectConfig, collect
from .sim_args import add_sim_args, parse_tasks, sim_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="record scripted-expert episodes into a LeRobot v3 dataset")
    add_sim_args(p, sims=("metaworld",))
    p.add_argument("--episodes", type=int, required=True, help="successful episodes per task")
    p.add_argument("--out", required=True, help="new dataset directory (or, with --resume, an interrupted one)")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted dataset in --out: keep its finished episodes, go on with the next seeds")
    p.add_argument("--detours", type=float, default=0.0, metavar="FRACTION",
                   help="memory-reference/-order/-tally: in this fraction of episodes drive the arm toward a wrong "
                        "answer for 2-16 steps after go while storing the expert's actions, which steer back "
                        "(recovery data for history policies; default: %(default)s)")
    p.add_argument("--slowdowns", type=float, default=0.0, metavar="FRACTION",
                   help="memory-reference/-order/-tally: in this fraction of episodes slow the executed moves after go "
                        "down by random factors (spells of 2-8 steps) while storing the expert's actions (speed noise "
                        "against a history policy copying its own motion; default: %(default)s)")
    p.add_argument("--driver", metavar="CHECKPOINT",
                   help="a trained policy checkpoint that drives the arm in the --driven episodes (its own session)")
    p.add_argument("--driven", type=float, default=0.0, metavar="FRACTION",
                   help="memory-reference/-order/-tally, with --driver: in this fraction of episodes the policy drives "
                        "the arm for 2-16 steps after go while the expert's actions are stored (the learner's own "
                        "mistakes, labelled: one DAgger round; default: %(default)s)")
    p.add_argument("--seed-file", type=Path, metavar="JSON",
                   help="a JSON object of task name -> list of seeds: each task tries its seeds in order instead of "
                        "--seed, --seed + 1, ... (to re-collect chosen episodes), e.g. "
                        '{"memory-reference": [7, 19, 40]}')
    p.add_argument(
        "--video-codec", choices=sorted(VIDEO_CODECS), default=None,
        help="store frames as mp4 with this codec (default: lossless PNG inside the parquet; only hevc_lossless is also exact)",
    )
    p.set_defaults(func=run)


def read_seed_file(path: Path) -> dict[str, list[int]]:
    """``--seed-file``: a JSON object mapping each task name to a list of integer seeds."""
    try:
        seeds = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--seed-file {path}: cannot read a JSON object of task name -> list of seeds ({e})") from e
    ok = isinstance(seeds, dict) and all(
        isinstance(v, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in v) for v in seeds.values()
    )
    if not ok:
        raise ValueError(f'--seed-file {path}: expected a JSON object of task name -> list of integer seeds, e.g. '
                         f'{{"memory-reference": [7, 19]}}')  # fmt: skip
    return seeds


def run(args: argparse.Namespace) -> int:
    tasks = parse_tasks(args.tasks, args.sim)
    config = CollectConfig(
        tasks=tasks,
        episodes=args.episodes,
        out=args.out,
        seed=args.seed,
        env=sim_config(args, tasks),
        video_codec=args.video_codec,
        resume=args.resume,
        detours=args.detours,
        slowdowns=args.slowdowns,
        driven=args.driven,
        driver=args.driver,
        seeds=read_seed_file(args.seed_file) if args.seed_file else None,
    )
    results = collect(config)
    print(f"{'task':<32} {'kept':>5} {'failed':>7} {'frames':>8}")
    for task, r in results.items():
        print(f"{task:<32} {r.kept:>5} {r.failed:>7} {r.frames:>8}")
    failed = sum(r.failed for r in results.values())
    kept = sum(r.kept for r in results.values())
    print(f"dataset: {config.out} ({kept} episodes; {failed} failed expert episodes skipped)")
    return 0 if all(r.kept == config.episodes for r in results.values()) else 1
