"""``vla-runtime bench NAME [args]``: run a benchmark from ``vla_runtime.bench`` (the same code as
``benchmarks/bench_NAME.py``). ``vla-runtime bench kv --help`` lists a benchmark's own options."""

from __future__ import annotations

import argparse
import importlib

# benchmark name -> module with main(argv) -> int
BENCHMARKS: dict[str, str] = {
    "kv": "vla_runtime.bench.kv",
}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark (ratios measured side by side in one run)")
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[args.name])
    return module.main(args.bench_args)
