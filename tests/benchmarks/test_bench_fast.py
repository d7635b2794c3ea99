"""bench_fast.py keeps working: compiled decodes the eager tokens (its pre-timing check), and its JSON record holds
every variant of both questions against its own eager row, with the quantized models' agreement and weight bytes
(timings and agreement values themselves are not asserted)."""

import json
import sys

import pytest
import torch

from vla_runtime.bench.registry import get_benchmark


@pytest.mark.slow
def test_bench_fast_small_geometry_writes_every_variant(tmp_path):
    threads = torch.get_num_threads()
    argv = ["--geometry", "small", "--repeats", "2", "--warmup", "1", "--agreement-steps", "2", "--out", str(tmp_path / "b")]
    assert get_benchmark("fast").run(argv) == 0  # what `vla-runtime bench fast` runs
    bench = sys.modules["bench_fast"]
    assert torch.get_num_threads() == threads
    record = json.loads((tmp_path / "b.json").read_text())
    results = record["results"]
    quantized = list(bench.QUANTIZED)
    assert set(results) == {f"small step: {v}" for v in [bench.EAGER, bench.COMPILED, *quantized]} | {
        f"small decode: {v}" for v in [bench.EAGER, bench.COMPILED, *quantized, *(f"{q} + compiled" for q in quantized)]
    }
    for name, r in results.items():
        assert r["baseline"] == f"{name.split(':')[0]}: {bench.EAGER}" and len(r["times_ms"]) == 2
    step = record["agreement"]["small step"]
    assert step[bench.COMPILED]["tokens_equal"] is True
    for q in quantized:
        assert 0 <= step[q]["identical_tokens"] <= 1 and step[q]["steps"] == 2
        assert step[q]["llm_layer_bytes"] < step[q]["float_llm_layer_bytes"] / 3
