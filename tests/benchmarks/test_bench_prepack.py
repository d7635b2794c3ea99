"""bench_prepack.py keeps working: both kernels' passes over a geometry's decoder weights, by rows, each against
ATen's row, with the outputs' agreement (timings are not asserted)."""

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def test_bench_prepack_times_both_kernels_by_rows_and_checks_they_agree(load_benchmark, tmp_path):
    bench = load_benchmark("bench_prepack")
    out = tmp_path / "p"
    assert bench.main(["--geometry", "small", "--rows", "1", "8", "--repeats", "2", "--warmup", "1", "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    rows = {f"small (96 MiB), {n} rows: {k}" for n in (1, 8) for k in (bench.ATEN, bench.PACKED)}
    assert set(record["results"]) == rows
    for name, r in record["results"].items():
        assert r["baseline"] == name.replace(bench.PACKED, bench.ATEN) and len(r["times_ms"]) == 2
    assert set(record["max_relative_diff"]) == {"small x1", "small x8"}
    assert all(0 < d < 1e-4 for d in record["max_relative_diff"].values())  # the same products up to float rounding
    assert len(bench.weights("7b-layer", 2)) == 14 and bench.weights("7b-layer", 2)[6].shape == (4096, 11008)


@pytest.mark.slow  # two policies of the serve bench's geometry step 21 times each
def test_policy_steps_time_one_and_eight_robots_of_both_policies_and_compare_their_tokens(load_benchmark, tmp_path):
    bench = load_benchmark("bench_prepack")
    out = tmp_path / "s"
    argv = ["--geometry", "small", "--rows", "8", "--repeats", "1", "--warmup", "1", "--policy-steps", "--out", str(out)]
    assert bench.main(argv) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    steps = {name for name in record["results"] if name.startswith("policy")}
    assert steps == {f"policy, {n}: {k}" for n in ("1 robot", "8 robots") for k in (bench.ATEN, bench.PACKED)}
    assert record["results"]["policy, 8 robots: prepacked"]["baseline"] == f"policy, 8 robots: {bench.ATEN}"
    assert record["policy_tokens_equal"] == {"1": True, "8": True}
