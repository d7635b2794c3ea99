"""A broken action head is refused when the checkpoint is opened (``info`` included, ``device="meta"``), with a
ValueError naming the file: a CogACT/HybridVLA module with a missing, extra or wrongly shaped tensor, and a
weight of an integer dtype in those modules, in the VLM of a run or in an OFT component (never cast)."""

import shutil

import pytest
import torch

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.prismatic_run import find_checkpoint
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact, make_tiny_hybridvla


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {"cogact": make_tiny_cogact(root / "cogact", seed=0), "hybridvla": make_tiny_hybridvla(root / "hybridvla", seed=1)}


def broken(runs, tmp_path, family, edit):
    """A copy of the family's tiny run with ``edit`` applied to its ``{module: state_dict}``; returns (run, .pt)."""
    path = shutil.copytree(runs[family], tmp_path / family)
    pt = find_checkpoint(path)
    blob = torch.load(pt, weights_only=True)
    edit(blob["model"])
    torch.save(blob, pt)
    return path, pt


def widen(state, key):
    state[key] = torch.zeros(state[key].shape[0], state[key].shape[1] + 1)


@pytest.mark.parametrize(
    "family, edit, match",
    [
        ("cogact", lambda m: widen(m["action_model"], "net.t_embedder.mlp.2.weight"),
         r"module 'action_model': `net.t_embedder.mlp.2.weight` has shape \[32, 33\]; expected \[32, 32\]"),
        ("cogact", lambda m: m["action_model"].pop("net.final_layer.linear.bias"),
         r"module 'action_model' does not match the model: missing \['net.final_layer.linear.bias'\], unexpected none"),
        ("cogact", lambda m: m["action_model"].__setitem__("zzz", torch.zeros(2)),
         r"module 'action_model' does not match the model: missing none, unexpected \['zzz'\]"),
        ("cogact", lambda m: m["action_model"].__setitem__("net.final_layer.linear.bias", torch.zeros(7, dtype=torch.int64)),
         r"module 'action_model': `net.final_layer.linear.bias` is torch.int64; expected a floating-point weight"),
        ("hybridvla", lambda m: m["x_embedder"].pop("mlp.fc1.weight"),
         r"module 'x_embedder' does not match the model: missing \['mlp.fc1.weight'\]"),
        ("hybridvla", lambda m: widen(m["final_layer"], "mlp.fc2.weight"),
         r"module 'final_layer': `mlp.fc2.weight` has shape"),
        ("hybridvla", lambda m: m["t_embedder"].__setitem__("extra.weight", torch.zeros(2)),
         r"module 't_embedder' does not match the model: missing none, unexpected \['extra.weight'\]"),
    ],
)
def test_a_broken_head_is_refused_at_load(runs, tmp_path, family, edit, match):
    path, pt = broken(runs, tmp_path, family, edit)
    with pytest.raises(ValueError, match=rf"^{pt} {match}"):
        load_policy(path, device="meta")


def test_an_integer_vlm_weight_is_refused(runs, tmp_path):
    name = "layers.0.mlp.down_proj.weight"

    def to_int(modules):
        key = next(k for k in modules["llm_backbone"] if k.endswith(name))
        modules["llm_backbone"][key] = modules["llm_backbone"][key].to(torch.int8)

    path, pt = broken(runs, tmp_path, "cogact", to_int)
    with pytest.raises(ValueError, match=rf"^{pt}: VLM tensor `language_model.model.{name}` is torch.int8; expected a floating-point weight"):
        load_policy(path, device="meta")


def test_an_integer_oft_component_weight_is_refused(tmp_path):
    path = make_tiny_openvla_oft(tmp_path / "oft", seed=0)
    head = next(path.glob("action_head--*_checkpoint.pt"))
    state = torch.load(head, weights_only=True)
    key = next(iter(state))
    state[key] = state[key].to(torch.int32)
    torch.save(state, head)
    with pytest.raises(ValueError, match=rf"^{head.name}: `{key}` is torch.int32; expected a floating-point weight"):
        load_policy(path, device="meta")
