"""The memory suite end to end: collect -> LeRobot dataset -> closed-loop eval with chance levels and the cache flags."""

import importlib.util
import json
import shutil

import numpy as np
import pytest

from vla_runtime import api
from vla_runtime.cli import main
from vla_runtime.data import LeRobotDataset
from vla_runtime.cli.sim_args import parse_tasks
from vla_runtime.sim import MEMORY_TASKS
from vla_runtime.sim.memory import MEMORY_GROUP
from vla_runtime.sim.collect import record_cue_steps
from vla_runtime.sim.memory.separable import separable_steps

from replay_policy import make_replay_policy

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed"),
]
TASKS = [*MEMORY_GROUP, "memory-counting"]
SEED = 3


def test_the_memory_group_is_the_shipped_policies_suite_and_every_task_is_named():
    assert parse_tasks("memory", "metaworld") == ["memory-reference", "memory-tally", "memory-order"]
    assert sorted(TASKS) == sorted(MEMORY_TASKS)


@pytest.fixture(scope="module")
def memory_demos(tmp_path_factory):
    """One expert episode per memory task, collected through the CLI as the README says (the ``memory`` group and
    ``memory-counting``)."""
    root = tmp_path_factory.mktemp("memory") / "demos"
    code = main(["collect", "--sim", "metaworld", "--tasks", ",".join(TASKS), "--episodes", "1", "--seed", str(SEED),
                 "--resolution", "32", "--out", str(root)])  # fmt: skip
    assert code == 0
    return root


def test_collect_writes_the_memory_suite(memory_demos):
    ds = LeRobotDataset(memory_demos)
    info = json.loads((memory_demos / "meta/info.json").read_text())
    assert info["total_episodes"] == len(TASKS) and ds.extra["per_episode"]["episode_seeds"] == [SEED] * len(TASKS)
    assert "observation.images.corner" in info["features"]  # the camera the cues are made for, by default
    instructions = [ds.episode(i).task for i in range(len(TASKS))]
    assert instructions == [MEMORY_TASKS[t].sample(SEED).instruction() for t in TASKS]
    for i, task in enumerate(TASKS):
        ep = ds.episode(i)
        assert len(ep) < MEMORY_TASKS[task].max_steps
        go = getattr(MEMORY_TASKS[task].sample(SEED), "go_step", 0)
        # the expert holds still while the arm is held, so the stored actions teach waiting for the lamp
        assert np.all(ep.action[:go, :3] == 0) and np.abs(ep.action[go:, :3]).max() > 0


def test_collect_records_the_cue_and_separable_steps_and_a_replay_recovers_them(memory_demos, tmp_path):
    ds = LeRobotDataset(memory_demos)
    recorded = ds.extra["per_episode"]["episode_cue_steps"]
    separable = ds.extra["per_episode"]["episode_separable_steps"]
    for i, (task, steps) in enumerate(zip(TASKS, recorded)):
        episode = MEMORY_TASKS[task].sample(SEED)
        if task == "memory-counting":  # the expert's presses, one step each
            assert len(steps) == episode.presses
        else:  # the frames the cue was drawn into, all before the lamp turns green
            assert steps and max(steps) < episode.go_step
        assert steps == sorted(set(steps))
        # the steps whose action depends on the answer: after go, in every task with a target (not counting)
        assert separable[i] == separable_steps(episode, ds.episode(i).state)
        assert bool(separable[i]) == (task != "memory-counting")
        assert all(t >= getattr(episode, "go_step", 0) for t in separable[i])
    copy = tmp_path / "demos"
    shutil.copytree(memory_demos, copy)
    extra_path = copy / "meta/vla_runtime.json"
    extra = json.loads(extra_path.read_text())
    del extra["per_episode"]["episode_cue_steps"]  # as collect wrote datasets before it recorded them
    del extra["per_episode"]["episode_separable_steps"]
    extra_path.write_text(json.dumps(extra))
    assert record_cue_steps(copy, progress=False) == recorded
    assert LeRobotDataset(copy).extra["per_episode"]["episode_cue_steps"] == recorded
    assert LeRobotDataset(copy).extra["per_episode"]["episode_separable_steps"] == separable
    extra = json.loads(extra_path.read_text())  # a replay that does not reproduce the stored states is refused
    extra["per_episode"]["episode_seeds"][0] += 1
    extra_path.write_text(json.dumps(extra))
    with pytest.raises(ValueError, match="episode 0 .* does not reproduce the stored states"):
        record_cue_steps(copy, progress=False)


