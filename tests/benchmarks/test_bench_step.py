"""bench_step.py keeps working: its pre-timing check (our tokens == transformers' generate tokens) passes, and
its JSON record holds each variant's timed calls (warm-up excluded) with the median, percentiles and the ratio
computed from them (timings themselves are not asserted)."""

import json
import statistics

import numpy as np
import pytest
import torch


def test_bench_step_agrees_with_the_reference_and_writes_results(tmp_path, load_benchmark):
    bench = load_benchmark("bench_step")
    threads = torch.get_num_threads()
    assert bench.main(["--threads", "1", "--repeats", "3", "--warmup", "1", "--out", str(tmp_path / "bench")]) == 0
    assert torch.get_num_threads() == threads  # pinned for the run only
    record = json.loads((tmp_path / "bench.json").read_text())
    assert record["env"]["threads"] == 1 and record["env"]["dtype"] == "float32" and record["env"]["device"] == "cpu"
    assert record["args"]["repeats"] == 3 and record["checkpoint"]["tiny"] is True
    results = record["results"]
    assert list(results) == [bench.BASELINE, "ours (full vocabulary)", "ours (action tokens, default)"]
    baseline = results[bench.BASELINE]["median_ms"]
    for r in results.values():
        assert len(r["times_ms"]) == 3 and r["baseline"] == bench.BASELINE
        assert r["median_ms"] == statistics.median(r["times_ms"])
        assert r["p10_ms"] == pytest.approx(np.percentile(r["times_ms"], 10))
        assert r["p90_ms"] == pytest.approx(np.percentile(r["times_ms"], 90))
        assert r["ratio"] == pytest.approx(baseline / r["median_ms"])
    assert (tmp_path / "bench.png").stat().st_size > 0
