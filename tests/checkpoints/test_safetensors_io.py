"""Safetensors checkpoints: the shard index must agree with the shards' headers (every ``weight_map`` entry a
tensor of its shard, every shard tensor in the map), else a ValueError naming the index and the tensor; a weight
stored in an integer dtype is refused (naming the file and the tensor), not cast."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.causal_lm import load_causal_lm
from vla_runtime.checkpoints.safetensors_io import INDEX_NAME, save_safetensors, weight_files
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM


@pytest.fixture
def sharded(tmp_path):
    """Two shards: a.weight, b.weight in the first; c.weight, d.weight in the second."""
    state = {f"{k}.weight": torch.full((4, 4), float(i)) for i, k in enumerate("abcd")}
    files = save_safetensors(state, tmp_path, max_shard_bytes=128)
    assert len(files) == 2
    return tmp_path


def edit_index(path, fn):
    index = path / INDEX_NAME
    data = json.loads(index.read_text())
    fn(data["weight_map"])
    index.write_text(json.dumps(data))
    return index


FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def test_a_consistent_index_lists_its_shards(sharded):
    assert [f.name for f in weight_files(sharded)] == [FIRST, SECOND]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.__setitem__("ghost.weight", FIRST), rf"maps tensor `ghost.weight` to {FIRST}, which does not hold it \(no listed shard holds it"),
        (lambda m: m.__setitem__("a.weight", SECOND), rf"maps tensor `a.weight` to {SECOND}, which does not hold it \(it is stored in {FIRST}; 1 such"),
        (lambda m: m.pop("b.weight"), rf"does not map tensor `b.weight` of {FIRST} to it \(1 such tensors\); expected every shard tensor in weight_map"),
        (lambda m: m.__setitem__("a.weight", 1), r"`weight_map` must map tensor names to shard file names"),
    ],
)
def test_the_index_must_agree_with_its_shards(sharded, edit, match):
    index = edit_index(sharded, edit)
    with pytest.raises(ValueError, match=rf"^{index} .*{match}"):
        weight_files(sharded)


def test_openvla_refuses_an_index_naming_a_tensor_in_the_wrong_shard(tmp_path):
    path = make_tiny_openvla(tmp_path / "sharded", seed=0, max_shard_bytes=1 << 20)

    def move(weight_map):
        name = next(k for k, v in weight_map.items() if v.startswith("model-00001-"))
        weight_map[name] = next(v for v in weight_map.values() if v.startswith("model-00002-"))

    index = edit_index(path, move)
    with pytest.raises(ValueError, match=rf"{index} maps tensor .* to model-00002-.*, which does not hold it"):
        load_policy(path, device="meta")


def test_openvla_refuses_an_integer_weight(tmp_path):
    path = make_tiny_openvla(tmp_path / "int8", seed=0)
    state = load_file(path / "model.safetensors")
    name = "language_model.model.layers.0.mlp.down_proj.weight"
    state[name] = (state[name].float() * 100).to(torch.int8)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^{path}/model.safetensors: tensor `{name}` is stored as I8; expected a floating-point weight"):
        load_policy(path, device="meta")


def test_causal_lm_refuses_an_integer_weight(tmp_path):
    cfg = LlamaConfig.from_name("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    state = {k: v.contiguous() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int8)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/model.safetensors: tensor `model.norm.weight` is torch.int8; expected a floating-point weight"):
        load_causal_lm(tmp_path, tokenizer=False)
