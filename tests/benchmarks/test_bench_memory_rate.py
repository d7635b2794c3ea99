"""bench_memory_rate.py keeps working: both shipped memory policies step the same episodes in one process, every
timed step of each is recorded (warm-up episodes excluded), and the control rates are 1000 / mean ms (timings
themselves are not asserted)."""

import json
import statistics

import pytest


def test_bench_memory_rate_times_both_caches_over_the_same_episodes(tmp_path, load_benchmark):
    bench = load_benchmark("bench_memory_rate")
    argv = ["--steps", "3", "--episodes", "2", "--warmup-episodes", "1", "--out", str(tmp_path / "m")]
    assert bench.main(argv) == 0
    record = json.loads((tmp_path / "m.json").read_text())
    results, rates = record["results"], record["control_rate_hz"]
    assert set(results) == set(rates) == {"chunked, compile off", "full, compile off"}
    for name, r in results.items():
        assert len(r["times_ms"]) == 2 * 3 and r["baseline"] == "full, compile off"
        assert rates[name] == pytest.approx(1e3 / statistics.mean(r["times_ms"]))


def test_bench_memory_rate_names_a_folder_that_is_not_a_checkpoint(tmp_path, load_benchmark, capsys):
    bench = load_benchmark("bench_memory_rate")
    with pytest.raises(SystemExit):
        bench.parse_args(["--full", str(tmp_path)])
    assert f"--full {tmp_path} is not an OpenVLA checkpoint directory (no config.json)" in capsys.readouterr().err
