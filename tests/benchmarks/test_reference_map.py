"""reference_map.py: memory-reference success by the spot's position, the spots drawn again from the seeds."""

import json
from pathlib import Path

import numpy as np
import pytest

from vla_runtime.sim.memory.reference import GOAL_HIGH, GOAL_LOW, ReferenceTask


@pytest.fixture(scope="module")
def reference_map(load_benchmark):
    return load_benchmark("reference_map")


def write_run(path: Path, episodes: list[tuple[str, int, bool]]) -> Path:
    """An eval directory whose results file holds (task, seed, success) episodes, the rest filled in."""
    path.mkdir()
    rest = {"steps": 10, "policy_s": 0.1, "env_s": 0.1, "step_ms": [], "inference_ms": []}
    rest |= {"kv_bytes_max": 0, "kv_final": {}}
    rows = [{"job": j, "task": t, "seed": s, "success": ok, **rest} for j, (t, s, ok) in enumerate(episodes)]
    lines = [json.dumps(row) + "\n" for row in rows]
    (path / "episodes.jsonl").write_text("".join(lines))
    return path


def cell_of(seed: int, cells: tuple[int, int]) -> tuple[int, int]:
    """(row, column) of the seed's spot, computed here from the area's bounds."""
    x, y = ReferenceTask.sample(seed).goal
    col = min(int((x - GOAL_LOW[0]) / (GOAL_HIGH[0] - GOAL_LOW[0]) * cells[0]), cells[0] - 1)
    row = min(int((y - GOAL_LOW[1]) / (GOAL_HIGH[1] - GOAL_LOW[1]) * cells[1]), cells[1] - 1)
    return row, col


def test_counts_land_in_the_cell_of_each_seeds_spot_and_runs_pool(reference_map, tmp_path):
    cells = (4, 2)
    seeds = list(range(40))
    wins = {s: s % 3 != 0 for s in seeds}
    a = write_run(tmp_path / "a", [("memory-reference", s, wins[s]) for s in seeds[:25]] + [("memory-order", 7, False)])
    b = write_run(tmp_path / "b", [("memory-reference", s, wins[s]) for s in seeds[25:]])
    out = reference_map.report({"pooled": [a, b]}, cells)
    side = out["sides"]["pooled"]
    expect_s, expect_e = np.zeros((2, 4), int), np.zeros((2, 4), int)
    for s in seeds:
        row, col = cell_of(s, cells)
        expect_e[row, col] += 1
        expect_s[row, col] += wins[s]
    assert side["episodes"] == expect_e.tolist() and side["successes"] == expect_s.tolist()
    assert side["total"] == [sum(wins.values()), 40]  # the order episode is not counted
    assert side["columns"] == [[int(s), int(e)] for s, e in zip(expect_s.sum(0), expect_e.sum(0))]
    assert out["x_edges_m"][0] == GOAL_LOW[0] and out["y_edges_m"][-1] == GOAL_HIGH[1] and len(out["x_edges_m"]) == 5


def test_a_spot_on_the_far_edge_falls_in_the_last_cell(reference_map):
    spots = np.array([GOAL_LOW, GOAL_HIGH])
    wins, eps = reference_map.success_grid(spots, np.array([True, False]), (3, 2))
    assert eps[0, 0] == 1 and eps[1, 2] == 1 and wins[0, 0] == 1 and wins.sum() == 1


def test_main_prints_the_grid_and_writes_the_picture(reference_map, tmp_path, capsys):
    run = write_run(tmp_path / "run", [("memory-reference", s, s % 2 == 0) for s in range(12)])
    png, js = tmp_path / "map.png", tmp_path / "map.json"
    argv = ["--side", "chunked", str(run), "--side", "full", str(run), "--out", str(png), "--json", str(js)]
    assert reference_map.main(argv) == 0
    text = capsys.readouterr().out
    assert "chunked: 6/12" in text and "full: 6/12" in text
    assert png.stat().st_size > 0 and json.loads(js.read_text())["sides"]["full"]["total"] == [6, 12]


def test_refuses_runs_without_reference_episodes_and_a_missing_directory(reference_map, tmp_path):
    run = write_run(tmp_path / "run", [("memory-order", 1, True)])
    with pytest.raises(ValueError, match="no memory-reference episode"):
        reference_map.report({"x": [run]}, (8, 3))
    with pytest.raises(FileNotFoundError, match="eval --out"):
        reference_map.report({"x": [tmp_path / "nowhere"]}, (8, 3))
    with pytest.raises(SystemExit):
        reference_map.parse_args(["--side", "only-a-name"])
