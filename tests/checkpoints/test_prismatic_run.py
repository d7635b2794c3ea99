"""Prismatic run directories: upstream layout round trip, checkpoint choice, and errors that name what is missing."""

import json

import pytest
import torch

from vla_runtime.checkpoints.prismatic_run import PrismaticRun, find_checkpoint, is_run_dir, save_run
from vla_runtime.models.cogact.configuration_cogact import DiTConfig
from vla_runtime.models.cogact.modeling_cogact import ActionModel

class Payload:
    """Any non-tensor class: weights_only loading must refuse to construct it."""


STATS = {"bridge_orig": {"action": {"q01": [0.0] * 7, "q99": [1.0] * 7, "mask": [True] * 6 + [False]}}}


@pytest.fixture
def run(tmp_path):
    torch.manual_seed(0)
    model = ActionModel(DiTConfig.from_name("tiny"))
    modules = {"projector": {"0.weight": torch.randn(4, 3)}, "action_model": model.state_dict()}
    config = {"vla": {"base_vlm": "prism-dinosiglip-224px+7b"}, "action_model_type": "DiT-B", "future_action_window_size": 15}
    ckpt = save_run(tmp_path / "run", config=config, norm_stats=STATS, modules=modules, step=1234, epoch=2, loss=0.25)
    return tmp_path / "run", ckpt, modules


def test_round_trip_in_the_upstream_layout(run):
    path, ckpt, modules = run
    assert ckpt.relative_to(path).as_posix() == "checkpoints/step-001234-epoch-02-loss=0.2500.pt"
    assert is_run_dir(path)
    opened = PrismaticRun.open(path)
    assert opened.checkpoint == ckpt and opened.norm_stats == STATS
    assert opened.config["vla"]["base_vlm"] == "prism-dinosiglip-224px+7b"
    loaded = opened.modules()
    assert sorted(loaded) == ["action_model", "projector"]
    for key, value in modules["action_model"].items():
        assert torch.equal(loaded["action_model"][key], value)
    raw = torch.load(ckpt, weights_only=True)  # plain {"model": {module: state_dict}} as upstream saves it
    assert sorted(raw) == ["model"]


def test_latest_step_wins_and_explicit_choice(run):
    path, ckpt, modules = run
    later = save_run(path, config={}, norm_stats=STATS, modules=modules, step=2000)
    assert find_checkpoint(path) == later
    assert PrismaticRun.open(path, checkpoint=ckpt.name).checkpoint == ckpt
    (path / "checkpoints" / "latest-checkpoint.pt").write_bytes(later.read_bytes())
    assert find_checkpoint(path) == later  # the only one with the largest step number
    later.unlink()
    (path / "checkpoints" / "step-001234-copy.pt").write_bytes(ckpt.read_bytes())
    with pytest.raises(ValueError, match="several checkpoints"):
        find_checkpoint(path)


@pytest.mark.parametrize("missing", ["config.json", "dataset_statistics.json"])
def test_missing_file_is_named(run, missing):
    path, _, _ = run
    (path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        PrismaticRun.open(path)


def test_missing_checkpoint_and_module_are_named(run, tmp_path):
    path, ckpt, _ = run
    opened = PrismaticRun.open(path)
    with pytest.raises(KeyError, match=r"lacks module\(s\) \['vision_backbone', 'llm_backbone'\].*never downloads"):
        opened.require(opened.modules(), ("vision_backbone", "llm_backbone", "projector"), why="this runtime never downloads")
    with pytest.raises(FileNotFoundError, match="nope.pt does not exist"):
        PrismaticRun.open(path, checkpoint="nope.pt")
    ckpt.unlink()
    with pytest.raises(FileNotFoundError, match=r"checkpoints/\*\.pt does not exist"):
        PrismaticRun.open(path)


def test_pickles_and_wrong_layouts_are_refused(run):
    path, ckpt, _ = run
    torch.save({"model": {"projector": {"w": torch.ones(1)}}, "extra": Payload()}, ckpt)
    with pytest.raises(ValueError, match="weights_only=True refuses arbitrary pickles"):
        PrismaticRun.open(path).modules()
    torch.save({"state_dict": {}}, ckpt)
    with pytest.raises(KeyError, match="no top-level 'model' entry"):
        PrismaticRun.open(path).modules()
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        PrismaticRun.open(path)
    (path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="must hold a JSON object"):
        PrismaticRun.open(path)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: b[: len(b) // 2], "cannot read .* as a torch checkpoint \\(truncated or corrupt\\?\\)"),
        (lambda b: b[:100], "cannot read .* as a torch checkpoint"),
        (lambda b: b"hello world" * 10, "cannot read .* as a torch checkpoint"),
        (lambda b: b"", "cannot read .* as a torch checkpoint"),
    ],
)
def test_a_truncated_or_corrupt_pt_is_a_value_error_naming_it(run, damage, match):
    path, ckpt, _ = run
    ckpt.write_bytes(damage(ckpt.read_bytes()))
    with pytest.raises(ValueError, match=match) as error:
        PrismaticRun.open(path).modules()
    assert str(ckpt) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "model, match",
    [
        (torch.zeros(3), r"`model` is a Tensor; expected \{module_name: state_dict\}"),
        ({"projector": torch.zeros(3)}, r"module 'projector' is not a state dict of tensors \(got Tensor\)"),
        ({"projector": {"0.weight": [1.0, 2.0]}}, r"module 'projector' is not a state dict of tensors \(got dict\)"),
    ],
)
def test_modules_must_be_state_dicts_of_tensors(run, model, match):
    path, ckpt, _ = run
    torch.save({"model": model}, ckpt)
    with pytest.raises(ValueError, match=match) as error:
        PrismaticRun.open(path).modules()
    assert str(ckpt) in str(error.value)
