"""Fused projections (``models.fuse``): a decoder with q/k/v and gate/up fused computes what the separate
projections compute (with Qwen2's q/k/v biases too), traces as one graph, takes weight-only quantization after
fusing, and a fused OpenVLA policy decodes the same action tokens as the plain one."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.kv import KVConfig, make_cache
from vla_runtime.models.fuse import fuse_projections, fused_linear
from vla_runtime.models.llama import LlamaConfig, LlamaModel
from vla_runtime.models.quantize import QuantMode, quantize_linears


def decoder(qkv_bias: bool) -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel(replace(LlamaConfig.from_name("tiny"), qkv_bias=qkv_bias)).eval()
    if qkv_bias:
        with torch.no_grad():
            for layer in model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_()  # nn.Linear's init is small: make a dropped or misplaced bias show
    return model


def run(model: LlamaModel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``x`` [1, T, dim] then decode its last row again: hidden states [1, T, dim] and [1, 1, dim]."""
    cache = make_cache(KVConfig(), model.cfg.geometry)
    with torch.inference_mode():
        return model(inputs_embeds=x, cache=cache), model(inputs_embeds=x[:, -1:], cache=cache)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_a_fused_decoder_computes_what_the_separate_projections_compute(qkv_bias):
    model = decoder(qkv_bias)
    x = torch.randn(1, 9, model.cfg.dim)
    want = run(model, x)
    assert fuse_projections(model.layers) == model.cfg.n_layers
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert not any(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")) and not hasattr(mlp, "gate_proj")
    assert attn.qkv_proj.weight.shape == ((model.cfg.n_heads + 2 * model.cfg.n_kv_heads) * model.cfg.head_dim, model.cfg.dim)
    assert (attn.qkv_proj.bias is not None) == qkv_bias
    assert mlp.gate_up_proj.weight.shape == (2 * model.cfg.ffn_dim, model.cfg.dim)
    for got, expected in zip(run(model, x), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert fuse_projections(model.layers) == 0  # fused already: left as it is


def test_fused_linear_zero_fills_the_bias_of_a_part_without_one():
    torch.manual_seed(0)
    parts = [torch.nn.Linear(8, 3, bias=True), torch.nn.Linear(8, 5, bias=False)]
    x = torch.randn(4, 8)
    torch.testing.assert_close(fused_linear(parts)(x), torch.cat([p(x) for p in parts], dim=-1))


def test_fusing_after_quantization_is_refused_and_quantizing_after_fusing_quantizes_four_per_layer():
    model = decoder(False)
    quantized = decoder(False)
    quantize_linears(quantized.layers, QuantMode.INT8)
    with pytest.raises(TypeError, match="fuse before quantize_linears"):
        fuse_projections(quantized.layers)
    fuse_projections(model.layers)
    assert quantize_linears(model.layers, QuantMode.INT8) == 4 * model.cfg.n_layers  # qkv, o, gate_up, down


def test_a_fused_decode_traces_as_one_graph_with_eagers_numbers():
    model = decoder(False)
    fuse_projections(model.layers)
    x = torch.randn(1, 5, model.cfg.dim)
    cache = make_cache(KVConfig(), model.cfg.geometry)
    captured = torch.compile(model.layers_forward, fullgraph=True, backend="eager", dynamic=True)
    with torch.inference_mode():
        model(inputs_embeds=x[:, :4], cache=cache)
        mark = cache.mark()
        want = model(inputs_embeds=x[:, 4:], cache=cache)
        cache.rollback(mark)
        got = captured(inputs_embeds=x[:, 4:], cache=cache)
        cache.end_forward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_fused_policy_decodes_the_plain_policys_action_tokens(tmp_path):
    path = make_tiny_openvla(tmp_path / "tiny-openvla", seed=0)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(4)]
    plain, fused = (load_policy(path, device="cpu", fuse=f) for f in (False, True))
    assert hasattr(plain.vlm.language_model.model.layers[0].self_attn, "q_proj")
    assert plain.vlm.language_model.model.layers[0].self_attn.qkv_proj is None
    assert fused.vlm.language_model.model.layers[0].self_attn.qkv_proj is not None
    sessions = [p.new_session("pick up the cube") for p in (plain, fused)]
    for image in frames:
        results = [s.step(Observation(images={"primary": image})) for s in sessions]
        np.testing.assert_array_equal(sessions[1].last_tokens, sessions[0].last_tokens)
        np.testing.assert_allclose(results[1].actions, results[0].actions, atol=1e-6)
