"""LeRobot v3 writer/reader: exact round trips, valid metadata, v2.1 reading, clear errors."""

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vla_runtime.data import DatasetFeatures, Episode, LeRobotDataset, LeRobotWriter, WriterConfig
from vla_runtime.data.video import VIDEO_CODECS, VideoWriter

FEATURES = DatasetFeatures(cameras={"front": (24, 32), "wrist": (16, 16)}, state_names=list("abcd"), action_names=list("1234567"))


def make_episode(rng, n, task):
    def frames(h, w):
        y, x = np.mgrid[0:h, 0:w]
        smooth = np.stack([(x * 7 + t * 5) % 256 + 0 * y for t in range(n)])
        noise = rng.integers(0, 256, size=(n, h, w, 3))
        return np.where(noise[..., :1] > 128, noise, smooth[..., None]).astype(np.uint8)

    return Episode(
        images={"front": frames(24, 32), "wrist": frames(16, 16)},
        state=rng.normal(size=(n, 4)).astype(np.float32),
        action=rng.normal(size=(n, 7)).astype(np.float32),
        task=task,
    )


@pytest.fixture
def episodes():
    rng = np.random.default_rng(0)
    return [make_episode(rng, 6, "open the drawer"), make_episode(rng, 9, "press the button"), make_episode(rng, 4, "open the drawer")]


def write(root, episodes, **kwargs):
    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10, robot_type="sawyer", **kwargs)) as writer:
        for ep in episodes:
            writer.add_episode(ep)
    return LeRobotDataset(root)


def assert_same(read, written):
    assert read.task == written.task
    np.testing.assert_array_equal(read.action, written.action)
    np.testing.assert_array_equal(read.state, written.state)
    assert set(read.images) == set(written.images)
    for cam in written.images:
        np.testing.assert_array_equal(read.images[cam], written.images[cam])


@pytest.mark.parametrize("codec", [None, "hevc_lossless"])
def test_round_trip_is_exact(tmp_path, episodes, codec):
    ds = write(tmp_path / "ds", episodes, video_codec=codec)
    assert len(ds) == 3 and ds.fps == 10 and ds.cameras == ["front", "wrist"]
    for i, ep in enumerate(episodes):
        assert_same(ds.episode(i), ep)


