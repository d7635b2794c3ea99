"""Where does a policy miscount? ``memory-tally`` outcomes of ``vla-runtime eval`` runs by where the row lies.

In ``memory-tally`` the hand starts at the same place in every episode and the row of pads is drawn per seed, so an
episode's geometry is two numbers: how far the hand starts from the middle pad *along* the row (toward the last
pad; 2.5-10.5 cm) and how far *off* the row (0-10 cm). With two flashes the hand must stop at the middle pad; the
closer it starts (along), the fewer steps it shares with the way to the first pad before the two part, and the
further off, the more diagonal the way. This script reads the episodes of one or more eval directories
(``OUT/episodes.jsonl``), keeps the tally episodes with ``--count`` flashes, and prints:

- per run: the successes, and the successes in thirds of ``along`` and of ``off`` (pooled thirds) with 95 %
  Wilson intervals;
- a logistic fit of success on both (standardised; coefficient, standard error, z) over all runs pooled, or with
  ``--fit-on RUN`` over that run alone, then the successes it expects in each other run beside those observed
  (does the geometry a seed set drew account for its score?);
- with ``--paired`` (two runs over the same seeds, e.g. two checkpoints): the exact McNemar test.

    python benchmarks/tally_geometry.py runs/eval-a runs/eval-b [--paired] [--fit-on runs/eval-a] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from vla_runtime.bench.stats import mcnemar_exact, wilson_interval
from vla_runtime.sim.memory.tally import TallyTask

TASK = "memory-tally"


@dataclass(frozen=True)
class TallyEpisode:
    seed: int
    along_cm: float  # hand start to the middle pad along the row (toward the last pad)
    off_cm: float  # hand start to the row across it
    success: bool
    pad: int | None  # the pad answered (1..3), None without an answer


def read_episodes(run: Path, hand_xy: tuple[float, float], count: int) -> list[TallyEpisode]:
    """The ``count``-flash tally episodes of the eval directory ``run``, with their geometry from the seed, in seed
    order (an eval with several workers writes them in the order they finish)."""
    path = run / "episodes.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run} has no episodes.jsonl: expected the --out directory of `vla-runtime eval`")
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["task"] != TASK:
            continue
        episode = TallyTask.sample(record["seed"])
        if episode.count != count:
            continue
        pad = record.get("final_info", {}).get("pad")
        out.append(TallyEpisode(
            seed=record["seed"], along_cm=100 * (hand_xy[0] - episode.row[0]), off_cm=100 * abs(hand_xy[1] - episode.row[1]),
            success=bool(record["success"]), pad=None if pad is None else int(pad),
        ))  # fmt: skip
    return sorted(out, key=lambda e: e.seed)


def thirds(episodes: list[TallyEpisode], key: str, edges: np.ndarray) -> list[dict]:
    """Successes in the bins of ``key`` cut at ``edges`` [2] -> one row per bin with its Wilson interval."""
    values = np.array([getattr(e, key) for e in episodes])
    bins = np.digitize(values, edges)
    rows = []
    for b in range(3):
        hits = [e.success for e, k in zip(episodes, bins) if k == b]
        ci = wilson_interval(sum(hits), len(hits)) if hits else None
        rows.append(
            {"bin": b, "successes": sum(hits), "episodes": len(hits), "low": ci and ci.low, "high": ci and ci.high}
        )
    return rows


def standardise(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """[N, D] -> [N, D+1]: a column of ones, then x centred and scaled per column."""
    return np.c_[np.ones(len(x)), (x - mean) / std]


def logistic_fit(x: np.ndarray, y: np.ndarray, *, iterations: int = 50) -> dict[str, np.ndarray]:
    """Logistic regression of y [N] in {0, 1} on x [N, D] standardised, by Newton's method -> coef [D+1] (intercept
    first), se [D+1], z [D+1], and the ``mean`` [D] and ``std`` [D] it standardised with."""
    mean, std = x.mean(0), x.std(0)
    a = standardise(x, mean, std)
    w = np.zeros(a.shape[1])
    for _ in range(iterations):
        p = 1 / (1 + np.exp(-a @ w))
        hessian = a.T @ (a * (p * (1 - p))[:, None]) + 1e-6 * np.eye(a.shape[1])
        w = w + np.linalg.solve(hessian, a.T @ (y - p))
    p = 1 / (1 + np.exp(-a @ w))
    se = np.sqrt(np.diag(np.linalg.inv(a.T @ (a * (p * (1 - p))[:, None]) + 1e-6 * np.eye(a.shape[1]))))
    return {"coef": w, "se": se, "z": w / se, "mean": mean, "std": std}


def expected_successes(fit: dict[str, np.ndarray], x: np.ndarray) -> float:
    """The successes ``fit`` predicts for episodes with geometry x [N, D]."""
    return float((1 / (1 + np.exp(-standardise(x, fit["mean"], fit["std"]) @ fit["coef"]))).sum())


def hand_start() -> tuple[float, float]:
    """The hand's (x, y) at the start of a tally episode, read from the simulator (the same in every episode)."""
    from vla_runtime.sim.metaworld_env import MetaWorldConfig, MetaWorldEnv

    with MetaWorldEnv(MetaWorldConfig(cameras=("corner",), resolution=(28, 28))) as env:
        obs = env.reset(TASK, 0)
    return float(obs.state[0]), float(obs.state[1])


