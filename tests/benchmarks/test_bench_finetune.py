"""bench_finetune.py keeps working on a minimal budget and writes its JSON/PNG record (timings are not asserted)."""

import json

import pytest


def test_bench_finetune_runs_and_writes_results(tmp_path, load_benchmark):
    bench = load_benchmark("bench_finetune")
    argv = ["--threads", "1", "--warmup", "1", "--repeats", "2", "--variants", "lora-chunked", "lora-single", "--batch-size", "2",
            "--window", "2", "--image-size", "28", "--episodes", "2", "--episode-length", "4", "--out", str(tmp_path / "bench")]  # fmt: skip
    assert bench.main(argv) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    results = record["results"]
    assert list(results) == ["lora-chunked", "lora-single"] and record["env"]["threads"] == 1
    # this table's ratio is a time ratio: the variant's median over the baseline's (> 1: slower)
    assert results["lora-single"]["ratio"] == pytest.approx(results["lora-single"]["median_ms"] / results["lora-chunked"]["median_ms"])
    assert all(len(r["times_ms"]) == 2 and r["median_ms"] > 0 for r in results.values())
    assert results["lora-single"]["tokens_per_window"] < results["lora-chunked"]["tokens_per_window"]
    assert (tmp_path / "bench.png").stat().st_size > 0
