"""Bad input fails before training starts, naming what is wrong and what was expected."""

import pytest

from vla_finetune.config import FinetuneConfig
from vla_finetune.trainer import Trainer
from vla_runtime.config import from_dict
from vla_runtime.kv import KVMode

from .conftest import make_config, write_dataset


def trainer(ckpt, dataset, tmp_path, **overrides):
    return Trainer(make_config(ckpt, dataset, tmp_path / "out", **overrides))


def test_dataset_without_the_state_the_proprio_projector_needs(tiny_ckpt, tmp_path):
    dataset = write_dataset(tmp_path / "no-state", lengths=(5, 5), state_dim=None)
    with pytest.raises(ValueError, match=r"proprio projector \(4-D input\) but dataset .* has no 'observation.state'"):
        trainer(tiny_ckpt, dataset, tmp_path)


def test_state_of_the_wrong_size(tiny_ckpt, tmp_path):
    dataset = write_dataset(tmp_path / "state6", lengths=(5, 5), state_dim=6)
    with pytest.raises(ValueError, match=r"'observation.state' is 6-D; the policy's proprio projector takes 4-D"):
        trainer(tiny_ckpt, dataset, tmp_path)


def test_action_dimension_that_does_not_match_the_model(tiny_ckpt, tmp_path):
    dataset = write_dataset(tmp_path / "act4", lengths=(5, 5), action_dim=4)
    with pytest.raises(ValueError, match=r"has 4-D actions .*policy predicts 7-D actions"):
        trainer(tiny_ckpt, dataset, tmp_path)


def test_window_longer_than_every_episode(tiny_ckpt, tiny_dataset, tmp_path):
    with pytest.raises(
        ValueError, match=r"history window \(12 steps\) is longer than every episode \(longest: 10 steps\)"
    ):
        trainer(tiny_ckpt, tiny_dataset, tmp_path, data={"window": 12})


def test_shorter_episodes_are_reported_not_dropped_silently(tiny_ckpt, tiny_dataset, tmp_path, caplog):
    t = trainer(tiny_ckpt, tiny_dataset, tmp_path, data={"window": 10})
    assert {w.episode for w in t.data.windows} == {0, 1, 3}
    assert "1 of 4 episodes are shorter than the 10-step window" in caplog.text


def test_unknown_lora_target_lists_the_linear_layers(tiny_ckpt, tiny_dataset, tmp_path):
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] match no linear layer.*lm_head \(x1\).*q_proj \(x2\)"):
        trainer(tiny_ckpt, tiny_dataset, tmp_path, lora={"target_modules": ["q_proj", "qkv_proj"]})
    with pytest.raises(KeyError, match="unknown LoRA target shorthand 'all-linears'"):
        trainer(tiny_ckpt, tiny_dataset, tmp_path, lora={"target_modules": "all-linears"})


def test_unknown_camera_and_missing_dataset(tiny_ckpt, tiny_dataset, tmp_path):
    with pytest.raises(ValueError, match="camera 'wrist' is not in dataset .*its cameras: front"):
        trainer(tiny_ckpt, tiny_dataset, tmp_path, data={"camera": "wrist"})
    with pytest.raises(FileNotFoundError, match="info.json does not exist"):
        trainer(tiny_ckpt, tmp_path / "nowhere", tmp_path)


def test_unnormalised_gripper_outside_the_token_range(tiny_ckpt, tmp_path):
    dataset = write_dataset(tmp_path / "gripper2", lengths=(5, 5), gripper_max=2.0)
    with pytest.raises(ValueError, match=r"action dimension 6 \(gripper\) is not normalised .* spans \[0, 2\]"):
        trainer(tiny_ckpt, dataset, tmp_path)
    t = trainer(tiny_ckpt, dataset, tmp_path / "b", data={"action_mask": [True] * 7})  # normalising it is fine
    assert t.data.statistics["gripper2"]["action"]["q99"][6] == 2.0
    with pytest.raises(ValueError, match="action_mask` has 6 entries; the dataset's actions have 7"):
        trainer(tiny_ckpt, dataset, tmp_path / "c", data={"action_mask": [True] * 6})


def test_config_validation_names_the_field():
    base = {"checkpoint": "c", "dataset": "d", "out": "o"}
    with pytest.raises(ValueError, match="trainable: gates` needs history mode with kv.mode 'chunked'"):
        from_dict(FinetuneConfig, {**base, "trainable": "gates", "kv": {"mode": "full"}})
    with pytest.raises(ValueError, match="`kv.mode` is 'sink_window'; training supports full, chunked"):
        from_dict(FinetuneConfig, {**base, "kv": {"mode": "sink_window"}})
    with pytest.raises(ValueError, match="`batch_size` must be > 0, got 0"):
        from_dict(FinetuneConfig, {**base, "batch_size": 0})
    with pytest.raises(ValueError, match="`merge` merges LoRA"):
        from_dict(FinetuneConfig, {**base, "trainable": "all", "merge": True})
    # a stride past the window (the default 4 with --window 3) would leave steps untrained: windows start every window
    assert from_dict(FinetuneConfig, {**base, "data": {"window": 3, "stride": 5}}).data.stride == 3
    assert from_dict(FinetuneConfig, {**base, "data": {"window": 0, "stride": 5}}).data.stride == 5  # whole episodes
    assert from_dict(FinetuneConfig, {**base, "history": "single", "kv": {"mode": "full"},
                                      "data": {"window": 1, "stride": 5}}).data.stride == 5  # single mode: no windows
    with pytest.raises(ValueError, match=r"unknown GateTraining field\(s\) \['temp'\]"):
        from_dict(FinetuneConfig, {**base, "gate": {"temp": 1}})
    # a nested mapping overrides the default instance: kv stays chunked when only the chunk is set
    assert from_dict(FinetuneConfig, {**base, "kv": {"chunk": 8}}).kv.mode is KVMode.CHUNKED


def test_a_save_dtype_that_applies_to_nothing_is_said(caplog):
    base = {"checkpoint": "c", "dataset": "d", "out": "o", "save_dtype": "bfloat16"}
    with caplog.at_level("WARNING"):
        from_dict(FinetuneConfig, {**base, "merge": True})
        from_dict(FinetuneConfig, {**base, "trainable": "all"})
    assert not caplog.records
    with caplog.at_level("WARNING"):
        from_dict(FinetuneConfig, base)  # a LoRA run without merge writes no full checkpoint
    assert "`save_dtype` bfloat16 sets the dtype of full checkpoints" in caplog.text
