"""Checkpoint IO: the tiny checkpoint's upstream layout, shards, Prismatic-native names, tolerated
unused tensors, and a clear error for each way a directory can be wrong."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.openvla import hf_name, load_openvla
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import SessionConfig

UPSTREAM_CONFIG_KEYS = {
    "arch_specifier", "architectures", "auto_map", "hf_llm_id", "image_resize_strategy", "image_sizes",
    "llm_backbone_id", "llm_max_length", "model_type", "n_action_bins", "norm_stats", "output_projector_states",
    "pad_to_multiple_of", "pad_token_id", "text_config", "timm_model_ids", "timm_override_act_layers",
    "torch_dtype", "transformers_version", "use_fused_vision_backbone", "vision_backbone_id",
}  # fmt: skip


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def step(path, image, **kw):
    policy = load_policy(path, device="cpu", **kw)
    return policy.new_session("move the mug to the left").step(Observation(images={"primary": image}))


def test_tiny_checkpoint_has_the_upstream_layout(tiny_openvla):
    files = {p.name for p in tiny_openvla.iterdir()}
    assert files == {
        "config.json", "model.safetensors", "preprocessor_config.json", "processor_config.json", "generation_config.json",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    }  # fmt: skip
    config = json.loads((tiny_openvla / "config.json").read_text())
    assert UPSTREAM_CONFIG_KEYS <= set(config) and set(config) - UPSTREAM_CONFIG_KEYS == {"vision_num_heads"}
    assert config["vision_backbone_id"] == "dinosiglip-vit-so-224px" and config["image_sizes"] == [56, 56]
    assert config["timm_model_ids"] == ["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"]
    assert config["text_config"]["vocab_size"] == 32064 and config["text_config"]["pad_token_id"] == 32000
    assert json.loads((tiny_openvla / "added_tokens.json").read_text()) == {"<PAD>": 32000}
    with safe_open(str(tiny_openvla / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("language_model.lm_head.weight").dtype == torch.bfloat16
    for name in ("vision_backbone.featurizer.blocks.2.ls1.scale_factor", "vision_backbone.featurizer.reg_token",
                 "vision_backbone.featurizer.norm.weight", "vision_backbone.fused_featurizer.attn_pool.latent",
                 "vision_backbone.fused_featurizer.blocks.2.mlp.fc2.weight", "projector.fc3.bias",
                 "language_model.model.layers.1.self_attn.k_proj.weight"):  # fmt: skip
        assert name in names
    assert not any("gamma" in n for n in names)


def test_tokenizer_has_the_llama2_id_layout(tiny_openvla):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_openvla / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=False) == 32000 and tok.get_vocab_size() == 32001
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<PAD>", "▁", "<0x00>", "<0x0A>", "<0xFF>")] == [0, 1, 2, 32000, 29871, 3, 13, 258]
    actions = [tok.id_to_token(i) for i in range(31744, 32000)]
    assert len(set(actions)) == 256 and all(len(a) == 1 and not a.isascii() for a in actions)
    # LLaMA-2's pipeline: BOS post-processor, "▁"-prefixed word pieces, byte fallback for what is not in the vocabulary
    assert tok.encode("stack the cup").tokens == ["<s>", "▁stack", "▁the", "▁cup"]
    assert tok.encode("\nä", add_special_tokens=False).ids == [29871, 13, 3 + 0xC3, 3 + 0xA4]


def test_sharded_checkpoint_loads_to_the_same_model(tiny_openvla, tmp_path, frame):
    sharded = make_tiny_openvla(tmp_path / "sharded", seed=0, max_shard_bytes=1 << 20)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (sharded / "model.safetensors").exists()
    image = frame(1)
    assert np.array_equal(step(sharded, image).actions, step(tiny_openvla, image).actions)


def test_prismatic_native_names_load_and_unused_tensors_may_be_absent(tiny_openvla, tmp_path, frame):
    path = copy_ckpt(tiny_openvla, tmp_path / "native")
    state = load_file(str(path / "model.safetensors"))
    native = {}
    for name, tensor in state.items():
        if ".norm." in name and "featurizer" in name and "blocks" not in name or "attn_pool" in name:
            continue  # final ViT norms and attn_pool: unused by the forward pass
        new = (name.replace("vision_backbone.featurizer.", "vision_backbone.dino_featurizer.")
               .replace("vision_backbone.fused_featurizer.", "vision_backbone.siglip_featurizer.")
               .replace("language_model.", "llm_backbone.llm.").replace("scale_factor", "gamma"))  # fmt: skip
        for i, seq in ((1, 0), (2, 2), (3, 4)):
            new = new.replace(f"projector.fc{i}.", f"projector.{seq}.")
        native[new] = tensor
    assert "vision_backbone.dino_featurizer.blocks.0.ls1.gamma" in native and "projector.4.weight" in native
    assert all(hf_name(n) in state for n in native)
    save_file(native, str(path / "model.safetensors"))
    image = frame(2)
    assert np.array_equal(step(path, image).actions, step(tiny_openvla, image).actions)


def test_dataset_statistics_json_overrides_config_norm_stats(tiny_openvla, tmp_path, frame):
    path = copy_ckpt(tiny_openvla, tmp_path / "finetuned")
    bridge = json.loads((path / "config.json").read_text())["norm_stats"]["bridge_orig"]
    halved = json.loads(json.dumps(bridge))
    halved["action"]["q01"] = [x / 2 for x in bridge["action"]["q01"]]
    halved["action"]["q99"] = [x / 2 for x in bridge["action"]["q99"]]
    (path / "dataset_statistics.json").write_text(json.dumps({"my_robot": halved, "my_robot_2": bridge}))
    policy = load_policy(path, device="cpu")
    assert policy.info()["datasets"] == ["my_robot", "my_robot_2"]
    with pytest.raises(ValueError, match="2 datasets.*my_robot, my_robot_2"):
        policy.new_session("push the button")
    with pytest.raises(KeyError, match="'bridge_orig' is not in .*available: my_robot, my_robot_2"):
        policy.new_session("push the button", config=SessionConfig(unnorm_key="bridge_orig"))
    with pytest.raises(KeyError, match="available: my_robot, my_robot_2"):
        load_policy(path, device="cpu", unnorm_key="bridge_orig")
    image = frame(3)
    mine = step(path, image, unnorm_key="my_robot").actions
    theirs = step(path, image, unnorm_key="my_robot_2").actions
    assert np.allclose(mine[0, :6], theirs[0, :6] / 2) and mine[0, 6] == theirs[0, 6]


# ---- errors -----------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy(tmp_path / "nope")


def test_missing_config(tiny_openvla, tmp_path):
    path = copy_ckpt(tiny_openvla, tmp_path / "c")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_openvla(path)


def test_no_weights_file(tiny_openvla, tmp_path):
    path = copy_ckpt(tiny_openvla, tmp_path / "w")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights file .*model.safetensors or model.safetensors.index.json"):
        load_policy(path, device="cpu")


def test_missing_shard(tiny_openvla, tmp_path):
    path = make_tiny_openvla(tmp_path / "s", max_shard_bytes=1 << 20)
    next(path.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shard model-00002-of-.* does not exist"):
        load_policy(path, device="cpu")


def test_unknown_vision_backbone_id(tiny_openvla, tmp_path):
    path = copy_ckpt(tiny_openvla, tmp_path / "v")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vision_backbone_id": "dinosiglip-vit-so-999px"}))
    with pytest.raises(ValueError, match="unknown `vision_backbone_id` 'dinosiglip-vit-so-999px'; known: .*dinosiglip-vit-so-224px"):
        load_policy(path, device="cpu")


def test_weight_shape_mismatch_names_the_tensor(tiny_openvla, tmp_path):
    path = copy_ckpt(tiny_openvla, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight shape mismatch: `language_model\.model\.layers\.\d\.mlp\.\w+_proj\.weight` expected \[\d+, \d+\] \(from config.json\), found \[\d+, \d+\] in model.safetensors"):
        load_policy(path, device="cpu")
    # a tower whose pos_embed does not fit the configured image size
    config["text_config"]["intermediate_size"] = 128
    config["image_sizes"] = [84, 84]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weight shape mismatch: .*`pos_embed` holds 16 patch positions.*gives 36"):
        load_policy(path, device="cpu")


def test_unexpected_and_missing_tensors_are_named(tiny_openvla, tmp_path):
    path = copy_ckpt(tiny_openvla, tmp_path / "u")
    state = load_file(str(path / "model.safetensors"))
    del state["projector.fc2.bias"]
    state["projector.fc9.weight"] = torch.zeros(2, 2)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="do not belong .*projector.fc9.weight"):
        load_policy(path, device="cpu")
    del state["projector.fc9.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing from .*projector.fc2.bias"):
        load_policy(path, device="cpu")


def test_tokenizer_must_match_the_text_vocabulary(tiny_openvla, tmp_path):
    path = copy_ckpt(tiny_openvla, tmp_path / "t")
    config = json.loads((path / "config.json").read_text())
    config["pad_to_multiple_of"] = 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="32000 tokens, but config.json implies 32032"):
        load_policy(path, device="cpu")
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_policy(path, device="cpu")


def test_meta_device_reads_no_weights(tiny_openvla):
    policy = load_policy(tiny_openvla, device="meta")
    assert all(p.is_meta for p in policy.model.parameters())
    info = policy.info()
    assert info["parameters"]["total"] == sum(t.numel() for t in load_file(str(tiny_openvla / "model.safetensors")).values())
