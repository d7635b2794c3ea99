"""Where on the table ``memory-reference`` is answered: success by the spot's position, from eval runs.

A policy's reference misses can be a memory failure (the spot forgotten) or a place it cannot answer even when it
remembers (a spot it does not see well, a reach it does not make). The second shows as success that depends on
where the spot is, alike for every cache. Each side is one or more ``vla-runtime eval --out`` directories, pooled
(``--side NAME DIR [DIR ...]``, repeated). The spot of every memory-reference episode is drawn again from its seed
(``ReferenceTask.sample``, the task's own draw, so a run needs to store nothing more), and the spot area
(``GOAL_LOW`` to ``GOAL_HIGH``) is cut into ``--cells X Y`` cells. Per side it prints successes / episodes per cell,
rows far to near, and per column of x; ``--out`` writes one heat map per side.

    python benchmarks/reference_map.py --side chunked runs/eval-chunked --side full runs/eval-full \
        [--cells 8 3] [--out results/reference_map.png] [--json map.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from vla_runtime.bench.harness import pyplot, save_figure
from vla_runtime.sim.memory.reference import GOAL_HIGH, GOAL_LOW, ReferenceTask
from vla_runtime.sim.results import RESULTS_FILE, load_results

TASK = ReferenceTask.name


def spot_outcomes(runs: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """The memory-reference episodes of ``runs``, pooled: spots [N, 2] (x, y metres) and successes [N] (bool)."""
    spots, wins = [], []
    for run in runs:
        path = run / RESULTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: expected a `vla-runtime eval --out` directory")
        for episode in load_results(path):
            if episode.task == TASK:
                spots.append(ReferenceTask.sample(episode.seed).goal)
                wins.append(bool(episode.success))
    if not spots:
        raise ValueError(f"no {TASK} episode in {', '.join(map(str, runs))}: evaluate with --tasks {TASK} or memory")
    return np.asarray(spots, dtype=np.float64).reshape(-1, 2), np.asarray(wins, dtype=bool)


def success_grid(spots: np.ndarray, wins: np.ndarray, cells: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Successes and episodes per cell, each [Y, X] (row 0 the nearest y), over the spot area cut into
    ``cells`` = (X, Y) equal cells; a spot on the far edge falls in the last cell."""
    low, high = np.asarray(GOAL_LOW), np.asarray(GOAL_HIGH)
    n = np.asarray(cells)
    index = np.clip(((spots - low) / (high - low) * n).astype(int), 0, n - 1)
    episodes = np.zeros((n[1], n[0]), dtype=int)
    successes = np.zeros_like(episodes)
    np.add.at(episodes, (index[:, 1], index[:, 0]), 1)
    np.add.at(successes, (index[:, 1], index[:, 0]), wins.astype(int))
    return successes, episodes


def edges(cells: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Cell edges in metres: x [X + 1], y [Y + 1]."""
    return tuple(np.linspace(lo, hi, c + 1) for lo, hi, c in zip(GOAL_LOW, GOAL_HIGH, cells))


def report(sides: dict[str, list[Path]], cells: tuple[int, int]) -> dict:
    """Per side: the grid (successes and episodes per cell, rows near to far) and the columns of x."""
    xs, ys = edges(cells)
    out = {"x_edges_m": xs.tolist(), "y_edges_m": ys.tolist(), "sides": {}}
    for name, runs in sides.items():
        successes, episodes = success_grid(*spot_outcomes(runs), cells)
        out["sides"][name] = {
            "successes": successes.tolist(), "episodes": episodes.tolist(),
            "columns": [[int(s), int(e)] for s, e in zip(successes.sum(0), episodes.sum(0))],
            "total": [int(successes.sum()), int(episodes.sum())],
        }  # fmt: skip
    return out


def print_report(result: dict) -> None:
    xs, ys = result["x_edges_m"], result["y_edges_m"]
    head = "".join(f"{100 * x:>+9.0f}" for x in xs[:-1])
    for name, side in result["sides"].items():
        print(f"{name}: {side['total'][0]}/{side['total'][1]} (cells: successes/episodes; x from, cm)")
        print(f"{'y cm':>9}{head}")
        for j in reversed(range(len(ys) - 1)):  # far rows first, as the camera looks over the table
            cells = "".join(f"{s:>5d}/{e:<3d}" for s, e in zip(side["successes"][j], side["episodes"][j]))
            print(f"{100 * ys[j]:>5.0f}-{100 * ys[j + 1]:<3.0f}{cells}")
        print(f"{'x column':>9}" + "".join(f"{s:>5d}/{e:<3d}" for s, e in side["columns"]))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    sides = result["sides"]
    xs, ys = (100 * np.asarray(result[k]) for k in ("x_edges_m", "y_edges_m"))
    fig, axes = plt.subplots(1, len(sides), figsize=(5.2 * len(sides), 3.4), squeeze=False)
    for ax, (name, side) in zip(axes[0], sides.items()):
        wins, eps = np.asarray(side["successes"]), np.asarray(side["episodes"])
        rate = np.where(eps > 0, wins / np.maximum(eps, 1), np.nan)
        image = ax.pcolormesh(xs, ys, rate, vmin=0, vmax=1, cmap="RdYlGn")
        for j in range(len(ys) - 1):
            for i in range(len(xs) - 1):
                centre = ((xs[i] + xs[i + 1]) / 2, (ys[j] + ys[j + 1]) / 2)
                ax.text(*centre, f"{wins[j, i]}/{eps[j, i]}", ha="center", va="center", fontsize=6)
        title = f"{name}: {side['total'][0]}/{side['total'][1]}"
        ax.set(title=title, xlabel="spot x (cm)", ylabel="spot y (cm)", aspect="equal")
    fig.colorbar(image, ax=axes[0][-1], label="success")
    fig.suptitle(f"{TASK}: success by where the spot was")
    save_figure(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", nargs="+", action="append", required=True, metavar=("NAME", "DIR"),
                   help="a name, then one or more eval --out directories pooled under it (repeat for more sides)")
    p.add_argument("--cells", type=int, nargs=2, default=[8, 3], metavar=("X", "Y"),
                   help="grid over the spot area (default 8 3: 5 x 10 cm cells)")
    p.add_argument("--out", type=Path, default=None, help="write the heat maps to this PNG")
    p.add_argument("--json", type=Path, default=None, help="write the counts to this JSON file")
    args = p.parse_args(argv)
    if any(len(side) < 2 for side in args.side):
        p.error("--side takes a name and at least one eval directory")
    if min(args.cells) < 1:
        p.error(f"--cells must be >= 1 each, got {args.cells}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    sides = {name: [Path(d) for d in dirs] for name, *dirs in args.side}
    result = report(sides, tuple(args.cells))
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.out:
        plot(result, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
