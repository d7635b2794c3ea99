"""bench_row_attention.py keeps working: the per-row calls and the three one-call variants over the same rows give
the same attention up to float rounding, each timed against the per-row calls, with the exactness counts
(timings are not asserted)."""

import json

import pytest


def test_every_variant_attends_as_the_per_row_calls_and_is_timed_against_them(load_benchmark, tmp_path):
    bench = load_benchmark("bench_row_attention")
    out = tmp_path / "r"
    argv = ["--keys", "5", "9", "17", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--capacity", "40",
            "--repeats", "2", "--warmup", "1", "--exact-cases", "3", "--pad-lengths", "3", "20", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert set(record["results"]) == {bench.PER_ROW, bench.COPY, bench.POOLED, bench.KERNEL}
    assert all(r["baseline"] == bench.PER_ROW and len(r["times_ms"]) == 2 for r in record["results"].values())
    assert record["max_abs_diff"][bench.PER_ROW] == 0
    assert all(d < 1e-5 for d in record["max_abs_diff"].values())  # a row masked out of the padding: the same keys
    exact = record["exactness"]
    assert exact["cases"] == 3
    assert all(0 <= exact[k] <= 3 for k in ("unpadded_equals_masked", "paddings_agree", "batched_equals_alone"))


def test_a_row_holding_more_keys_than_its_view_is_refused(load_benchmark, tmp_path):
    bench = load_benchmark("bench_row_attention")
    with pytest.raises(SystemExit, match="--keys must each be 1..--capacity"):
        bench.main(["--keys", "8", "50", "--capacity", "40", "--out", str(tmp_path / "r")])
