"""``vla-runtime bench NAME [args]``: run a benchmark, passing it its own arguments (the same code as
``python benchmarks/bench_NAME.py [args]``). ``vla-runtime bench`` (or ``--list``) lists them;
``vla-runtime bench NAME --help`` shows a benchmark's own options."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bench.registry import default_dir, find_benchmarks, get_benchmark


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="run a benchmark (ratios measured side by side in one run); no NAME: list them",
        description=__doc__,
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks with a line on each (also without NAME)")
    parser.add_argument("--dir", type=Path, default=None, help=f"folder of bench_*.py scripts (default: {default_dir()})")
    parser.add_argument("name", nargs="?", help="which benchmark (see --list)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list or args.name is None:
        return list_benchmarks(args.dir)
    return get_benchmark(args.name, args.dir).run(args.bench_args)


def list_benchmarks(folder: Path | None) -> int:
    """Print ``NAME  description`` per benchmark, and a note when the scripts' folder is missing."""
    found = find_benchmarks(folder)
    width = max(len(name) for name in found)
    for name, bench in found.items():
        print(f"{name:{width}s}  {bench.summary}")
    folder = default_dir() if folder is None else folder
    if not folder.is_dir():
        print(f"(no benchmarks folder at {folder}: the bench_*.py scripts run from a source checkout; see --dir)")
    print("run one: vla-runtime bench NAME [its options]; its options: vla-runtime bench NAME --help")
    return 0
