"""compare_evals.py: two sides of eval runs paired by task and seed; counts, McNemar, bootstrap, median miss, the
go-step split and clear errors when the sides do not pair."""

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def compare_evals(load_benchmark):
    return load_benchmark("compare_evals")


def write_run(path: Path, episodes: list[dict]) -> Path:
    """An eval directory whose results file holds ``episodes`` (the fields compared, the rest filled in)."""
    path.mkdir()
    rest = {
        "steps": 10,
        "policy_s": 0.1,
        "env_s": 0.1,
        "step_ms": [],
        "inference_ms": [],
        "kv_bytes_max": 0,
        "kv_final": {},
    }
    lines = [json.dumps({"job": job, **rest, **e}) + "\n" for job, e in enumerate(episodes)]
    (path / "episodes.jsonl").write_text("".join(lines))
    return path


def reference(seed: int, success: bool, miss_cm: float | None, go_step: int) -> dict:
    info = {"go_step": go_step} | ({} if miss_cm is None else {"miss_m": miss_cm / 100})
    return {"task": "memory-reference", "seed": seed, "success": success, "final_info": info}


def order(seed: int, success: bool) -> dict:
    return {"task": "memory-order", "seed": seed, "success": success, "final_info": {"go_step": 30}}


def test_paired_counts_mcnemar_and_median_miss_per_task_and_pooled(compare_evals, tmp_path):
    # reference: A right on seeds 0-5, B on 0-1 and 6; A only 4 (2-5), B only 1 (6)
    a_ref = [reference(s, s <= 5, 3.0 + s, 40) for s in range(8)]
    b_ref = [reference(s, s <= 1 or s == 6, None if s == 7 else 10.0 + s, 40) for s in range(8)]
    a = write_run(tmp_path / "a", a_ref + [order(s, True) for s in range(3)])
    b = write_run(tmp_path / "b", b_ref + [order(s, s == 0) for s in range(3)])
    out = compare_evals.report(compare_evals.read_side([a]), compare_evals.read_side([b]))
    ref = out["tasks"]["memory-reference"]
    assert (ref["episodes"], ref["a"], ref["b"], ref["a_only"], ref["b_only"]) == (8, 6, 3, 4, 1)
    assert ref["p_value"] == pytest.approx(2 * (1 + 5) / 2**5)  # exact binomial, 5 discordant, 1 the other way
    assert ref["diff_points"][0] == pytest.approx(100 * 3 / 8)
    assert ref["diff_points"][1] <= ref["diff_points"][0] <= ref["diff_points"][2]
    assert ref["median_miss_cm_a"] == pytest.approx(6.5)  # 3..10 cm
    assert ref["median_miss_cm_b"] == pytest.approx(13.0)  # 10..16 cm, seed 7 gave no answer
    assert "median_miss_cm_a" not in out["tasks"]["memory-order"]  # no miss recorded there
    assert (out["all"]["a"], out["all"]["b"], out["all"]["a_only"], out["all"]["b_only"]) == (9, 4, 6, 1)
    only = compare_evals.report(compare_evals.read_side([a]), compare_evals.read_side([b]), tasks=["memory-order"])
    assert list(only["tasks"]) == ["memory-order"] and only["all"]["episodes"] == 3
    with pytest.raises(ValueError, match=r"no episodes of \['memory-tally'\] in the runs, which hold \['memory-order'"):
        compare_evals.report(compare_evals.read_side([a]), compare_evals.read_side([b]), tasks=["memory-tally"])


def test_sides_pool_runs_over_different_seeds_and_split_at_the_go_step(compare_evals, tmp_path):
    a1 = write_run(tmp_path / "a1", [reference(s, True, 2.0, 30 + 10 * s) for s in range(3)])
    a2 = write_run(tmp_path / "a2", [reference(s, s != 10, 2.0, 30 + 10 * (s - 10)) for s in range(10, 13)])
    b1 = write_run(tmp_path / "b1", [reference(s, s == 0, 9.0, 30 + 10 * s) for s in range(3)])
    b2 = write_run(tmp_path / "b2", [reference(s, True, 2.0, 30 + 10 * (s - 10)) for s in range(10, 13)])
    out = compare_evals.report(
        compare_evals.read_side([a1, a2]), compare_evals.read_side([b1, b2]), go_split=40
    )  # go steps 30, 40, 50 in each run
    assert (out["all"]["episodes"], out["all"]["a"], out["all"]["b"]) == (6, 5, 4)
    early, late = out["go_split"]["go < 40"], out["go_split"]["go >= 40"]
    assert (early["episodes"], early["a_only"], early["b_only"]) == (2, 0, 1)  # seeds 0 and 10
    assert (late["episodes"], late["a_only"], late["b_only"]) == (4, 2, 0)  # seeds 1, 2, 11, 12
    assert early["diff_points"][0] == pytest.approx(-50.0)


def test_sides_that_do_not_pair_or_repeat_an_episode_are_refused(compare_evals, tmp_path):
    a = write_run(tmp_path / "a", [order(s, True) for s in range(3)])
    b = write_run(tmp_path / "b", [order(s, True) for s in range(1, 4)])
    with pytest.raises(ValueError, match=r"1 only in A .*memory-order', 0.*1 only in B .*memory-order', 3"):
        compare_evals.report(compare_evals.read_side([a]), compare_evals.read_side([b]))
    with pytest.raises(ValueError, match=r"memory-order seed 1 appears in both .*a and .*b: pool runs over different"):
        compare_evals.read_side([a, b])
    with pytest.raises(FileNotFoundError, match=r"episodes.jsonl not found: expected a `vla-runtime eval --out`"):
        compare_evals.read_side([tmp_path])
    no_go = write_run(
        tmp_path / "no_go", [{"task": "memory-order", "seed": s, "success": True, "final_info": {}} for s in range(3)]
    )
    with pytest.raises(ValueError, match=r"--go-split needs final_info\['go_step'\]"):
        compare_evals.report(compare_evals.read_side([no_go]), compare_evals.read_side([no_go]), go_split=10)


def test_the_cli_prints_every_row_and_writes_the_json(compare_evals, tmp_path, capsys):
    a = write_run(tmp_path / "a", [reference(s, True, 2.0, 40) for s in range(4)])
    b = write_run(tmp_path / "b", [reference(s, s < 2, 8.0, 40) for s in range(4)])
    compare_evals.main(["--a", str(a), "--b", str(b), "--go-split", "40", "--json", str(tmp_path / "out.json")])
    printed = capsys.readouterr().out
    for row in ("memory-reference", "all", "go < 40", "go >= 40"):
        assert row in printed
    assert "go < 40                   0" in printed  # every go light at 40: an empty row, not an error
    assert "2.0 cm / 8.0 cm" in printed
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["all"]["a_only"] == 2 and saved["all"]["b_only"] == 0
