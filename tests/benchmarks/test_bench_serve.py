"""bench_serve.py keeps working: openpi clients in a child process against the batched and the one-at-a-time
server, its JSON record, and the soak mode (timings and RSS are not asserted)."""

import json

import pytest

pytest.importorskip("openpi_client", reason="openpi-client is not installed (scripts/setup.sh installs it with --no-deps)")


@pytest.fixture
def bench(load_benchmark):
    return load_benchmark("bench_serve")


def test_load_rounds_write_both_variants(bench, tmp_path):
    out = tmp_path / "serve.json"
    args = ["--llm", "tiny", "--clients", "1", "2", "--steps", "3", "--warmup", "1", "--repeats", "1", "--rate-hz", "0", "--out", str(out)]
    assert bench.main(args) == 0
    record = json.loads(out.read_text())
    assert set(record["summary"]) == {"1|batched", "1|one-at-a-time", "2|batched", "2|one-at-a-time"}
    assert all(s["actions_per_s"] > 0 and 0 < s["p50_ms"] <= s["p95_ms"] for s in record["summary"].values())
    assert sum(int(k) * v for k, v in record["batch_sizes"].items()) == (1 + 2) * (3 + 1)  # every step of the batched server
    step_ms = record["step_ms"]  # median forward time per batch size, each server
    assert set(step_ms["batched"]) == set(record["batch_sizes"]) and set(step_ms["one-at-a-time"]) == {"1"}
    assert all(ms > 0 for sizes in step_ms.values() for ms in sizes.values())


def test_soak_counts_connections_and_no_errors(bench, tmp_path):
    out = tmp_path / "soak.json"
    assert bench.main(["--llm", "tiny", "--soak", "2", "--clients", "2", "--out", str(out)]) == 0
    soak = json.loads(out.read_text())["soak"]
    assert soak["connections"] >= 1 and soak["steps"] >= 1 and soak["errors"] == [] and soak["sessions_left"] == 0


@pytest.mark.slow  # the third server's sessions compile (inductor, ~30 s on 2 cores)
def test_compile_adds_a_server_of_compiled_sessions_one_at_a_time(bench, tmp_path):
    out = tmp_path / "serve.json"
    args = ["--llm", "tiny", "--clients", "1", "--steps", "2", "--warmup", "1", "--repeats", "1", "--rate-hz", "0",
            "--compile", "default", "--out", str(out)]
    assert bench.main(args) == 0
    record = json.loads(out.read_text())
    assert set(record["summary"]) == {f"1|{v}" for v in ("batched", "one-at-a-time", bench.COMPILED)}
    assert set(record["step_ms"][bench.COMPILED]) == {"1"}  # its forwards: one robot's compiled step at a time


def test_prepack_loads_the_servers_policy_prepacked(bench, tmp_path, monkeypatch):
    import vla_runtime.api

    seen = []
    load = vla_runtime.api.load_policy
    monkeypatch.setattr(vla_runtime.api, "load_policy", lambda *a, **k: seen.append(k["prepack"]) or load(*a, **k))
    for flags in ([], ["--prepack"]):
        bench.make_policy(bench.parse_args(["--llm", "tiny", *flags]), tmp_path / str(len(flags)))
    assert seen == [False, True]
