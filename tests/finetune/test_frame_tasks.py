"""Per-frame tasks: an episode whose task changes half-way keeps each frame's own task in reading and in training."""

import numpy as np
import pandas as pd
import pytest

from vla_finetune.data import TrainingData
from vla_runtime.api import load_policy
from vla_runtime.data import DatasetFeatures, Episode, LeRobotDataset, LeRobotWriter, WriterConfig

from .conftest import ACTION_NAMES, TASKS, episode, make_config

SWITCHES = [(TASKS[0], TASKS[1]), (TASKS[1], "open the drawer")]


@pytest.fixture(scope="module")
def switching(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("switch") / "ds"
    features = DatasetFeatures(cameras={"front": (32, 32)}, state_names=[f"s{i}" for i in range(4)], action_names=ACTION_NAMES)
    with LeRobotWriter(root, features, WriterConfig(fps=10)) as writer:
        for first, second in SWITCHES:
            ep = episode(rng, 8, first)
            writer.add_episode(Episode(ep.images, ep.state, ep.action, first, frame_tasks=[first] * 4 + [second] * 4))
    return root


def test_reader_gives_each_frame_its_own_task(switching):
    ds = LeRobotDataset(switching)
    assert ds.tasks == [TASKS[0], TASKS[1], "open the drawer"]
    for i, (first, second) in enumerate(SWITCHES):
        ep = ds.episode(i)
        assert ep.task == first and ep.frame_tasks == [first] * 4 + [second] * 4
    rows = pd.read_parquet(switching / "meta/episodes/chunk-000/file-000.parquet")
    assert [list(t) for t in rows.tasks] == [list(s) for s in SWITCHES]  # LeRobot lists every task of the episode


@pytest.mark.parametrize("history", ["single", "history"])
def test_training_windows_carry_their_frames_task(tiny_ckpt, switching, tmp_path, history):
    cfg = make_config(tiny_ckpt, switching, tmp_path / "out", history=history, data={"window": 3, "stride": 1})
    policy = load_policy(tiny_ckpt, dtype="float32")
    data = TrainingData.prepare(cfg, policy, cache_dir=tmp_path / "cache", build_cache=True, progress=False)
    frame_tasks = [t for first, second in SWITCHES for t in [first] * 4 + [second] * 4]
    assert data.decoded.tasks == frame_tasks
    seen = set()
    for w in data.windows:
        rows = data._rows(w)
        tasks = {frame_tasks[r] for r in rows}
        assert len(tasks) == 1  # no window straddles the switch: a new instruction is a new session
        (task,) = tasks
        assert data.prompts[w.episode] == policy.tokenizer.prompt(task)
        seen.add(task)
    assert seen == set(frame_tasks)
    # per window: every one of the 4 frames of a task (single), or the 2 full 3-step windows of each 4-frame run (history)
    assert len(data.windows) == (16 if history == "single" else 8)
