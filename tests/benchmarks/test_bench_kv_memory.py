"""bench_kv_memory.py: the KV bytes a session's cache allocates when its store grows with the episode, against the same
cache allocated whole, through the same episode."""

import json


def test_a_growing_store_allocates_less_than_the_whole_and_holds_the_same(load_benchmark, tmp_path, capsys):
    kv_memory = load_benchmark("bench_kv_memory")
    out = tmp_path / "kv_memory"
    assert kv_memory.main(["--model", "tiny", "--image-tokens", "40", "--steps", "12", "--max-chunks", "8",
                           "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert set(rows) == {"full", "chunked, budget 8", "chunked, no budget", "sink window"}
    for name, row in rows.items():
        assert row["grown_slots"] == sorted(row["grown_slots"]), name  # a store never shrinks
        assert row["held_slots"] <= row["grown_slots"][-1] <= row["whole_slots"], name
    assert rows["full"]["grown_mib"] < rows["full"]["whole_mib"]  # 12 steps of 52 tokens hold 632 of 1,024 positions
    for name in ("chunked, budget 8", "chunked, no budget", "sink window"):
        assert rows[name]["grown_mib"] < rows[name]["whole_mib"] / 2, name
    assert "| chunked, budget 8 | 12 |" in capsys.readouterr().out


def test_policy_steps_time_a_growing_and_a_whole_store_and_compare_their_tokens(load_benchmark, tmp_path, monkeypatch):
    from vla_runtime.kv import store

    monkeypatch.setattr(store, "INITIAL_CHUNK_SLOTS", 2)  # the chunk area grows at the first compressions
    kv_memory = load_benchmark("bench_kv_memory")
    out = tmp_path / "kv_memory"
    assert kv_memory.main(["--model", "tiny", "--steps", "2", "--policy-steps", "6", "--out", str(out)]) == 0
    steps = json.loads(out.with_suffix(".json").read_text())["policy_steps"]
    assert steps["tokens_equal"] is True
    assert steps["grew"] and all(a < b for a, b in (g["slots"] for g in steps["grew"]))
    assert steps["grown"]["reserved_mib"] < steps["whole"]["reserved_mib"] / 4
    assert all(steps[name]["p50_ms"] <= steps[name]["p95_ms"] <= steps[name]["max_ms"] for name in ("grown", "whole"))
