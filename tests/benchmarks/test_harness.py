"""vla_runtime.bench.harness: timing on an injected clock (warm-up excluded, rounds interleaved), medians,
percentiles and ratios from known times, pinned threads, the environment record and the JSON report."""

import json
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_runtime.bench import harness


class ScriptedWork:
    """A fake clock and functions that advance it by scripted durations (seconds), logging each call."""

    def __init__(self, durations: dict[str, list[float]]) -> None:
        self.now = 100.0
        self.durations = {name: iter(d) for name, d in durations.items()}
        self.calls: list[str] = []

    def clock(self) -> float:
        return self.now

    def fn(self, name: str):
        def call() -> None:
            self.calls.append(name)
            self.now += next(self.durations[name])

        return call


def test_time_ms_drops_the_warmup_calls_and_converts_to_milliseconds():
    work = ScriptedWork({"f": [9.0, 9.0, 0.004, 0.002, 0.003]})
    times = harness.time_ms(work.fn("f"), warmup=2, repeats=3, clock=work.clock)
    assert times == pytest.approx([4.0, 2.0, 3.0])
    assert work.calls == ["f"] * 5


def test_time_interleaved_warms_every_function_then_alternates_rounds():
    work = ScriptedWork({"base": [5.0, 0.010, 0.030, 0.020], "ours": [5.0, 0.004, 0.005, 0.009]})
    times = harness.time_interleaved({"base": work.fn("base"), "ours": work.fn("ours")}, warmup=1, repeats=3, clock=work.clock)
    assert work.calls == ["base", "ours"] + ["base", "ours"] * 3
    assert times["base"] == pytest.approx([10.0, 30.0, 20.0]) and times["ours"] == pytest.approx([4.0, 5.0, 9.0])


def test_time_interleaved_in_blocks_times_consecutive_calls_after_an_untimed_first():
    work = ScriptedWork({"base": [5.0, 9.0, 0.010, 0.030, 9.0, 0.020, 0.040], "ours": [5.0, 9.0, 0.004, 0.005, 9.0, 0.006, 0.007]})
    times = harness.time_interleaved({"base": work.fn("base"), "ours": work.fn("ours")}, warmup=1, repeats=2, block=3,
                                     clock=work.clock)  # fmt: skip
    assert work.calls == ["base", "ours"] + (["base"] * 3 + ["ours"] * 3) * 2
    assert times["base"] == pytest.approx([10.0, 30.0, 20.0, 40.0]) and times["ours"] == pytest.approx([4.0, 5.0, 6.0, 7.0])
    with pytest.raises(ValueError, match="block must be >= 1"):
        harness.time_interleaved({"base": work.fn("base")}, warmup=0, repeats=1, block=0)


def test_ratio_table_divides_the_baseline_median_by_each_row_median():
    results = harness.ratio_table({"base": [10.0, 30.0, 20.0], "ours": [4.0, 5.0, 9.0, 100.0]}, "base")
    assert results["base"]["median_ms"] == 20.0 and results["ours"]["median_ms"] == 7.0
    assert results["base"]["ratio"] == 1.0 and results["ours"]["ratio"] == pytest.approx(20.0 / 7.0)
    assert results["ours"]["baseline"] == "base" and results["ours"]["times_ms"] == [4.0, 5.0, 9.0, 100.0]
    assert results["ours"]["p10_ms"] == pytest.approx(np.percentile([4, 5, 9, 100], 10))
    assert results["ours"]["p90_ms"] == pytest.approx(np.percentile([4, 5, 9, 100], 90))


def test_ratio_table_with_a_baseline_per_row_and_an_unknown_baseline():
    times = {"a0": [2.0], "a1": [1.0], "b0": [9.0], "b1": [3.0]}
    results = harness.ratio_table(times, {"a0": "a0", "a1": "a0", "b0": "b0", "b1": "b0"})
    assert [r["ratio"] for r in results.values()] == [1.0, 2.0, 1.0, 3.0]
    with pytest.raises(KeyError, match=r"baseline rows \['zz'\] are not among the timed rows"):
        harness.ratio_table(times, "zz")


def test_percentile_interpolates_as_numpy_does():
    values = list(np.random.default_rng(0).normal(size=11))
    for q in (0, 10, 37.5, 50, 90, 100):
        assert harness.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert harness.summarize([3.0])["p10_ms"] == 3.0
    with pytest.raises(ValueError, match="no values"):
        harness.percentile([], 50)


def test_print_ratio_table_has_a_line_per_row(capsys):
    harness.print_ratio_table(harness.ratio_table({"baseline": [2.0, 4.0], "x": [1.0]}, "baseline"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[1:] == ["median ms", "    p10", "    p90", "ratio vs baseline"]
    assert [line.split("|")[0].strip() for line in lines[1:]] == ["baseline", "x"]
    assert lines[2].split("|")[-1].strip() == "3.00"


def test_pinned_threads_sets_and_restores_torch_threads():
    before = torch.get_num_threads()
    with harness.pinned_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        with harness.pinned_threads(0):
            pass


def test_environment_records_what_the_numbers_depend_on():
    env = harness.environment(device="cpu", dtype=torch.float32, threads=3, model="tiny")
    assert set(env) == {"torch", "cuda", "device", "device_name", "cpu", "dtype", "threads", "python", "git_sha", "model"}
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["dtype"] == "float32"
    assert env["threads"] == 3 and env["model"] == "tiny" and env["cpu"] == env["device_name"] == harness.cpu_model() != ""
    assert re.fullmatch(r"[0-9a-f]{40}", env["git_sha"])  # the tests run in a checkout
    assert harness.environment()["threads"] == torch.get_num_threads()


def test_git_sha_outside_a_checkout_is_none(tmp_path):
    assert harness.git_sha(tmp_path) is None


def test_write_json_writes_env_args_and_sections(tmp_path):
    args = {"out": Path("results/x"), "repeats": 3}
    results = harness.ratio_table({"base": [2.0, 4.0], "ours": [1.0, 2.0]}, "base")
    path = harness.write_json(tmp_path / "new" / "x.json", env={"torch": "2"}, args=args, results=results, note="n")
    record = json.loads(path.read_text())
    assert record == {"env": {"torch": "2"}, "args": {"out": "results/x", "repeats": 3}, "results": results, "note": "n"}
    assert record["results"]["ours"]["ratio"] == statistics.median([2.0, 4.0]) / statistics.median([1.0, 2.0])


def test_plot_medians_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    results = harness.ratio_table({"base": [2.0, 4.0], "ours": [1.0, 2.0]}, "base")
    harness.plot_medians(results, tmp_path / "p.png", title="t", xlabel="ms")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["bench_oft", "bench_fast", "bench_families", "bench_serve"])
def test_zero_repeats_is_refused_before_any_setup(name, load_benchmark, capsys):
    with pytest.raises(SystemExit):
        load_benchmark(name).parse_args(["--repeats", "0"])
    assert "argument --repeats: expected an integer >= 1, got 0" in capsys.readouterr().err