def test_eval_reports_memory_tasks_beside_chance(memory_demos, tmp_path, monkeypatch, capsys):
    (memory_demos / "REPLAY").touch()  # marks the dataset as a checkpoint of the test family below
    monkeypatch.setitem(api.FAMILIES, "test-replay", (lambda p: (p / "REPLAY").exists(), lambda p, **kw: make_replay_policy(p)))
    out = tmp_path / "eval"
    code = main(["eval", "--checkpoint", str(memory_demos), "--sim", "metaworld", "--tasks", ",".join(TASKS), "--episodes", "1",
                 "--seed", str(SEED), "--resolution", "32", "--no-video", "--out", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "chance" in printed and "33.3%" in printed and "25.0%" in printed and "9.4%" in printed
    summary = json.loads((out / "report.json").read_text())["summary"]
    for task in TASKS:  # the stored expert actions, replayed through the simulator, answer right
        m = summary["tasks"][task]
        assert m["success_rate"] == 1.0 and m["chance_level"] == pytest.approx(MEMORY_TASKS[task].chance_level())
    # how each episode answered reaches the summary and the printed table
    answers = {t: summary["tasks"][t]["answers"] for t in TASKS}
    n = MEMORY_TASKS["memory-counting"].sample(SEED).presses
    assert answers["memory-counting"] == {f"N={n} made {n}": 1}
    assert answers["memory-order"]["first"] == 1 and answers["memory-reference"]["< 6 cm"] == 1
    flashes = MEMORY_TASKS["memory-tally"].sample(SEED).count
    assert answers["memory-tally"] == {f"N={flashes} answered {flashes}": 1}
    assert f"memory-counting answers: N={n} made {n}: 1" in printed
    assert summary["overall"]["chance_level"] == pytest.approx(np.mean([MEMORY_TASKS[t].chance_level() for t in TASKS]))


def test_eval_tiny_openvla_with_a_window_matched_to_a_chunked_budget(tmp_path, capsys):
    """A real tiny OpenVLA in history mode on a memory task, with a sliding window sized to a chunked cache's bytes."""
    ckpt = tmp_path / "tiny-openvla"
    assert main(["make-tiny", str(ckpt), "--family", "openvla", "--dtype", "float32"]) == 0
    out = tmp_path / "eval"
    code = main(["eval", "--checkpoint", str(ckpt), "--sim", "metaworld", "--tasks", "memory-reference", "--episodes", "1",
                 "--max-steps", "4", "--resolution", "56", "--history", "history", "--kv", "sink_window", "--kv-window", "40",
                 "--kv-match-chunks", "8", "--no-video", "--out", str(out)])  # fmt: skip
    assert code == 0
    # W' = M + W + C - 1 - n_sink = 8 + 40 + 16 - 1 - 4
    assert "sink_window: window 59 tokens holds the KV bytes of chunked (window 40, chunk 16, 8 chunks" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["kv"] == {"mode": "sink_window", "window": 59, "max_chunks": None, "chunk_mass": None, "matched_chunks": 8}
    (episode,) = report["episodes"]
    assert episode["steps"] == 4 and episode["error"] is None and episode["kv_final"]["tokens_raw"] > 0


def test_eval_under_delays_the_policy_was_not_trained_on(tmp_path):
    ckpt = tmp_path / "tiny-openvla"
    assert main(["make-tiny", str(ckpt), "--family", "openvla", "--dtype", "float32"]) == 0
    out = tmp_path / "eval"
    code = main(["eval", "--checkpoint", str(ckpt), "--sim", "metaworld", "--tasks", "memory-order", "--episodes", "1",
                 "--max-steps", "3", "--resolution", "56", "--memory-delays", "90:120", "--no-video", "--out", str(out)])  # fmt: skip
    assert code == 0
    assert "memory_delays=(90, 120)" in json.loads((out / "report.json").read_text())["sim_config"]
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", str(ckpt), "--sim", "metaworld", "--tasks", "memory-order", "--memory-delays", "9:5"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv", "chunked", "--kv-window", "48", "--kv-match-chunks", "8"], "--kv-match-chunks sizes a sink_window cache; got --kv chunked"),
        (["--kv", "sink_window", "--kv-match-chunks", "8"], "--kv-match-chunks needs --kv-window"),
        (["--tasks", "memory-nope"], "unknown Meta-World task 'memory-nope'; valid tasks: "),
    ],
)
def test_eval_flag_errors_are_one_clear_line(memory_demos, monkeypatch, capsys, flags, message):
    (memory_demos / "REPLAY").touch()
    monkeypatch.setitem(api.FAMILIES, "test-replay", (lambda p: (p / "REPLAY").exists(), lambda p, **kw: make_replay_policy(p)))
    args = ["eval", "--checkpoint", str(memory_demos), "--sim", "metaworld", "--tasks", "memory-order", "--no-video"]
    assert main(args + flags) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    if "valid tasks" in message:
        assert "memory-counting" in err and "reach-v3" in err
