"""bench_rtc.py keeps working, and real-time chunking does what it is for: when a chunk lands, the action
queued for the next tick changes far less than when the new chunk simply replaces the old (random CogACT)."""

import json


def test_bench_rtc_runs_and_rtc_joins_chunks(tmp_path, capsys, load_benchmark):
    bench = load_benchmark("bench_rtc")
    out = tmp_path / "rtc"
    assert bench.main(["--episodes", "1", "--ticks", "40", "--image-size", "28", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert set(results) == {"none", "temporal", "adaptive", "rtc"}
    assert results["none"]["switches"] > 0 and results["rtc"]["switches"] > 0
    assert results["rtc"]["plan_change_mean"] < 0.5 * results["none"]["plan_change_mean"]
    assert "plan change" in capsys.readouterr().out
