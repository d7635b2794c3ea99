"""Against the real LeRobot 0.6.1: it reads our datasets for every codec, edits them (delete_episodes, merge), and
writes a dataset that we read.

LeRobot 0.6.1 needs Python >= 3.12 and torch < 2.12, so it cannot live in the project's environment: this test
drives ``lerobot_interop.py`` under the interpreter that ``LEROBOT_PYTHON`` names, e.g.

    python3.12 -m venv /opt/lerobot && /opt/lerobot/bin/pip install lerobot==0.6.1 "torch<2.12"
    LEROBOT_PYTHON=/opt/lerobot/bin/python .venv/bin/python -m pytest tests/data/test_lerobot_interop.py
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from vla_runtime.data import VIDEO_CODECS, DatasetFeatures, Episode, LeRobotDataset, LeRobotWriter, WriterConfig

LEROBOT_PYTHON = os.environ.get("LEROBOT_PYTHON")
pytestmark = pytest.mark.skipif(
    not LEROBOT_PYTHON,
    reason="needs LeRobot 0.6.1, which requires Python >= 3.12 and torch < 2.12: set LEROBOT_PYTHON to such an "
    "interpreter with lerobot==0.6.1 installed",
)
SCRIPT = Path(__file__).with_name("lerobot_interop.py")
FEATURES = DatasetFeatures(cameras={"front": (64, 64)}, state_names=["s0", "s1"], action_names=["a0", "a1", "a2"])
CODECS = [None, *sorted(VIDEO_CODECS)]


def episodes() -> list[Episode]:
    rng = np.random.default_rng(3)
    out = []
    for n, tasks in ((3, ["pick"] * 3), (4, ["place"] * 4), (6, ["pick"] * 3 + ["stack"] * 3)):  # the last switches task
        out.append(Episode({"front": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)}, rng.normal(size=(n, 2)).astype(np.float32),
                           rng.normal(size=(n, 3)).astype(np.float32), tasks[0], frame_tasks=None if len(set(tasks)) == 1 else tasks))
    return out


def exact(codec) -> bool:
    return codec is None or VIDEO_CODECS[codec].lossless


def assert_episodes(ds: LeRobotDataset, want: list[Episode], codec) -> None:
    assert len(ds) == len(want)
    for got, ep in zip(ds, want):
        np.testing.assert_array_equal(got.action, ep.action)
        np.testing.assert_array_equal(got.state, ep.state)
        assert got.tasks_per_frame() == ep.tasks_per_frame()
        if exact(codec):
            np.testing.assert_array_equal(got.images["front"], ep.images["front"])


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    base = tmp_path_factory.mktemp("interop")
    roots = []
    for codec in CODECS:
        root = base / (codec or "png")
        with LeRobotWriter(root, FEATURES, WriterConfig(fps=10, robot_type="sawyer", video_codec=codec)) as writer:
            for ep in episodes():
                writer.add_episode(ep)
        roots.append(root)
    # what a kill during episode 2's commit leaves: its files written, meta/episodes rewritten, info.json still at 2
    killed = base / "killed"
    with LeRobotWriter(killed, FEATURES, WriterConfig(fps=10, robot_type="sawyer", video_codec="hevc_lossless")) as writer:
        for ep in episodes()[:2]:
            writer.add_episode(ep)
        committed = (killed / "meta/info.json").read_bytes()
        writer.add_episode(episodes()[2])
    (killed / "meta/info.json").write_bytes(committed)
    (killed / "data/chunk-000/file-003.parquet.tmp").write_bytes(b"PAR1 torn")
    out = base / "lerobot"
    done = subprocess.run([LEROBOT_PYTHON, str(SCRIPT), str(out), *map(str, roots), "--read-only", str(killed)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.parametrize("codec", CODECS)
def test_lerobot_reads_edits_and_merges_our_dataset(interop, codec):
    name = codec or "png"
    eps = episodes()
    read = np.load(interop / f"{name}-read.npz")
    np.testing.assert_array_equal(read["action"], np.concatenate([ep.action for ep in eps]))
    assert json.loads((interop / f"{name}-tasks.json").read_text()) == [t for ep in eps for t in ep.tasks_per_frame()]
    ours = np.concatenate([ep.images["front"] for ep in LeRobotDataset(interop.parent / name)])
    if exact(codec):
        np.testing.assert_array_equal(read["images"], np.concatenate([ep.images["front"] for ep in eps]))
    else:  # lossy: LeRobot's decoder and ours see the same stream
        assert np.abs(read["images"].astype(int) - ours.astype(int)).max() <= 2
    assert_episodes(LeRobotDataset(interop / f"{name}-deleted"), [eps[0], eps[2]], codec)
    merged = LeRobotDataset(interop / f"{name}-merged")
    assert_episodes(merged, [eps[0], eps[2], *eps], codec)
    if codec is not None:  # merging packed the episodes into one file per camera
        assert len({(r["videos/observation.images.front/file_index"]) for r in merged._episodes}) == 1
    assert_episodes(LeRobotDataset(interop / f"{name}-merged-deleted"), [eps[0], eps[0], eps[2]], codec)


def test_lerobot_loads_a_dataset_a_kill_interrupted(interop):
    read = np.load(interop / "killed-read.npz")
    eps = episodes()[:2]  # the finished ones; the episode in progress is not part of it
    np.testing.assert_array_equal(read["action"], np.concatenate([ep.action for ep in eps]))
    np.testing.assert_array_equal(read["images"], np.concatenate([ep.images["front"] for ep in eps]))


def test_we_read_a_dataset_lerobot_wrote(interop):
    given = np.load(interop / "lerobot-written.npz")
    ds = LeRobotDataset(interop / "lerobot-written")
    assert len(ds) == 2 and ds.tasks == ["pick the cube", "place the cube"]
    np.testing.assert_array_equal(np.concatenate([ep.action for ep in ds]), given["action"])
    np.testing.assert_array_equal(np.concatenate([ep.state for ep in ds]), given["state"])
    frames = np.concatenate([ep.images["front"] for ep in ds])
    assert frames.shape == given["images"].shape  # AV1 is lossy: same frames, not the same bytes
