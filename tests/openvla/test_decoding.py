"""``predict --decode actions|full``: greedy over the action ids (default) or over the whole vocabulary as upstream,
on a tiny checkpoint whose lm_head is edited so that the two choices differ; each equals a plain reference."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from upstream_reference import greedy_ids, ids_to_actions

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.cli import main
from vla_runtime.config import ActionDecoding
from vla_runtime.images import read_image
from vla_runtime.kv import FullCache, FullParams

INSTRUCTION = "put the cup in the drawer"
LM_HEAD = "language_model.lm_head.weight"


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "frame.png"
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def edited(tmp_path_factory, png):
    """A float32 tiny checkpoint whose first full-vocabulary greedy token is a non-action id: that token's
    lm_head row (the non-action token with the largest first-step logit) is scaled past every action logit.
    Returns (path, the edited token id)."""
    path = make_tiny_openvla(tmp_path_factory.mktemp("decode") / "ckpt", seed=2, dtype=torch.float32)
    policy = load_policy(path, device="cpu", dtype="float32")
    first, last = policy.config.action_token_range
    ids = torch.tensor([policy.tokenizer.prompt(INSTRUCTION).input_ids])
    pixels = policy.image_processor(read_image(png))[None]
    with torch.no_grad():
        logits = policy.model(pixels, ids, cache=FullCache(policy.config.llm.geometry, FullParams(capacity=64)))[0, -1]  # [V]
    outside = logits.clone()
    outside[first : last + 1] = -torch.inf
    token = int(outside.argmax())
    assert logits[token] > 0, "the construction scales a positive logit"
    scale = 2 * (abs(float(logits[first : last + 1].max())) + 1) / float(logits[token])
    weights = load_file(str(path / "model.safetensors"))
    weights[LM_HEAD][token] *= scale
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, token


def predict(path, png, decode, capsys) -> dict:
    """``vla-runtime predict`` in-process (``decode=None``: no ``--decode`` flag) -> its JSON line."""
    argv = ["predict", "--checkpoint", str(path), "--image", str(png), "--instruction", INSTRUCTION,
            "--device", "cpu", "--dtype", "float32"] + (["--decode", decode] if decode else [])  # fmt: skip
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_full_and_action_decoding_each_equal_the_reference(edited, png, capsys):
    path, token = edited
    policy = load_policy(path, device="cpu", dtype="float32")
    cfg = policy.config
    first, last = cfg.action_token_range
    pixels = policy.image_processor(read_image(png))[None]
    input_ids = list(policy.tokenizer.prompt(INSTRUCTION).input_ids)
    stats = cfg.norm_stats["bridge_orig"]["action"]
    got = {}
    for decode, full_vocab in (("actions", False), ("full", True)):
        out = predict(path, png, decode, capsys)
        expected_ids = greedy_ids(policy, pixels, input_ids, 7, full_vocab=full_vocab)
        assert out["action_tokens"] == expected_ids, decode
        expected = ids_to_actions(expected_ids, vocab_size=cfg.vocab_size_text, n_bins=cfg.n_bins, action_stats=stats)
        np.testing.assert_allclose(out["action"], expected, rtol=0, atol=1e-6)
        got[decode] = out
    assert all(first <= t <= last for t in got["actions"]["action_tokens"])
    assert got["full"]["action_tokens"][0] == token and not first <= token <= last  # the edited row won
    assert got["full"]["action"][0] != got["actions"]["action"][0]  # ... and moved the action to an end bin
    default = predict(path, png, None, capsys)  # no --decode: the action tokens only
    assert (default["action_tokens"], default["action"]) == (got["actions"]["action_tokens"], got["actions"]["action"])


def test_decoding_is_an_enum_past_the_cli(edited):
    with pytest.raises(TypeError, match="`decoding` must be an ActionDecoding"):
        load_policy(edited[0], device="meta", decoding="full")
    assert load_policy(edited[0], device="meta", decoding=ActionDecoding.FULL).decoding is ActionDecoding.FULL


def test_full_decoding_is_refused_for_other_families(tmp_path, png, capsys):
    from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact

    run = make_tiny_cogact(tmp_path / "cogact")
    argv = ["predict", "--checkpoint", str(run), "--image", str(png), "--instruction", "x", "--decode", "full"]
    assert main(argv) == 2
    assert "--decode full applies to OpenVLA checkpoints" in capsys.readouterr().err
