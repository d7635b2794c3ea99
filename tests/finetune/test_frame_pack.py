"""A dataset carried as its meta and decoded frames (``vla_finetune.frame_pack``) trains where its data files are
absent: the unpacked cache sits under the name the unpacked dataset hashes to and holds the same arrays."""

import numpy as np
import pytest
from vla_finetune.frame_pack import main, pack, unpack
from vla_finetune.frames import cache_key, cached_dataset
from vla_finetune.trainer import Trainer

from vla_runtime.data import LeRobotDataset

from .conftest import make_config, write_dataset


def test_an_unpacked_dataset_trains_from_its_frames_without_its_data_files(tiny_ckpt, tmp_path):
    dataset = write_dataset(tmp_path / "data-28", size=28, lengths=(6, 7, 5))
    original = cached_dataset(LeRobotDataset(dataset), "front", tmp_path / "original-cache", build=True)
    meta, frames = pack(dataset, tmp_path / "packed", camera="front", preset=1)
    assert meta.is_file() and frames.is_file()

    data, caches = unpack(tmp_path / "packed", tmp_path / "elsewhere", camera="front")
    assert not (data / "data").exists()  # only meta/ travels: the data files' PNGs are what the pack leaves behind
    unpacked = cached_dataset(LeRobotDataset(data), "front", caches, build=False)  # raises if misplaced
    assert np.array_equal(unpacked.frames, original.frames) and np.array_equal(unpacked.actions, original.actions)
    assert np.array_equal(unpacked.states, original.states)
    assert (unpacked.lengths, unpacked.tasks) == (original.lengths, original.tasks)
    assert unpack(tmp_path / "packed", tmp_path / "elsewhere", camera="front") == (data, caches)  # idempotent
    assert len(list(caches.iterdir())) == 1

    out = tmp_path / "run"
    trainer = Trainer(make_config(tiny_ckpt, data, out, max_steps=1, data={"camera": "front", "cache_dir": caches}))
    trainer.train()
    assert (out / "adapter_model.safetensors").is_file() and '"step": 1' in (out / "train_log.jsonl").read_text()


def test_the_command_line_packs_and_unpacks(tmp_path, capsys):
    dataset = write_dataset(tmp_path / "ds", size=16, lengths=(3, 4))
    main(["pack", str(dataset), str(tmp_path / "p"), "--camera", "front"])
    assert "cache.tar.xz" in capsys.readouterr().out
    main(["unpack", str(tmp_path / "p"), str(tmp_path / "w"), "--camera", "front"])
    work = tmp_path / "w"
    assert f"--dataset {work / 'data'} --cache-dir {work / 'frame-cache'}" in capsys.readouterr().out


def test_another_pack_is_not_unpacked_over_a_work_directory(tmp_path):
    for name, lengths in (("a", (3, 4)), ("b", (5,))):
        pack(write_dataset(tmp_path / name, size=16, lengths=lengths), tmp_path / f"p{name}", camera="front", preset=1)
    unpack(tmp_path / "pa", tmp_path / "w", camera="front")
    with pytest.raises(ValueError, match="already holds another dataset .*unpack into a new work directory"):
        unpack(tmp_path / "pb", tmp_path / "w", camera="front")


def test_a_pack_of_the_same_shape_is_not_taken_for_the_one_unpacked(tmp_path):
    """Two datasets of equal episode counts and features have equal info.json: the whole meta is compared."""
    pack(write_dataset(tmp_path / "a", size=16, lengths=(3, 4)), tmp_path / "pa", camera="front", preset=1)
    pack(write_dataset(tmp_path / "b", size=16, lengths=(3, 4), gripper_max=0.5), tmp_path / "pb", camera="front", preset=1)
    unpack(tmp_path / "pa", tmp_path / "w")
    with pytest.raises(ValueError, match="already holds another dataset"):
        unpack(tmp_path / "pb", tmp_path / "w")


def test_an_unpack_killed_while_extracting_leaves_nothing_a_rerun_trusts(tmp_path, monkeypatch):
    import tarfile

    pack(write_dataset(tmp_path / "a", size=16, lengths=(3, 4)), tmp_path / "p", camera="front", preset=1)
    extract = tarfile.TarFile.extractall

    def killed(self, path, *args, **kwargs):  # everything extracted, then the kill, before anything is renamed
        extract(self, path, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(tarfile.TarFile, "extractall", killed)
    with pytest.raises(KeyboardInterrupt):
        unpack(tmp_path / "p", tmp_path / "w")
    assert not (tmp_path / "w" / "data" / "meta").exists()
    monkeypatch.undo()
    data, caches = unpack(tmp_path / "p", tmp_path / "w")
    assert len(LeRobotDataset(data)) == 2 and len(cached_dataset(LeRobotDataset(data), "front", caches, build=False).lengths) == 2


def test_the_camera_unpacked_is_the_one_packed(tmp_path):
    pack(write_dataset(tmp_path / "a", size=16, lengths=(3, 4)), tmp_path / "p", camera="front", preset=1)
    with pytest.raises(ValueError, match="holds camera 'front' frames, not 'corner'; pack that camera"):
        unpack(tmp_path / "p", tmp_path / "w", camera="corner")
    data, caches = unpack(tmp_path / "p", tmp_path / "w")  # the pack's camera
    (cache,) = caches.iterdir()
    cache.rename(caches / f"{data.name}-corner-{cache_key(data, 'corner')}")  # filed under another camera's name
    with pytest.raises(ValueError, match="holds camera 'front' frames, not 'corner'"):
        cached_dataset(LeRobotDataset(data), "corner", caches, build=False)
