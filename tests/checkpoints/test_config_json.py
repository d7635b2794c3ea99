"""``config.json`` fields of the wrong type are one-line errors naming the file, the key, what it holds and what
was expected (not a ``TypeError`` traceback from deep in a parser); a causal LM's tensors must be the decoder's."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.causal_lm import load_causal_lm
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_openvla(tmp_path_factory.mktemp("cfg") / "tiny", seed=0)


def _text(c, key, value):
    c["text_config"][key] = value


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: _text(c, "hidden_size", "64"), "config.json text_config `hidden_size` is str '64'; expected an integer"),
        (lambda c: _text(c, "num_hidden_layers", 2.5), "text_config `num_hidden_layers` is float 2.5; expected an integer"),
        (lambda c: _text(c, "rope_theta", "big"), "text_config `rope_theta` is str 'big'; expected a finite number"),
        (lambda c: _text(c, "hidden_size", float("inf")), "text_config `hidden_size` is float inf; expected an integer"),
        (lambda c: _text(c, "tie_word_embeddings", 1), "text_config `tie_word_embeddings` is int 1; expected true or false"),
        (lambda c: c.__setitem__("text_config", [1]), "config.json `text_config` is list [1]; expected a JSON object"),
        (lambda c: c.__setitem__("image_sizes", 224), "config.json `image_sizes` is int 224; expected a list"),
        (lambda c: c.__setitem__("image_sizes", ["224", 224]), "`image_sizes` is list ['224', 224]; expected a list of integers"),
        (lambda c: c.__setitem__("n_action_bins", True), "`n_action_bins` is bool True; expected an integer"),
        (lambda c: c.__setitem__("proprio_dim", "8"), "`proprio_dim` is str '8'; expected an integer"),
        (lambda c: c.__setitem__("norm_stats", [1]), "`norm_stats` is list [1]; expected a JSON object"),
        (lambda c: c.__setitem__("use_fused_vision_backbone", "yes"), "`use_fused_vision_backbone` is str 'yes'; expected true or false"),
    ],
)  # fmt: skip
def test_a_config_field_of_the_wrong_type_is_named(tiny, tmp_path, edit, message):
    path = shutil.copytree(tiny, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(f"{path}/{message}" if message.startswith("config.json") else message)):
        load_policy(path, device="meta")


def _causal_lm(path, edit=lambda state: None):
    cfg = LlamaConfig.from_name("tiny")
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    state = {k: v.contiguous() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    edit(state)
    save_file(state, str(path / "model.safetensors"))
    return path


def test_a_causal_lm_with_tensors_the_decoder_lacks_is_refused(tmp_path):
    path = _causal_lm(tmp_path, lambda s: s.__setitem__("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2)))
    with pytest.raises(ValueError, match=r"decoder does not have: \['model.layers.9.mlp.up_proj.weight'\]"):
        load_causal_lm(path, tokenizer=False)


def test_the_rotary_table_older_conversions_saved_is_ignored(tmp_path):
    path = _causal_lm(tmp_path, lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)))
    assert load_causal_lm(path, tokenizer=False).model is not None


def test_a_causal_lm_config_field_of_the_wrong_type_is_named(tmp_path):
    path = _causal_lm(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["num_attention_heads"] = None  # null: the default (32), which the tiny width does not divide into
    config["rms_norm_eps"] = "1e-6"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{path}/config.json `rms_norm_eps` is str '1e-6'; expected a finite number"):
        load_causal_lm(path, tokenizer=False)
