"""Arguments shared by ``collect`` and ``eval``: simulator, tasks, cameras, resolution, step limit."""

from __future__ import annotations

import argparse

from ..sim import MEMORY_TASKS, METAWORLD_TASKS, MetaWorldConfig, RLBenchConfig
from ..sim.memory import MEMORY_CAMERA, MEMORY_GROUP

# task groups a user can name instead of listing tasks
METAWORLD_GROUPS = {
    "all": METAWORLD_TASKS,
    "mt10": [
        "reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3",
        "drawer-close-v3", "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3",
    ],
    "memory": list(MEMORY_GROUP),  # memory-counting by its name (see MEMORY_GROUP)
}


def add_sim_args(parser: argparse.ArgumentParser, *, sims: tuple[str, ...]) -> None:
    parser.add_argument("--sim", choices=sims, default=sims[0], help="simulator (default: %(default)s)")
    parser.add_argument(
        "--tasks", required=True,
        help="comma-separated task names (Meta-World: reach-v3,button-press-v3,...,memory-tally; or a group: all, mt10, memory)",
    )
    parser.add_argument("--camera", default=None, help="comma-separated camera names, primary first (Meta-World default corner2, "
                        f"{MEMORY_CAMERA} when every task is a memory task; RLBench front,wrist)")
    parser.add_argument("--resolution", default=None, help="image size N or HxW (Meta-World default 224; RLBench 128)")
    parser.add_argument("--max-steps", type=int, default=None, help="step limit per episode (Meta-World default and maximum 500)")
    parser.add_argument("--seed", type=int, default=0, help="first seed; episode i uses seed+i (Meta-World: seed %% 50 picks the scene variation)")
    parser.add_argument("--memory-delays", type=parse_delays, default=None, metavar="LOW:HIGH",
                        help="memory-reference, -tally and -order: draw the delay per seed over LOW..HIGH steps instead of "
                             "20..60 (conditions a policy was not trained on; the step limit grows with the delay)")


def parse_tasks(text: str, sim: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("--tasks is empty")
    if sim == "metaworld" and len(items) == 1 and items[0].lower() in METAWORLD_GROUPS:
        return list(METAWORLD_GROUPS[items[0].lower()])
    return items


def parse_delays(text: str) -> tuple[int, int]:
    """``"60:100"`` -> (60, 100); one number N -> (N, N)."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--memory-delays {text!r}: expected LOW:HIGH steps, e.g. 60:100") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"--memory-delays {text!r}: expected LOW:HIGH steps with 1 <= LOW <= HIGH")
    return parts[0], parts[1]


def parse_resolution(text: str) -> tuple[int, int]:
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError as e:
        raise ValueError(f"--resolution {text!r}: expected N or HxW, e.g. 224 or 128x160") from e
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise ValueError(f"--resolution {text!r}: expected N or HxW, e.g. 224 or 128x160")
    return parts[0], parts[1]


def sim_config(args: argparse.Namespace, tasks: list[str] | None = None) -> MetaWorldConfig | RLBenchConfig:
    """The simulator config from the command line (unset options keep the config's defaults; without
    ``--camera``, Meta-World runs that are all memory ``tasks`` use the camera their cues are made for)."""
    kwargs = {}
    if args.camera is not None:
        kwargs["cameras"] = tuple(c.strip() for c in args.camera.split(",") if c.strip())
    elif args.sim == "metaworld" and tasks and all(task in MEMORY_TASKS for task in tasks):
        kwargs["cameras"] = (MEMORY_CAMERA,)
    if args.resolution is not None:
        kwargs["resolution"] = parse_resolution(args.resolution)
    if args.max_steps is not None:
        kwargs["max_steps"] = args.max_steps
    if getattr(args, "memory_delays", None) is not None:
        if args.sim != "metaworld":
            raise ValueError("--memory-delays applies to Meta-World's memory tasks only")
        kwargs["memory_delays"] = args.memory_delays
    return MetaWorldConfig(**kwargs) if args.sim == "metaworld" else RLBenchConfig(**kwargs)
