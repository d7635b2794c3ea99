"""Step latency, KV bytes and FLOPs of Full vs SinkWindow vs ChunkedGated caches at 1k..16k history.

The benchmark lives in ``vla_runtime.bench.kv`` (so ``vla-runtime bench kv`` runs the same code);
see its docstring for the method.

usage: python benchmarks/bench_kv.py [--lengths 1024 4096 16384] [--parts layer e2e] [--threads 2]
"""

import sys

from vla_runtime.bench.kv import main

if __name__ == "__main__":
    sys.exit(main())
