"""Prepacked linear layers (``models.prepack``): eager inference multiplies by the oneDNN-packed copy and
computes what ``nn.Linear`` computes, each row of a batch the same bits as alone; a weight changed in place is
repacked, and a deep copy repacks its own; training and ``torch.compile`` take the weight itself; a prepacked
OpenVLA policy decodes the plain policy's action tokens, alone and batched."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import SessionConfig
from vla_runtime.kv import KVConfig
from vla_runtime.kv.rope import RopeConfig
from vla_runtime.models.llama import LlamaConfig
from vla_runtime.models.prepack import PrepackedLinear, prepack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 24, bias=False))


@pytest.mark.parametrize("shape", [(1, 48), (8, 48), (3, 21, 48)])
def test_a_prepacked_model_computes_what_the_linear_layers_compute(shape):
    plain, packed = model(), model()
    assert prepack_linears(packed, min_weights=0) == 2
    assert all(isinstance(packed[i], PrepackedLinear) for i in (0, 2))
    assert packed.state_dict().keys() == plain.state_dict().keys()  # the same names: it saves and loads as before
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
    assert prepack_linears(packed, min_weights=0) == 0  # prepacked already: left as it is


def test_only_layers_with_enough_weights_are_prepacked_by_default():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 256), nn.Linear(64, 64))
    assert prepack_linears(layers) == 1  # 512 x 512 = MIN_PACKED_WEIGHTS; the smaller ones stay ATen's
    assert [type(m) for m in layers] == [PrepackedLinear, nn.Linear, nn.Linear]


def test_inference_multiplies_by_the_packed_copy_and_autograd_by_the_weight():
    layer = PrepackedLinear.from_linear(nn.Linear(16, 8))
    other = torch.randn(8, 16)
    layer._packed = torch.ops.mkldnn._reorder_linear_weight(other, 8)  # a packed copy that is not the weight's
    x = torch.randn(4, 16)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, other, layer.bias), rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)
    out = layer(x)  # autograd records: the weight itself, with its gradient
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.grad.new_ones(8, 4) @ x.detach())


def test_each_row_of_a_batch_computes_the_same_bits_as_alone():
    layer = PrepackedLinear.from_linear(nn.Linear(512, 1376))
    x = torch.randn(168, 512)
    with torch.inference_mode():
        batch = layer(x)
        for rows in (slice(0, 1), slice(5, 13), slice(0, 21)):
            assert torch.equal(layer(x[rows].contiguous()), batch[rows])


def test_a_weight_changed_in_place_is_repacked():
    layer = PrepackedLinear.from_linear(nn.Linear(32, 16))
    x = torch.randn(2, 32)
    with torch.no_grad():
        layer.weight.mul_(-3.0)
        layer.load_state_dict({"weight": torch.randn(16, 32), "bias": torch.randn(16)})
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_a_deep_copy_repacks_its_own_weight():
    packed = model()
    prepack_linears(packed, min_weights=0)
    twin = copy.deepcopy(packed)
    with torch.no_grad():
        twin[0].weight.zero_()  # the copy's weight is its own: the original keeps computing with its weight
    x = torch.randn(4, 48)
    with torch.inference_mode():
        torch.testing.assert_close(twin[0](x), twin[0].bias.expand(4, -1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[0](x), F.linear(x, packed[0].weight, packed[0].bias), rtol=1e-5, atol=1e-5)


def test_a_prepacked_model_traces_as_one_graph_with_the_weights():
    packed = model()
    prepack_linears(packed, min_weights=0)
    x = torch.randn(5, 48)
    compiled = torch.compile(packed, fullgraph=True, backend="eager")
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), F.linear(F.gelu(F.linear(x, packed[0].weight, packed[0].bias)), packed[2].weight))


def test_weights_other_than_float32_on_the_cpu_are_refused_by_name():
    half = model().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"float32 weights on the CPU; 0 has torch.bfloat16"):
        prepack_linears(half)
    assert type(half[0]) is nn.Linear  # nothing was replaced
    with pytest.raises(TypeError, match="pass the module that holds the layer"):
        prepack_linears(nn.Linear(4, 4))


def test_a_prepacked_policy_decodes_the_plain_policys_action_tokens_alone_and_batched(tmp_path):
    llm = LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=1376, vocab_size=32064,
                      max_position=2048, rope=RopeConfig(head_dim=64, original_max_position=2048))  # big enough to pack
    path = make_tiny_openvla(tmp_path / "small-openvla", seed=0, llm=llm, dtype=torch.float32)
    plain, packed = (load_policy(path, device="cpu", prepack=p) for p in (False, True))
    assert isinstance(packed.vlm.language_model.model.layers[0].self_attn.q_proj, PrepackedLinear)
    assert type(plain.vlm.language_model.model.layers[0].self_attn.q_proj) is nn.Linear
    config = SessionConfig(history="history", kv=KVConfig(mode="chunked"))
    prompts = ["pick up the cube", "open the drawer", "go"]
    rng = np.random.default_rng(0)
    alone = [plain.new_session(p, config) for p in prompts]
    batched = [packed.new_session(p, config) for p in prompts]
    for _ in range(3):
        obs = [Observation(images={"primary": rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)}) for _ in prompts]
        expected = [s.step(o) for s, o in zip(alone, obs)]
        results = packed.step_batch(batched, obs)
        for want, got, a, b in zip(expected, results, alone, batched):
            np.testing.assert_array_equal(b.last_tokens, a.last_tokens)
            np.testing.assert_allclose(got.actions, want.actions, atol=1e-6)


def test_weights_made_in_inference_mode_are_refused():
    """They keep no version counter: a later in-place change could not be seen, and the packed copy would go stale."""
    with torch.inference_mode():
        layer = nn.Linear(16, 8)
    with pytest.raises(ValueError, match="inference tensor .* outside inference mode"):
        PrepackedLinear.from_linear(layer)
