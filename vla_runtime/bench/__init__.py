"""Benchmarks that print ratios measured side by side in one run (STYLE §2.5).

Each module has ``main(argv) -> int``; ``benchmarks/bench_<name>.py`` and ``vla-runtime bench <name>``
both call it. Register a new one in ``vla_runtime.cli.bench.BENCHMARKS``.
"""
