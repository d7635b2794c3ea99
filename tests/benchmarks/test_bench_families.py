"""bench_families.py keeps working: its pre-timing checks pass (full and chunked caches agree on the first
step; prefix reuse equals re-prefilling, diff and diff+ar) and it writes the JSON record (timings are not asserted)."""

import json

import pytest


def test_bench_families_checks_agreement_and_writes_results(tmp_path, load_benchmark):
    bench = load_benchmark("bench_families")
    args = ["--llm", "tiny", "--history-steps", "6", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path / "bench")]
    assert bench.main(args) == 0
    record = json.loads((tmp_path / "bench.json").read_text())
    assert set(record["env"]) == {"torch", "cuda", "device", "device_name", "cpu", "dtype", "threads", "python", "git_sha"}
    results = record["results"]
    for family in ("openvla", "cogact", "hybridvla"):
        for mode in ("full", "chunked"):
            entry = results[f"{family} history, {mode} cache"]
            assert len(entry["times_ms"]) == 2 and entry["kv"]["tokens_seen"] > 0
            assert entry["baseline"] == f"{family} history, full cache"
    assert results["HybridVLA-dif: prefix reuse (ours)"]["baseline"] == "HybridVLA-dif: re-prefill (upstream structure)"
    for r in results.values():  # each row against its own group's baseline
        assert r["ratio"] == pytest.approx(results[r["baseline"]]["median_ms"] / r["median_ms"])
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_families_runs_in_bfloat16(tmp_path, load_benchmark):
    """What ``--device cuda`` defaults to: the re-prefill baseline's cache follows the policy's dtype (it was
    float32 on the CPU and the first HybridVLA step failed, after every history session was filled)."""
    args = ["--llm", "tiny", "--dtype", "bfloat16", "--history-steps", "2", "--repeats", "1", "--warmup", "0",
            "--out", str(tmp_path / "fresh" / "bench")]  # fmt: skip
    assert load_benchmark("bench_families").main(args) == 0
    assert json.loads((tmp_path / "fresh" / "bench.json").read_text())["env"]["dtype"] == "bfloat16"
