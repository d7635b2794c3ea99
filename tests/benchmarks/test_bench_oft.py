"""bench_oft.py keeps working: its pre-timing shape checks pass and it writes per-action ratios (not asserted)."""

import json

import pytest


def test_bench_oft_writes_per_action_ratios(load_benchmark, tmp_path, capsys):
    bench = load_benchmark("bench_oft")
    assert bench.main(["--llm", "tiny", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "b")]) == 0
    results = json.loads((tmp_path / "b.json").read_text())["results"]
    oft = results["openvla-oft parallel (chunk 8/step)"]
    base = results[bench.BASELINE]
    assert (oft["actions_per_step"], base["actions_per_step"]) == (8, 1)
    assert oft["ratio"] == pytest.approx(base["median_ms"] / oft["median_ms"])
    assert oft["median_ms"] == pytest.approx(oft["step_median_ms"] / 8)
    assert "ratio vs baseline" in capsys.readouterr().out
