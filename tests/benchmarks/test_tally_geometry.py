"""tally_geometry.py: eval episodes of memory-tally split by where the row lies, a logistic fit on the geometry, the
successes it expects elsewhere, and the paired test between two runs over the same seeds."""

import json
from pathlib import Path

import numpy as np
import pytest

from vla_runtime.sim.memory.tally import TallyTask

HAND = (0.0046, 0.6014)


@pytest.fixture(scope="module")
def geometry(load_benchmark):
    return load_benchmark("tally_geometry")


def off_cm(seed: int) -> float:
    return 100 * abs(HAND[1] - TallyTask.sample(seed).row[1])


def write_run(path: Path, seeds, success) -> Path:
    """An eval directory with memory-tally episodes of ``seeds`` (``success(seed)``) and one other task's episode."""
    path.mkdir()
    lines = [{"task": "memory-order", "seed": 0, "success": True, "final_info": {}}]
    for seed in seeds:
        ok = bool(success(seed))
        pad = TallyTask.sample(seed).count if ok else 1
        lines.append({"task": "memory-tally", "seed": seed, "success": ok, "final_info": {"pad": float(pad)}})
    (path / "episodes.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def two_flash_seeds(start: int, stop: int) -> list[int]:
    return [s for s in range(start, stop) if TallyTask.sample(s).count == 2]


def off_row_fails(seed: int) -> bool:
    """Success near the row, failure off it, with exceptions so that the logistic fit stays finite."""
    return (off_cm(seed) < 4.0) != (seed % 7 == 0)


def test_episodes_keep_the_count_and_carry_the_row_geometry(geometry, tmp_path):
    run = write_run(tmp_path / "a", range(60), off_row_fails)
    episodes = geometry.read_episodes(run, HAND, 2)
    assert [e.seed for e in episodes] == two_flash_seeds(0, 60) and episodes
    for e in episodes:
        row = TallyTask.sample(e.seed).row
        assert e.along_cm == pytest.approx(100 * (HAND[0] - row[0])) and 2.0 < e.along_cm < 11.0
        assert e.off_cm == pytest.approx(off_cm(e.seed)) and 0.0 <= e.off_cm <= 10.0
        assert e.pad == (2 if e.success else 1)
    assert {e.seed for e in geometry.read_episodes(run, HAND, 3)}.isdisjoint(e.seed for e in episodes)


def test_thirds_and_the_fit_find_the_factor_that_decides(geometry, tmp_path):
    run = write_run(tmp_path / "a", range(400), off_row_fails)
    out = geometry.report({"a": geometry.read_episodes(run, HAND, 2)}, paired=False)
    near, _, far = out["runs"]["a"]["off_cm"]
    assert near["successes"] / near["episodes"] > 0.8 > 0.3 > far["successes"] / far["episodes"]
    assert sum(r["episodes"] for r in out["runs"]["a"]["along_cm"]) == out["runs"]["a"]["episodes"]
    assert out["logistic"]["off"]["z"] < -3 and abs(out["logistic"]["along"]["z"]) < 3  # success does not depend on it


def test_a_fit_expects_its_own_successes_and_predicts_another_run(geometry, tmp_path):
    a = geometry.read_episodes(write_run(tmp_path / "a", range(400), off_row_fails), HAND, 2)
    fit = geometry.logistic_fit(geometry.geometry(a), np.array([e.success for e in a], dtype=float))
    # with an intercept, the maximum-likelihood fit's probabilities sum to the observed successes
    assert geometry.expected_successes(fit, geometry.geometry(a)) == pytest.approx(sum(e.success for e in a), abs=1e-6)
    b_run = write_run(tmp_path / "b", range(400, 800), off_row_fails)
    b = geometry.read_episodes(b_run, HAND, 2)
    out = geometry.report({"a": a, "b": b}, paired=False, fit_on="a")
    assert out["logistic"]["fit_on"] == "a" and out["expected"].keys() == {"b"}
    assert out["expected"]["b"] == pytest.approx(sum(e.success for e in b), rel=0.2)
    always_near = [e for e in b if e.off_cm < 2.0]  # the geometry, not the seed set, sets what the fit expects
    assert geometry.expected_successes(fit, geometry.geometry(always_near)) > 0.75 * len(always_near)


def test_paired_runs_are_compared_seed_by_seed(geometry, tmp_path):
    seeds = range(120)
    a = geometry.read_episodes(write_run(tmp_path / "a", seeds, off_row_fails), HAND, 2)
    b = geometry.read_episodes(write_run(tmp_path / "b", seeds, lambda s: off_row_fails(s) or s % 3 == 0), HAND, 2)
    out = geometry.report({"a": a, "b": b}, paired=True)
    gained = sum(1 for x, y in zip(a, b) if y.success and not x.success)
    assert gained > 0 and out["paired"]["a_only"] == 0 and out["paired"]["b_only"] == gained
    shuffled = geometry.read_episodes(write_run(tmp_path / "s", reversed(seeds), off_row_fails), HAND, 2)
    assert geometry.report({"a": a, "s": shuffled}, paired=True)["paired"]["a_only"] == 0  # paired by seed, not line
    c = geometry.read_episodes(write_run(tmp_path / "c", range(200, 320), off_row_fails), HAND, 2)
    with pytest.raises(ValueError, match="same seeds"):
        geometry.report({"a": a, "c": c}, paired=True)


def test_clear_errors_and_the_command_line(geometry, tmp_path):
    with pytest.raises(FileNotFoundError, match="vla-runtime eval"):
        geometry.read_episodes(tmp_path, HAND, 2)
    run = write_run(tmp_path / "a", range(200), off_row_fails)
    with pytest.raises(ValueError, match="not one of the runs"):
        geometry.report({"a": geometry.read_episodes(run, HAND, 2)}, paired=False, fit_on="b")
    with pytest.raises(ValueError, match="too few"):
        geometry.report({"a": geometry.read_episodes(run, HAND, 2)[:3]}, paired=False)
    out = tmp_path / "out.json"
    geometry.main([str(run), "--hand", *map(str, HAND), "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["runs"][str(run)]["episodes"] == len(two_flash_seeds(0, 200)) and "off" in saved["logistic"]
