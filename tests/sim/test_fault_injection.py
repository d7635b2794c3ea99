"""SIGKILL ``collect`` and ``eval`` mid-run, then check what survived and that ``--resume`` finishes the job.

The kill points come from the child's own progress lines (the writer logs "writing episode k" before it
starts an episode's files and "episode k durable" after its commit; eval logs "episode k result durable"),
never from sleeps: the child is killed the moment the line arrives, so "writing" kills land inside a
flush. Whatever moment the kill hits, the assertions must hold.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vla_runtime.data import LeRobotDataset
from vla_runtime.sim.results import RESULTS_FILE, read_results

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed"),
]
CLI = Path(__file__).parent / "replay_cli.py"
TASKS = "button-press-topdown-v3,button-press-v3"  # scenes the replay policy tells apart by the first frame
COLLECT = ["collect", "--sim", "metaworld", "--tasks", TASKS, "--episodes", "2", "--seed", "5", "--resolution", "16"]


def run(args: list[str], kill_at: str | None = None, expect: int = 0) -> tuple[int, list[str]]:
    """Run the CLI; with ``kill_at``, SIGKILL it as soon as a line containing that text appears."""
    proc = subprocess.Popen([sys.executable, str(CLI), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if kill_at is not None and kill_at in line:
            proc.kill()
            break
    proc.stdout.close()
    code = proc.wait()
    if kill_at is not None:
        assert code == -9, f"the run ended before printing {kill_at!r}:\n{''.join(lines)}"
    else:
        assert code == expect, "".join(lines)
    return code, lines


def count(lines: list[str], text: str) -> int:
    return sum(text in line for line in lines)


def assert_same_episodes(ds: LeRobotDataset, reference: LeRobotDataset, n: int) -> None:
    for i in range(n):
        got, want = ds.episode(i), reference.episode(i)
        assert got.task == want.task
        np.testing.assert_array_equal(got.images["corner2"], want.images["corner2"])
        np.testing.assert_array_equal(got.action, want.action)
        np.testing.assert_array_equal(got.state, want.state)


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    """The uninterrupted collect run: the reference, and the replay policy's demonstrations."""
    root = tmp_path_factory.mktemp("fault") / "whole"
    run(COLLECT + ["--out", str(root)])
    return root


def test_collect_killed_anywhere_resumes_to_the_uninterrupted_dataset(demos, tmp_path):
    reference = LeRobotDataset(demos)
    out = tmp_path / "killed"
    # kill inside the flush of episode 1; then, resumed, right after episode 2 (the second task's first) is committed:
    # the next resume must go on with that task's next seed
    for attempt, (kill_at, durable) in enumerate([("writing episode 1", 1), ("episode 2 durable", 3)]):
        run(COLLECT + ["--out", str(out)] + (["--resume"] if attempt else []), kill_at=kill_at)
        ds = LeRobotDataset(out)  # what a kill leaves loads, holding every episode finished before it
        assert len(ds) >= durable
        assert_same_episodes(ds, reference, len(ds))
    _, lines = run(COLLECT + ["--out", str(out)], expect=2)
    assert lines[-1].startswith("vla-runtime collect: error: ") and "pass --resume to continue it" in lines[-1]
    _, lines = run(COLLECT + ["--out", str(out), "--resume"])
    ds = LeRobotDataset(out)
    assert len(ds) == len(reference) == 4
    assert_same_episodes(ds, reference, 4)
    for meta in ("info.json", "vla_runtime.json", "stats.json"):  # counters, tasks, seeds, statistics: the same dataset
        assert json.loads((out / "meta" / meta).read_text()) == json.loads((demos / "meta" / meta).read_text()), meta
    assert not list(out.rglob("*.tmp"))


def test_eval_killed_between_episodes_resumes_to_the_same_outcomes(demos, tmp_path):
    (demos / "REPLAY").touch()  # the replay family's marker: the dataset doubles as a checkpoint
    common = ["eval", "--checkpoint", str(demos), "--sim", "metaworld", "--tasks", TASKS, "--episodes", "1", "--seed", "5",
              "--resolution", "16", "--kv", "full", "--history", "single"]
    run(common + ["--out", str(tmp_path / "whole")])
    out = tmp_path / "killed"
    run(common + ["--out", str(out)], kill_at="episode 0 result durable")
    finished = read_results(out / RESULTS_FILE)
    assert len(finished) >= 1 and (out / "videos" / "button-press-topdown-v3.mp4").stat().st_size > 0
    _, lines = run(common + ["--out", str(out), "--resume"])
    assert count(lines, "result durable") == 2 - len(finished)  # only the unfinished episodes ran again

    def outcomes(root):
        report = json.loads((root / "report.json").read_text())
        episodes = [(e["task"], e["seed"], e["success"], e["steps"], e["kv_bytes_max"]) for e in report["episodes"]]
        summary = {t: (m["episodes"], m["successes"], m["mean_steps"]) for t, m in report["summary"]["tasks"].items()}
        return episodes, summary

    assert outcomes(out) == outcomes(tmp_path / "whole")
    assert [(e["task"], e["seed"], e["success"]) for e in json.loads((out / "report.json").read_text())["episodes"]] == [
        ("button-press-topdown-v3", 5, True), ("button-press-v3", 5, True)]
