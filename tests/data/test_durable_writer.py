"""The dataset writer keeps every finished episode durable and resumes what a kill left behind."""

import numpy as np
import pytest

from vla_runtime.data import DatasetFeatures, Episode, LeRobotDataset, LeRobotWriter, WriterConfig

FEATURES = DatasetFeatures(cameras={"front": (16, 16)}, state_names=list("ab"), action_names=list("xyz"))


def episode(seed, n, task):
    rng = np.random.default_rng(seed)
    return Episode(
        images={"front": rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)},
        state=rng.normal(size=(n, 2)).astype(np.float32),
        action=rng.normal(size=(n, 3)).astype(np.float32),
        task=task,
    )


EPISODES = [episode(0, 3, "open"), episode(1, 4, "close"), episode(2, 2, "open"), episode(3, 5, "push")]


def files(root):
    """relative path -> bytes of every file of a dataset."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("codec", [None, "hevc_lossless"])
def test_each_finished_episode_is_readable_before_close(tmp_path, codec):
    root = tmp_path / "ds"
    writer = LeRobotWriter(root, FEATURES, WriterConfig(fps=10, video_codec=codec))
    for i, ep in enumerate(EPISODES[:2]):
        writer.add_episode(ep, per_episode={"episode_seeds": i})
        ds = LeRobotDataset(root)  # no close(): what a kill right now would leave
        assert len(ds) == i + 1 and ds.extra["per_episode"]["episode_seeds"] == list(range(i + 1))
        np.testing.assert_array_equal(ds.episode(i).images["front"], ep.images["front"])
        np.testing.assert_array_equal(ds.episode(i).action, ep.action)
    assert not list(root.rglob("*.tmp"))
    data = sorted(p.name for p in (root / "data/chunk-000").iterdir())
    assert data == ["file-000.parquet", "file-001.parquet"]  # one file per episode: a finished one is never rewritten


@pytest.mark.parametrize("codec", [None, "hevc_lossless"])
def test_resume_after_a_kill_between_files_and_commit_equals_an_uninterrupted_run(tmp_path, codec):
    config = WriterConfig(fps=10, video_codec=codec, extra_info={"sim": "test"})
    whole = tmp_path / "whole"
    with LeRobotWriter(whole, FEATURES, config) as writer:
        for i, ep in enumerate(EPISODES):
            writer.add_episode(ep, per_episode={"episode_seeds": i})

    # the state a kill leaves while episode 2 is being committed: episode 2's data
    # and video files complete, meta/episodes and tasks already rewritten, info.json still the one of 2 episodes,
    # plus a half-written temporary
    cut = tmp_path / "cut"
    with LeRobotWriter(cut, FEATURES, config) as writer:
        for i, ep in enumerate(EPISODES[:2]):
            writer.add_episode(ep, per_episode={"episode_seeds": i})
        committed_info = (cut / "meta/info.json").read_bytes()
        writer.add_episode(EPISODES[2], per_episode={"episode_seeds": 2})
    (cut / "meta/info.json").write_bytes(committed_info)
    (cut / "data/chunk-000/file-003.parquet.tmp").write_bytes(b"PAR1 half")
    ds = LeRobotDataset(cut)
    assert len(ds) == 2  # info.json commits: the uncommitted row and files are not part of the dataset
    np.testing.assert_array_equal(ds.episode(1).state, EPISODES[1].state)

    with LeRobotWriter(cut, FEATURES, config, resume=True) as writer:
        assert writer.num_episodes == 2 and writer.per_episode == {"episode_seeds": [0, 1]}
        for i, ep in enumerate(EPISODES[2:], 2):
            writer.add_episode(ep, per_episode={"episode_seeds": i})
    assert files(cut) == files(whole)  # every byte: data, videos, tasks, episodes, stats, info


def test_resume_of_a_dataset_killed_before_its_first_episode(tmp_path):
    root = tmp_path / "ds"
    (root / "data/chunk-000").mkdir(parents=True)
    (root / "data/chunk-000/file-000.parquet.tmp").write_bytes(b"partial")
    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10), resume=True) as writer:
        assert writer.num_episodes == 0
        writer.add_episode(EPISODES[0])
    assert len(LeRobotDataset(root)) == 1 and not list(root.rglob("*.tmp"))


def test_a_started_dataset_needs_resume_and_matching_flags(tmp_path):
    root = tmp_path / "ds"
    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10)) as writer:
        writer.add_episode(EPISODES[0])
    with pytest.raises(FileExistsError, match="exists and is not empty; pass --resume to continue it"):
        LeRobotWriter(root, FEATURES, WriterConfig(fps=10))
    with pytest.raises(ValueError, match="cannot resume .*'fps' is 10, this run would write 20"):
        LeRobotWriter(root, FEATURES, WriterConfig(fps=20), resume=True)
    with pytest.raises(ValueError, match="cannot resume .*'features'"):
        LeRobotWriter(root, FEATURES, WriterConfig(fps=10, video_codec="h264"), resume=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds notes.txt, which the dataset writer did not create"):
        LeRobotWriter(other, FEATURES, WriterConfig(fps=10), resume=True)
    assert (other / "notes.txt").read_text() == "mine"


def test_a_data_file_without_its_footer_is_a_clear_error(tmp_path):
    root = tmp_path / "ds"
    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10)) as writer:
        writer.add_episode(EPISODES[0])
    data = root / "data/chunk-000/file-000.parquet"
    data.write_bytes(data.read_bytes()[:-100])  # cut off the footer
    with pytest.raises(ValueError, match=f"data file {data} of episode 0 is not a readable parquet file: .*magic bytes"):
        LeRobotDataset(root).episode(0)


def write_first_two(root) -> None:
    """EPISODES[0] and [1] (seeds 0 and 1), closed: what an uninterrupted two-episode run leaves."""
    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10)) as writer:
        for i in (0, 1):
            writer.add_episode(EPISODES[i], per_episode={"episode_seeds": i})


def test_a_failed_write_leaves_the_writer_as_it_was(tmp_path, monkeypatch):
    """An episode whose data file could not be written counts nowhere: not in the tasks, not in the statistics,
    and a later resume keeps every stored frame's task."""
    import vla_runtime.data.writer as writer_module

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    write_first_two(whole)
    real = writer_module._write_parquet

    def disk_full(table, path):
        raise OSError("No space left on device")

    with LeRobotWriter(broken, FEATURES, WriterConfig(fps=10)) as writer:
        writer.add_episode(EPISODES[0], per_episode={"episode_seeds": 0})
        monkeypatch.setattr(writer_module, "_write_parquet", disk_full)
        with pytest.raises(OSError, match="No space left"):
            writer.add_episode(EPISODES[3], per_episode={"episode_seeds": 3})  # task "push": never stored
        monkeypatch.setattr(writer_module, "_write_parquet", real)
        writer.add_episode(EPISODES[1], per_episode={"episode_seeds": 1})
    assert files(broken) == files(whole)  # tasks, stats, episode rows: as if the failed episode never came

    with LeRobotWriter(broken, FEATURES, WriterConfig(fps=10), resume=True) as writer:
        writer.add_episode(EPISODES[3], per_episode={"episode_seeds": 3})
    ds = LeRobotDataset(broken)
    assert [ds.episode(i).task for i in range(3)] == ["open", "close", "push"]


