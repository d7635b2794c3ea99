"""bench_families.py keeps working: its pre-timing checks pass (full and chunked caches agree on the first
step; prefix reuse equals re-prefilling, diff and diff+ar) and it writes the JSON record (timings are not asserted)."""

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_families.py"


def test_bench_families_checks_agreement_and_writes_results(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_families", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        args = ["--llm", "tiny", "--history-steps", "6", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path / "bench")]
        assert bench.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "bench.json").read_text())
    assert set(record["env"]) == {"torch", "cuda", "device_name", "dtype", "threads", "git_sha"}
    results = record["results"]
    for family in ("openvla", "cogact", "hybridvla"):
        for mode in ("full", "chunked"):
            entry = results[f"{family} history, {mode} cache"]
            assert len(entry["times_ms"]) == 2 and entry["kv"]["tokens_seen"] > 0
    assert results["HybridVLA-dif: re-prefill (upstream structure)"]["ratio"] == 1.0
    assert results["HybridVLA-dif: prefix reuse (ours)"]["ratio"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 0