def geometry(episodes: list[TallyEpisode]) -> np.ndarray:
    return np.array([[e.along_cm, e.off_cm] for e in episodes]).reshape(-1, 2)


def report(runs: dict[str, list[TallyEpisode]], *, paired: bool, fit_on: str | None = None) -> dict:
    pooled = [e for episodes in runs.values() for e in episodes]
    if len(pooled) < 6:
        raise ValueError(f"{len(pooled)} episodes with that count: too few to split in thirds (need >= 6)")
    edges = {key: np.quantile([getattr(e, key) for e in pooled], [1 / 3, 2 / 3]) for key in ("along_cm", "off_cm")}
    out = {"edges_cm": {k: v.tolist() for k, v in edges.items()}, "runs": {}}
    for name, episodes in runs.items():
        out["runs"][name] = {
            "successes": sum(e.success for e in episodes), "episodes": len(episodes),
            **{key: thirds(episodes, key, edges[key]) for key in edges},
        }  # fmt: skip
    if fit_on is not None and fit_on not in runs:
        raise ValueError(f"--fit-on {fit_on} is not one of the runs given: {list(runs)}")
    fitted = runs[fit_on] if fit_on is not None else pooled
    fit = logistic_fit(geometry(fitted), np.array([e.success for e in fitted], dtype=float))
    names = ("intercept", "along", "off")
    out["logistic"] = {
        "fit_on": fit_on or "pooled",
        **{n: {k: float(fit[k][i]) for k in ("coef", "se", "z")} for i, n in enumerate(names)},
    }
    if fit_on is not None:
        out["expected"] = {
            name: expected_successes(fit, geometry(episodes)) for name, episodes in runs.items() if name != fit_on
        }
    if paired:
        if len(runs) != 2:
            raise ValueError(f"--paired compares two runs, got {len(runs)}")
        (name_a, a), (name_b, b) = runs.items()
        if [e.seed for e in a] != [e.seed for e in b]:
            raise ValueError(f"--paired needs the same seeds in both runs: {name_a} and {name_b} differ")
        test = mcnemar_exact([e.success for e in a], [e.success for e in b])
        out["paired"] = {"a": name_a, "b": name_b, **asdict(test)}
    return out


def print_report(out: dict, count: int) -> None:
    edges = out["edges_cm"]
    print(f"{count}-flash memory-tally episodes; thirds cut at along {edges['along_cm'][0]:.1f} / {edges['along_cm'][1]:.1f} cm, "
          f"off {edges['off_cm'][0]:.1f} / {edges['off_cm'][1]:.1f} cm")  # fmt: skip
    for name, run in out["runs"].items():
        print(f"{name}: {run['successes']}/{run['episodes']}")
        for key in edges:
            cells = [f"{r['successes']}/{r['episodes']}" + (f" [{r['low']:.0%}, {r['high']:.0%}]" if r["episodes"] else "")
                     for r in run[key]]  # fmt: skip
            print(f"  {key.removesuffix('_cm'):5s} near -> far: " + ",  ".join(cells))
    for name in ("along", "off"):
        f = out["logistic"][name]
        print(
            f"logistic, {out['logistic']['fit_on']}, per SD of {name}: {f['coef']:+.2f} (se {f['se']:.2f}, z {f['z']:+.2f})"
        )
    for name, expected in out.get("expected", {}).items():
        print(f"{name}: the fit expects {expected:.1f} successes, observed {out['runs'][name]['successes']}")
    if "paired" in out:
        p = out["paired"]
        print(
            f"paired: right only in {p['a']}: {p['a_only']}, only in {p['b']}: {p['b_only']}; exact McNemar p = {p['p_value']:.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="`vla-runtime eval --out` directories")
    parser.add_argument("--count", type=int, default=2, choices=(1, 2, 3), help="keep episodes with this many flashes")
    parser.add_argument("--paired", action="store_true", help="two runs over the same seeds: McNemar test")
    parser.add_argument("--fit-on", type=Path, help="fit the logistic on this run only and predict the others")
    parser.add_argument(
        "--hand", type=float, nargs=2, metavar=("X", "Y"), help="hand start (m); default: from the simulator"
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    hand = tuple(args.hand) if args.hand else hand_start()
    runs = {str(run): read_episodes(run, hand, args.count) for run in args.runs}
    out = report(runs, paired=args.paired, fit_on=None if args.fit_on is None else str(args.fit_on))
    print_report(out, args.count)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