def test_resume_rewrites_metadata_a_kill_left_ahead_of_the_commit(tmp_path, monkeypatch, caplog):
    """A kill after stats/tasks/episodes were rewritten but before info.json: the reader ignores the stale
    statistics (with a warning), and a resume that adds nothing rewrites them for the committed episodes."""
    import json

    from vla_runtime.data import durable

    root, two = tmp_path / "ds", tmp_path / "two"
    write_first_two(two)
    real = durable.write_text_atomic

    def killed_at_info(path, text):
        if path.name == "info.json":
            raise KeyboardInterrupt  # the kill: nothing after this line of add_episode runs
        real(path, text)

    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10)) as writer:
        for i in (0, 1):
            writer.add_episode(EPISODES[i], per_episode={"episode_seeds": i})
        monkeypatch.setattr(durable, "write_text_atomic", killed_at_info)
        with pytest.raises(KeyboardInterrupt):
            writer.add_episode(EPISODES[3], per_episode={"episode_seeds": 3})
    monkeypatch.setattr(durable, "write_text_atomic", real)
    assert json.loads((root / "meta/stats.json").read_text())["action"]["count"] == [12]  # ahead of the commit
    with caplog.at_level("WARNING"):
        ds = LeRobotDataset(root)
    assert len(ds) == 2 and ds.stats is None and "counts [12] frames, info.json 7" in caplog.text

    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10), resume=True):
        pass  # a resume that adds nothing (every task already complete)
    assert files(root) == files(two)
    assert LeRobotDataset(root).stats["action"]["count"].tolist() == [7]


def test_every_episode_carries_the_same_per_episode_keys_and_resume_keeps_the_extra_info(tmp_path):
    root = tmp_path / "ds"
    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10, extra_info={"sim": "test"})) as writer:
        writer.add_episode(EPISODES[0], per_episode={"episode_seeds": 0})
        with pytest.raises(ValueError, match=r"per_episode keys \['episode_detours', 'episode_seeds'\] differ .*"
                                             r"\['episode_seeds'\]"):  # fmt: skip
            writer.add_episode(EPISODES[1], per_episode={"episode_seeds": 1, "episode_detours": [2, 3]})
        assert writer.num_episodes == 1
    with pytest.raises(ValueError, match=r"records detours=None, sim='test', this run would record detours=0.5, "
                                         r"sim='other' \(resume with the flags"):  # fmt: skip
        LeRobotWriter(root, FEATURES, WriterConfig(fps=10, extra_info={"sim": "other", "detours": 0.5}), resume=True)
    with LeRobotWriter(root, FEATURES, WriterConfig(fps=10, extra_info={"sim": "test"}), resume=True) as writer:
        assert writer.per_episode == {"episode_seeds": [0]}
