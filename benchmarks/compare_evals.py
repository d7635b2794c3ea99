"""Two policies (or caches) on the same episodes: ``vla-runtime eval`` runs paired by task and seed.

Each side is one or more eval ``--out`` directories (``OUT/episodes.jsonl``), pooled; an episode is keyed by its
task and seed, so the two sides must hold the same keys (run both with the same ``--tasks``, ``--seed`` and
``--episodes``), and one side may not hold a key twice (pool runs over different seeds, not the same seeds under
other conditions). Per task and over all tasks it prints:

- each side's successes;
- the discordant episodes (right only with A, only with B) and the exact McNemar p;
- the difference in success rate, A − B, in points, with a paired bootstrap 95 % interval;
- for tasks whose episodes record how far the answer landed (``final_info["miss_m"]``, memory-reference), the
  median miss of each side;
- with ``--go-split STEP``: the same counts for the episodes whose go light came before STEP and from STEP on
  (``final_info["go_step"]``), to see whether a gap sits at the longer delays.

    python benchmarks/compare_evals.py --a runs/eval-chunked --b runs/eval-full [--go-split 44] [--json out.json]
    python benchmarks/compare_evals.py --a A_1000 A_2000 A_3000 --b B_1000 B_2000 B_3000 --tasks memory-reference
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from vla_runtime.bench.stats import mcnemar_exact, paired_bootstrap_diff
from vla_runtime.sim.evaluate import EpisodeResult
from vla_runtime.sim.results import RESULTS_FILE, load_results

Key = tuple[str, int]


def read_side(runs: list[Path]) -> dict[Key, EpisodeResult]:
    """The episodes of ``runs`` pooled, keyed by (task, seed); a key twice is an error."""
    episodes: dict[Key, EpisodeResult] = {}
    origin: dict[Key, Path] = {}
    for run in runs:
        path = run / RESULTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: expected a `vla-runtime eval --out` directory")
        for episode in load_results(path):
            key = (episode.task, episode.seed)
            if key in episodes:
                raise ValueError(
                    f"{key[0]} seed {key[1]} appears in both {origin[key]} and {run}: pool runs over different seeds"
                )
            episodes[key], origin[key] = episode, run
    return episodes


def _info(episode: EpisodeResult) -> dict:
    return episode.final_info or {}


def compare(a: dict[Key, EpisodeResult], b: dict[Key, EpisodeResult]) -> dict:
    """Paired counts, McNemar and bootstrap over the keys of ``a`` and ``b`` (which must be the same);
    ``{"episodes": 0}`` when there are none."""
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise ValueError(
            f"the two sides hold different episodes: {len(only_a)} only in A (first {only_a[:3]}), "
            f"{len(only_b)} only in B (first {only_b[:3]}); evaluate both on the same tasks and seeds"
        )
    keys = sorted(a)
    if not keys:
        return {"episodes": 0}
    sa = [bool(a[k].success) for k in keys]
    sb = [bool(b[k].success) for k in keys]
    test = mcnemar_exact(sa, sb)
    diff = paired_bootstrap_diff([float(x) for x in sa], [float(y) for y in sb])
    out = {
        "episodes": len(keys), "a": sum(sa), "b": sum(sb), "a_only": test.a_only, "b_only": test.b_only,
        "p_value": test.p_value, "diff_points": [100 * diff.estimate, 100 * diff.low, 100 * diff.high],
    }  # fmt: skip
    misses = [
        (_info(a[k]).get("miss_m"), _info(b[k]).get("miss_m"))
        for k in keys
        if "miss_m" in _info(a[k]) or "miss_m" in _info(b[k])
    ]
    if misses:
        for side, index in (("a", 0), ("b", 1)):
            answered = [m[index] for m in misses if m[index] is not None]
            out[f"median_miss_cm_{side}"] = 100 * statistics.median(answered) if answered else None
    return out


def report(
    a: dict[Key, EpisodeResult],
    b: dict[Key, EpisodeResult],
    *,
    tasks: list[str] | None = None,
    go_split: int | None = None,
) -> dict:
    """-> {"tasks": {task: compare(...)}, "all": compare(...), "go_split": {...}} over ``tasks`` (default: all)."""
    present = sorted({task for task, _ in a} | {task for task, _ in b})
    names = present if tasks is None else tasks
    missing = [t for t in names if t not in present]
    if missing or not names:
        raise ValueError(f"no episodes of {missing or 'any task'} in the runs, which hold {present}")

    def keep(side: dict[Key, EpisodeResult], predicate) -> dict[Key, EpisodeResult]:
        return {k: e for k, e in side.items() if k[0] in names and predicate(e)}

    everything = keep(a, lambda e: True), keep(b, lambda e: True)
    out = {"tasks": {}, "all": compare(*everything)}
    for task in names:
        out["tasks"][task] = compare({k: e for k, e in everything[0].items() if k[0] == task},
                                     {k: e for k, e in everything[1].items() if k[0] == task})  # fmt: skip
    if go_split is not None:

        def go(e: EpisodeResult) -> int:
            step = _info(e).get("go_step")
            if step is None:
                raise ValueError(f"--go-split needs final_info['go_step'], missing in {e.task} seed {e.seed}")
            return int(step)

        out["go_split"] = {
            f"go < {go_split}": compare(keep(a, lambda e: go(e) < go_split), keep(b, lambda e: go(e) < go_split)),
            f"go >= {go_split}": compare(keep(a, lambda e: go(e) >= go_split), keep(b, lambda e: go(e) >= go_split)),
        }
    return out


def print_report(out: dict) -> None:
    rows = [(task, r) for task, r in out["tasks"].items()] + [("all", out["all"])]
    rows += list(out.get("go_split", {}).items())
    header = f"{'episodes':<22} {'n':>4} {'A':>5} {'B':>5} {'A only':>7} {'B only':>7} {'McNemar p':>10}"
    print(header + "  A - B, points [95 %]  median miss A / B")
    for name, r in rows:
        if not r["episodes"]:
            print(f"{name:<22} {0:>4}")
            continue
        d = r["diff_points"]
        miss = ""
        if "median_miss_cm_a" in r:
            fmt = lambda v: "-" if v is None else f"{v:.1f} cm"  # noqa: E731
            miss = f"{fmt(r['median_miss_cm_a'])} / {fmt(r['median_miss_cm_b'])}"
        print(
            f"{name:<22} {r['episodes']:>4} {r['a']:>5} {r['b']:>5} {r['a_only']:>7} {r['b_only']:>7} "
            f"{r['p_value']:>10.3g}  {d[0]:+6.1f} [{d[1]:+.1f}, {d[2]:+.1f}]      {miss}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", nargs="+", type=Path, required=True, help="side A: `vla-runtime eval --out` directories")
    parser.add_argument("--b", nargs="+", type=Path, required=True, help="side B, over the same tasks and seeds")
    parser.add_argument("--tasks", help="comma-separated tasks to keep (default: every task in the runs)")
    parser.add_argument("--go-split", type=int, metavar="STEP", help="also split the episodes at this go step")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    tasks = None if args.tasks is None else [t.strip() for t in args.tasks.split(",") if t.strip()]
    out = report(read_side(args.a), read_side(args.b), tasks=tasks, go_split=args.go_split)
    print_report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
