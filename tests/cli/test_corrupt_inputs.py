"""Corrupt files and empty inputs: one clear line naming the file (or the input) and what is wrong, no traceback."""

import json
import shutil

import pytest

from vla_runtime import models  # noqa: F401  (registers the families load_policy detects)
from vla_runtime.api import load_policy
from vla_runtime.cli import main


def predict(ckpt, png, instruction="push the button"):
    return main(["predict", "--checkpoint", str(ckpt), "--image", str(png), "--instruction", instruction])


def one_line_error(capsys, command):
    err = capsys.readouterr().err
    assert err.startswith(f"vla-runtime {command}: error:") and "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_safetensors(ckpt, png, tmp_path, cut, capsys):
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:5] if cut == "header" else data[: len(data) // 2])
    assert predict(bad, png) == 2
    err = one_line_error(capsys, "predict")
    assert str(weights) in err and "not a readable safetensors file" in err and "truncated or corrupt" in err


def test_shard_index_naming_a_missing_file(ckpt, png, tmp_path, capsys):
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    (bad / "model.safetensors").rename(bad / "model-00001-of-00002.safetensors")
    (bad / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}}))
    assert predict(bad, png) == 2
    err = one_line_error(capsys, "predict")
    assert "shard model-00002-of-00002.safetensors listed in" in err and "does not exist" in err


def test_malformed_yaml_config_names_line_and_column(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  window: [4, 8\n  stride: 2\n")
    assert main(["finetune", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = one_line_error(capsys, "finetune")
    assert f"config file {config} is not valid YAML at line 3, column 9" in err
    config.write_text("- just\n- a list\n")
    assert main(["finetune", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    assert "must hold a mapping of field names to values, got list" in one_line_error(capsys, "finetune")


@pytest.mark.parametrize("instruction", ["", "   \t"])
def test_empty_instruction_is_an_error(ckpt, png, instruction, capsys):
    assert predict(ckpt, png, instruction) == 2
    assert "instruction must be a non-empty task description" in one_line_error(capsys, "predict")
    policy = load_policy(ckpt)
    with pytest.raises(ValueError, match="instruction must be a non-empty task description, got"):
        policy.new_session(instruction)


@pytest.mark.parametrize("heads, message", [
    (None, "is 32 wide (timm's vit_large_patch14_reg4_dinov2.lvd142m is 1024 wide with 16 heads), so its head count is "
           "unknown; set config.json `vision_num_heads`"),
    ([2.5, 2], "config.json `vision_num_heads` is list [2.5, 2]; expected a list of integers"),
    ([0, 2], "`vision_num_heads` has 0; expected a positive integer per tower"),
    ([3, 2], "embed_dim 32 is not divisible by num_heads 3"),
])
def test_vision_head_counts_are_never_guessed(ckpt, png, tmp_path, heads, message, capsys):
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    config = json.loads((bad / "config.json").read_text())
    assert config.pop("vision_num_heads")  # the tiny towers' head counts live in this extra key
    if heads is not None:
        config["vision_num_heads"] = heads
    (bad / "config.json").write_text(json.dumps(config))
    assert predict(bad, png) == 2
    assert message in one_line_error(capsys, "predict")