def test_metadata_follows_lerobot_v3_layout(tmp_path, episodes):
    root = tmp_path / "ds"
    write(root, episodes, video_codec="hevc_lossless")
    info = json.loads((root / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10 and info["robot_type"] == "sawyer"
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (3, 19, 2)
    assert info["splits"] == {"train": "0:3"}
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    feats = info["features"]
    assert feats["observation.state"] == {"dtype": "float32", "shape": [4], "names": list("abcd")}
    assert feats["action"]["shape"] == [7]
    front = feats["observation.images.front"]
    assert front["dtype"] == "video" and front["shape"] == [24, 32, 3] and front["info"]["video.fps"] == 10
    for key in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        assert feats[key]["shape"] == [1]

    tasks = pd.read_parquet(root / "meta/tasks.parquet")
    assert list(tasks.index) == ["open the drawer", "press the button"] and list(tasks.task_index) == [0, 1]

    eps = pd.read_parquet(root / "meta/episodes/chunk-000/file-000.parquet")
    assert list(eps.episode_index) == [0, 1, 2] and list(eps.length) == [6, 9, 4]
    assert list(eps.dataset_from_index) == [0, 6, 15] and list(eps.dataset_to_index) == [6, 15, 19]
    assert [list(t) for t in eps.tasks] == [["open the drawer"], ["press the button"], ["open the drawer"]]
    # each episode has its own data parquet and mp4 per camera (written once, durable before the next episode)
    assert list(eps["data/file_index"]) == [0, 1, 2] and list(eps["videos/observation.images.front/file_index"]) == [0, 1, 2]
    np.testing.assert_allclose(eps["videos/observation.images.front/from_timestamp"], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(eps["videos/observation.images.front/to_timestamp"], [0.6, 0.9, 0.4])
    assert list(eps["stats/action/count"].map(lambda c: c[0])) == [6, 9, 4]

    data = pa.concat_tables([pq.read_table(root / f"data/chunk-000/file-00{i}.parquet") for i in range(3)])
    assert data.schema.field("observation.state").type == pa.list_(pa.float32(), 4)
    np.testing.assert_array_equal(data.column("index").to_numpy(), np.arange(19))
    np.testing.assert_array_equal(data.column("task_index").to_numpy(), [0] * 6 + [1] * 9 + [0] * 4)
    frame_index = data.column("frame_index").to_numpy()
    np.testing.assert_array_equal(data.column("timestamp").to_numpy(), (frame_index / 10).astype(np.float32))
    hf = json.loads(data.schema.metadata[b"huggingface"])["info"]["features"]
    assert hf["action"] == {"feature": {"dtype": "float32", "_type": "Value"}, "length": 7, "_type": "List"}


def test_stats_are_exact_with_quantiles(tmp_path, episodes):
    ds = write(tmp_path / "ds", episodes)
    actions = np.concatenate([ep.action for ep in episodes]).astype(np.float64)
    s = ds.stats["action"]
    assert s["count"].tolist() == [19]
    for key, q in {"q01": 0.01, "q10": 0.1, "q50": 0.5, "q90": 0.9, "q99": 0.99}.items():
        np.testing.assert_allclose(s[key], np.quantile(actions, q, axis=0))
    np.testing.assert_allclose(s["mean"], actions.mean(0))
    np.testing.assert_allclose(s["std"], actions.std(0))
    np.testing.assert_allclose(s["min"], actions.min(0))
    assert np.all(s["q01"] <= s["q50"]) and np.all(s["q50"] <= s["q99"])
    img = ds.stats["observation.images.front"]
    pixels = np.concatenate([ep.images["front"] for ep in episodes]).reshape(-1, 3) / 255.0
    assert img["mean"].shape == (3, 1, 1) and img["count"].tolist() == [19]
    np.testing.assert_allclose(img["mean"].ravel(), pixels.mean(0))
    np.testing.assert_allclose(img["std"].ravel(), pixels.std(0))
    np.testing.assert_allclose(img["max"].ravel(), pixels.max(0))
    assert ds.stats["index"]["max"].tolist() == [18]


def test_reads_several_episodes_per_file(tmp_path):
    """LeRobot's own writer packs many episodes into one data parquet and one mp4: we read that layout too."""
    rng = np.random.default_rng(1)
    feats = DatasetFeatures(cameras={"cam": (16, 16)}, state_names=None, action_names=["a"])
    eps = [Episode({"cam": rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)}, None, rng.normal(size=(n, 1)).astype(np.float32), "t")
           for n in (3, 5)]
    root = tmp_path / "ds"
    with LeRobotWriter(root, feats, WriterConfig(fps=5, video_codec="hevc_lossless")) as writer:
        for ep in eps:
            writer.add_episode(ep)
    # merge into file-000 as LeRobot lays it out: rows back to back, frames back to back, time ranges in the index
    data = pa.concat_tables([pq.read_table(root / f"data/chunk-000/file-00{i}.parquet") for i in range(2)])
    pq.write_table(data, root / "data/chunk-000/file-000.parquet")
    (root / "data/chunk-000/file-001.parquet").unlink()
    video = VideoWriter(root / "merged.mp4", fps=5, height=16, width=16, codec=VIDEO_CODECS["hevc_lossless"])
    video.write(np.concatenate([ep.images["cam"] for ep in eps]))
    video.close()
    videos = root / "videos/observation.images.cam/chunk-000"
    (videos / "file-001.mp4").unlink()
    (root / "merged.mp4").replace(videos / "file-000.mp4")
    index = root / "meta/episodes/chunk-000/file-000.parquet"
    rows = pq.read_table(index).to_pylist()
    rows[1].update({"data/file_index": 0, "videos/observation.images.cam/file_index": 0,
                    "videos/observation.images.cam/from_timestamp": 0.6, "videos/observation.images.cam/to_timestamp": 1.6})
    pq.write_table(pa.Table.from_pylist(rows), index)
    ds = LeRobotDataset(root)
    assert ds.episode(1).state is None
    for i, ep in enumerate(eps):
        np.testing.assert_array_equal(ds.episode(i).images["cam"], ep.images["cam"])
        np.testing.assert_array_equal(ds.episode(i).action, ep.action)


def test_reads_lerobot_v21_layout(tmp_path, episodes):
    """A dataset laid out as LeRobot v2.1 writes it: jsonl metadata, one parquet and one mp4 per episode."""
    root = tmp_path / "v21"
    info = {
        "codebase_version": "v2.1", "robot_type": "sawyer", "fps": 10, "total_episodes": 3, "total_frames": 19,
        "total_tasks": 2, "total_videos": 3, "total_chunks": 1, "chunks_size": 1000, "splits": {"train": "0:3"},
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
        "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
        "features": {
            "observation.images.front": {"dtype": "video", "shape": [24, 32, 3], "names": ["height", "width", "channel"]},
            "observation.images.wrist": {"dtype": "image", "shape": [16, 16, 3], "names": ["height", "width", "channel"]},
            "observation.state": {"dtype": "float32", "shape": [4], "names": None},
            "action": {"dtype": "float32", "shape": [7], "names": None},
        },
    }
    (root / "meta").mkdir(parents=True)
    (root / "meta/info.json").write_text(json.dumps(info))
    (root / "meta/tasks.jsonl").write_text('{"task_index": 0, "task": "open the drawer"}\n{"task_index": 1, "task": "press the button"}\n')
    lines, start = [], 0
    for i, ep in enumerate(episodes):
        n = len(ep)
        lines.append(json.dumps({"episode_index": i, "tasks": [ep.task], "length": n}))
        import io

        from PIL import Image

        def png(f):
            buf = io.BytesIO()
            Image.fromarray(f).save(buf, format="PNG")
            return {"bytes": buf.getvalue(), "path": None}

        table = pa.table({
            "observation.images.wrist": [png(f) for f in ep.images["wrist"]],
            "observation.state": ep.state.tolist(),
            "action": ep.action.tolist(),
            "timestamp": (np.arange(n) / 10).astype(np.float32),
            "frame_index": np.arange(n),
            "episode_index": np.full(n, i),
            "index": np.arange(start, start + n),
            "task_index": np.full(n, 0 if ep.task == "open the drawer" else 1),
        })
        table = table.take(np.arange(n)[::-1].copy())  # rows stored out of order: the reader sorts by frame_index
        path = root / f"data/chunk-000/episode_{i:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        video = VideoWriter(root / f"videos/chunk-000/observation.images.front/episode_{i:06d}.mp4", fps=10, height=24, width=32,
                            codec=VIDEO_CODECS["hevc_lossless"])
        video.write(ep.images["front"])
        video.close()
        start += n
    (root / "meta/episodes.jsonl").write_text("\n".join(lines) + "\n")
    ds = LeRobotDataset(root)
    assert ds.stats is None and ds.tasks == ["open the drawer", "press the button"]
    for i, ep in enumerate(episodes):
        assert_same(ds.episode(i), ep)


def test_errors_name_the_problem(tmp_path, episodes):
    with pytest.raises(FileNotFoundError, match="meta/info.json does not exist"):
        LeRobotDataset(tmp_path / "nothing")
    root = tmp_path / "ds"
    write(root, episodes[:1])
    with pytest.raises(FileExistsError, match="exists and is not empty; pass --resume"):
        LeRobotWriter(root, FEATURES, WriterConfig(fps=10))
    info = json.loads((root / "meta/info.json").read_text())
    (root / "meta/info.json").write_text(json.dumps({**info, "codebase_version": "v1.6"}))
    with pytest.raises(ValueError, match="codebase_version 'v1.6' is not supported"):
        LeRobotDataset(root)

    writer = LeRobotWriter(tmp_path / "w", FEATURES, WriterConfig(fps=10))
    bad = make_episode(np.random.default_rng(0), 3, "t")
    with pytest.raises(ValueError, match=r"cameras \['front'\] differ from the dataset's \['front', 'wrist'\]"):
        writer.add_episode(Episode({"front": bad.images["front"]}, bad.state, bad.action, "t"))
    with pytest.raises(ValueError, match="must be uint8"):
        writer.add_episode(Episode({**bad.images, "front": bad.images["front"].astype(np.float32)}, bad.state, bad.action, "t"))
    with pytest.raises(ValueError, match=r"images\['wrist'\] has 2 frames, action has 3"):
        writer.add_episode(Episode({**bad.images, "wrist": bad.images["wrist"][:2]}, bad.state, bad.action, "t"))
    with pytest.raises(ValueError, match="action has 6 dims, action_names has 7"):
        writer.add_episode(Episode(bad.images, bad.state, bad.action[:, :6], "t"))
    with pytest.raises(ValueError, match="no episodes were written"):
        writer.close()
    with pytest.raises(ValueError, match="`fps` must be a positive integer"):
        WriterConfig(fps=12.5)
    with pytest.raises(KeyError, match="unknown video codec 'mjpeg'; available: av1, h264, hevc_lossless"):
        WriterConfig(fps=10, video_codec="mjpeg")


def test_a_one_dimensional_feature_stored_as_lerobot_stores_it_reads_as_one_column(tmp_path):
    """LeRobot writes a feature of shape (1,) as a plain number column, not a list of one."""
    root, n = tmp_path / "scalar", 5
    features = DatasetFeatures(cameras={}, state_names=["gripper"], action_names=["a0", "a1"])
    with LeRobotWriter(root, features, WriterConfig(fps=10)) as writer:
        writer.add_episode(Episode(images={}, state=np.arange(n, dtype=np.float32)[:, None],
                                   action=np.zeros((n, 2), np.float32), task="t"))  # fmt: skip
    data = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(data)
    i = table.schema.get_field_index("observation.state")
    pq.write_table(table.set_column(i, pa.field("observation.state", pa.float32()), pa.array(np.arange(n, dtype=np.float32))), data)
    np.testing.assert_array_equal(LeRobotDataset(root).episode(0).state, np.arange(n, dtype=np.float32)[:, None])
    table = pq.read_table(data)
    pq.write_table(table.set_column(i, pa.field("observation.state", pa.string()), pa.array(["x"] * n)), data)
    with pytest.raises(ValueError, match="feature 'observation.state' is stored as string; expected a list of numbers"):
        LeRobotDataset(root).episode(0)


@pytest.mark.parametrize("codec", ["h264", "av1"])
def test_a_yuv420p_codec_refuses_an_odd_frame_size_before_anything_is_written(tmp_path, codec):
    features = DatasetFeatures(cameras={"corner": (85, 64)}, state_names=None, action_names=["a0"])
    with pytest.raises(ValueError, match=f"video codec {codec} stores yuv420p, which needs an even height and width; camera"):
        LeRobotWriter(tmp_path / "odd", features, WriterConfig(fps=10, video_codec=codec))
    assert not (tmp_path / "odd").exists()
    assert LeRobotWriter(tmp_path / "lossless", features, WriterConfig(fps=10, video_codec="hevc_lossless")).num_episodes == 0
