"""Benchmarks that print ratios measured side by side in one run (STYLE §2.5).

``harness`` holds what every benchmark shares (timing with warm-up, medians and ratios, pinned threads, the
environment record, JSON and plots); ``registry`` finds the benchmarks ``vla-runtime bench NAME`` runs: the
built-in ones here (``kv``) and every ``benchmarks/bench_<name>.py`` of a source checkout.
"""
