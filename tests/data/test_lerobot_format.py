"""Our datasets match LeRobot 0.6.1's output key for key, and info.json describes the streams actually written."""

import json
import os
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from vla_runtime.data import VIDEO_CODECS, DatasetFeatures, Episode, LeRobotDataset, LeRobotWriter, WriterConfig
from vla_runtime.data.video import probe

FIXTURE = Path(__file__).parents[1] / "fixtures" / "lerobot_v0.6.1" / "dataset"
FEATURES = DatasetFeatures(cameras={"cam": (64, 64)}, state_names=["s0", "s1"], action_names=["a0", "a1", "a2"])


def episodes():
    rng = np.random.default_rng(0)
    return [Episode({"cam": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)}, rng.normal(size=(n, 2)).astype(np.float32),
                    rng.normal(size=(n, 3)).astype(np.float32), task) for n, task in ((3, "pick the cube"), (4, "place the cube"))]


def write(root, codec):
    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10, robot_type="sawyer", video_codec=codec, extra_info={"sim": "x"})) as w:
        for ep in episodes():
            w.add_episode(ep)
    return root


@pytest.mark.parametrize("codec", sorted(VIDEO_CODECS))
def test_info_json_describes_the_stream_in_every_video_file(tmp_path, codec):
    root = write(tmp_path / "ds", codec)
    info = json.loads((root / "meta/info.json").read_text())["features"]["observation.images.cam"]["info"]
    videos = sorted(root.glob("videos/*/chunk-*/*.mp4"))
    assert len(videos) == 2
    for path in videos:
        stream = probe(path)  # codec, pix_fmt, size and fps as PyAV reports them
        assert {k: info[k] for k in stream} == stream, path
    if VIDEO_CODECS[codec].lossless:
        for ep, want in zip(LeRobotDataset(root), episodes()):
            np.testing.assert_array_equal(ep.images["cam"], want.images["cam"])


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="scheduling policies are Linux's")
@pytest.mark.parametrize("codec", sorted(VIDEO_CODECS))
def test_writing_leaves_the_writers_thread_scheduling_as_it_was(tmp_path, codec):
    """libsvtav1 (av1) switches the thread that opens it to SCHED_FIFO 99 when run as root (as CI is); every
    thread and process started from that thread later inherited it. The writing runs on a thread of its own
    so that a regression cannot leave the test process itself real-time."""
    seen = {}

    def writer() -> None:
        seen["before"] = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
        write(tmp_path / "ds", codec)
        seen["after"] = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen["after"] == seen["before"], f"{codec}: (policy, priority) {seen['before']} -> {seen['after']}"


def test_writer_output_matches_lerobot_0_6_1_key_for_key(tmp_path):
    root = write(tmp_path / "ds", "av1")  # the fixture's codec: LeRobot's default encoder
    ours, theirs = (json.loads((r / "meta/info.json").read_text()) for r in (root, FIXTURE))
    assert list(ours) == list(theirs)  # same keys, same order; no `vla_runtime` block (LeRobot warns and drops it)
    assert ours["features"] == theirs["features"]  # type tags, names, video info (no legacy video.is_depth_map)
    assert {k: ours[k] for k in ours if k != "features"} == {k: theirs[k] for k in theirs if k != "features"}
    assert json.loads((root / "meta/vla_runtime.json").read_text()) == {"sim": "x", "per_episode": {}}

    tasks, want = (pd.read_parquet(r / "meta/tasks.parquet") for r in (root, FIXTURE))
    assert tasks.index.name == want.index.name == "task" and list(tasks.columns) == list(want.columns) == ["task_index"]
    assert list(tasks.index) == list(want.index)

    eps, want = (pq.read_table(r / "meta/episodes/chunk-000/file-000.parquet") for r in (root, FIXTURE))
    assert eps.column_names == want.column_names
    for name in eps.column_names:
        if not name.startswith("stats/"):
            assert eps.schema.field(name).type == want.schema.field(name).type, name

    data, want = (pq.read_schema(r / "data/chunk-000/file-000.parquet") for r in (root, FIXTURE))
    assert [(f.name, f.type) for f in data] == [(f.name, f.type) for f in want]
    # `List`, not `Sequence` (datasets' `fingerprint` beside `info` is a content hash of theirs, not a format key)
    assert json.loads(data.metadata[b"huggingface"])["info"] == json.loads(want.metadata[b"huggingface"])["info"]
    assert json.loads((root / "meta/stats.json").read_text()).keys() == json.loads((FIXTURE / "meta/stats.json").read_text()).keys()


def test_reads_the_lerobot_fixture(tmp_path):
    ds = LeRobotDataset(FIXTURE)  # several episodes per data file and per mp4
    assert len(ds) == 2 and ds.tasks == ["pick the cube", "place the cube"] and ds.extra == {}
    table = pq.read_table(FIXTURE / "data/chunk-000/file-000.parquet")
    actions = np.stack(table.column("action").to_pylist()).astype(np.float32)
    for i, n in enumerate((3, 4)):
        ep = ds.episode(i)
        assert ep.images["cam"].shape == (n, 64, 64, 3) and ep.task == ds.tasks[i]
        np.testing.assert_array_equal(ep.action, actions[3 * i: 3 * i + n])
