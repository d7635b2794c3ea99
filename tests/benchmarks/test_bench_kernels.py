"""benchmarks/bench_kernels.py: exits cleanly without CUDA, and its pipeline (checks, numbers, JSON, plot) works.

The timings themselves need a GPU; here the torch providers run at toy sizes with a host timer so that the
first GPU run does not discover a broken table or file writer.
"""

from __future__ import annotations

import json
import time
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark) -> ModuleType:
    return load_benchmark("bench_kernels")


def test_without_cuda_it_says_so_and_exits_zero(bench, capsys):
    assert bench.main(["--device", "cpu"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_min_bytes_counts_gathered_rows_once(bench):
    geo = bench.Geometry(q_heads=8, kv_heads=2, head_dim=64)
    case = bench.make_case(geo, 100, 1, batch=1, dtype=torch.bfloat16, device="cpu", seed=0)
    assert case["k_store"].shape[2] == 125 and case["kv_slots"].unique().numel() == 100
    kv = 2 * 2 * 100 * 64 * 2  # K and V, 2 kv heads, 100 rows, 64 dims, 2 bytes
    assert bench.min_bytes(case) == kv + 2 * 8 * 64 * 2 + 8 * 100 + 4


def test_pipeline_with_torch_providers_on_cpu(bench, tmp_path, capsys):
    args = bench.parse_args(["--geometry", "qwen2-0.5b", "--contexts", "64", "96", "--queries", "1", "5",
                             "--dtype", "float32", "--out", str(tmp_path / "bench")])

    def host_timer(fn, _args):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times

    providers = lambda case: {"gather+sdpa": lambda: bench.gather_sdpa(**case),  # noqa: E731
                              "sdpa-contiguous": bench.contiguous_sdpa_fn(case)}
    results = bench.run(args, torch.device("cpu"), timer=host_timer, providers=providers)
    assert len(results) == 2 * 2 * 2
    bench.add_peak_fractions(results, spec=1e11, copy=5e10)
    entry = results["qwen2-0.5b/T=5/N=96/sdpa-contiguous"]
    assert entry["frac_of_peak"] == entry["gbps"] * 1e9 / 1e11
    assert results["qwen2-0.5b/T=1/N=64/gather+sdpa"]["speedup_vs_baseline"] == 1.0
    bench.print_table(results)
    assert "qwen2-0.5b" in capsys.readouterr().out
    out = bench.write(results, args, {"device_name": "cpu"})
    saved = json.loads(out.with_suffix(".json").read_text())
    assert set(saved) == {"env", "args", "results"} and len(saved["results"]) == 8
    assert out.with_suffix(".png").stat().st_size > 0
