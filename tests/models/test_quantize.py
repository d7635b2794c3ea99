"""Weight-only int8/int4 (``models.quantize``): each quantized linear equals ``F.linear`` with its dequantized
weight, the dequantized weight is within half a quantization step of the float one, a quantized decoder keeps
its KV cache in the model dtype, and a quantized OpenVLA policy loads and steps with smaller LLM weights."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.kv import KVConfig, make_cache
from vla_runtime.models.llama import LlamaConfig, LlamaModel
from vla_runtime.models.quantize import Int4Linear, Int8Linear, QuantMode, quantize_linears, weight_bytes


@pytest.fixture
def linear():
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        layer.weight[3] *= 20  # one row far larger than the others: per-channel / per-group scales matter
    return layer


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_quantized_linear_is_the_matmul_with_its_dequantized_weight(cls, linear):
    q = cls.from_linear(linear)
    x = torch.randn(3, 5, 256)
    reference = F.linear(x, q.dequantized_weight(), linear.bias)
    torch.testing.assert_close(q(x), reference, rtol=1e-5, atol=1e-5)


def test_int8_weight_is_within_half_a_step_per_output_channel(linear):
    q = Int8Linear.from_linear(linear)
    w = linear.weight.detach()
    step = w.abs().amax(dim=1, keepdim=True) / 127  # [out, 1]
    assert ((q.dequantized_weight() - w).abs() <= step / 2 + 1e-6).all()
    assert q.weight_int8.dtype == torch.int8 and q.scale.shape == (96,)


def test_int4_weight_is_within_half_a_step_per_group(linear):
    q = Int4Linear.from_linear(linear, group_size=64)
    w = linear.weight.detach().view(96, 4, 64)
    step = (w.amax(-1) - w.amin(-1)) / 15  # [out, groups]
    err = (q.dequantized_weight().view(96, 4, 64) - w).abs()
    assert (err <= step[..., None] / 2 + 1e-6).all()
    assert q.packed.shape == (96, 128) and q.packed.dtype == torch.uint8 and q.scale.shape == (96, 4)
    coarse = Int4Linear.from_linear(linear, group_size=256)  # one group per row: the outlier row costs precision
    assert (coarse.dequantized_weight() - linear.weight).abs().mean() > err.mean()


def test_int4_halves_its_group_until_it_splits_the_inputs():
    assert Int4Linear.from_linear(torch.nn.Linear(576, 8)).group_size == 64  # SmolLM2's width: 128 does not split it
    assert Int4Linear.from_linear(torch.nn.Linear(100, 8), group_size=64).group_size == 4
    with pytest.raises(ValueError, match=r"inputs \(99\) to split into even groups of at most 64"):
        Int4Linear.from_linear(torch.nn.Linear(99, 8), group_size=64)


@pytest.mark.parametrize("mode", [QuantMode.INT8, QuantMode.INT4])
def test_a_quantized_decoder_keeps_the_cache_in_the_model_dtype_and_stays_close(mode):
    torch.manual_seed(0)
    cfg = LlamaConfig.from_name("tiny")
    model = LlamaModel(cfg).eval()
    x = torch.randn(1, 9, cfg.dim)
    with torch.inference_mode():
        want = model(inputs_embeds=x, cache=make_cache(KVConfig(), cfg.geometry))
        assert quantize_linears(model.layers, mode) == 7 * cfg.n_layers
        cache = make_cache(KVConfig(), cfg.geometry)
        got = model(inputs_embeds=x, cache=cache)
    assert cache.store.k.dtype == cache.store.v.dtype == torch.float32
    assert not any(isinstance(m, torch.nn.Linear) for m in model.layers.modules())
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # quantization error, not a broken layer


def test_a_quantized_policy_steps_with_smaller_llm_weights(tmp_path):
    path = make_tiny_openvla(tmp_path / "tiny-openvla", seed=0)
    image = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    sizes = {}
    for mode in QuantMode:
        policy = load_policy(path, device="cpu", quantize=mode)
        result = policy.new_session("pick up the cube").step(Observation(images={"primary": image}))
        assert result.actions.shape == (1, policy.action_dim) and np.isfinite(result.actions).all()
        sizes[mode] = weight_bytes(policy.vlm.language_model.model.layers)
    assert sizes[QuantMode.NONE] > 3.5 * sizes[QuantMode.INT8] and sizes[QuantMode.INT8] > 1.4 * sizes[QuantMode.INT4]


@pytest.mark.parametrize("width", [72, 96])  # 72: torch 2.14's bfloat16 CPU int8 kernel gave NaN / 1e28 there
def test_int8_in_bfloat16_is_the_matmul_with_its_dequantized_weight_at_any_width(width):
    layer = Int8Linear.from_linear(torch.nn.Linear(width, 64, bias=False).to(torch.bfloat16))
    x = torch.randn(3, 2 * width, dtype=torch.bfloat16)[:, ::2]  # a strided last dimension too
    want = x.float() @ layer.dequantized_weight().float().T
    torch.testing.assert_close(layer(x).float(), want, rtol=0.02, atol=0.05)
