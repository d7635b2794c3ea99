"""Triton ``chunked_attention`` against its torch reference: every case, dtype and head dim, split-K.

On CPU these run in Triton's interpreter (through ``test_interpreter.py``, which starts this module in a
process with ``TRITON_INTERPRET=1``); on CUDA natively (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CASES, DTYPES, AttnCase, assert_matches, kernel_devices, make_inputs

from vla_kernels.attention import chunked_attention, plan_launch
from vla_kernels.attention_ref import chunked_attention as chunked_attention_ref
from vla_kernels.checks import check_attention_args

DEVICES = kernel_devices()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(case: AttnCase, dtype: torch.dtype, device: str):
    inputs = make_inputs(case, dtype, device)
    out = torch.full_like(inputs["q"], float("nan"))  # every element must be written
    result = chunked_attention(**inputs, out=out)
    assert result is out
    assert_matches(out, chunked_attention_ref(**inputs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [2, 3, 50])
def test_split_k_matches_reference(splits: int, device: str):
    """Split over keys (forced; the CPU plan never splits): partials merged by log-sum-exp, any split count."""
    case = AttnCase("split", q_heads=8, kv_heads=2, tokens=1, head_dim=64, prefix=5, chunks=9, raw=190)
    inputs = make_inputs(case, torch.float32, device, seed=splits)
    dims = check_attention_args(*inputs.values())
    plan = plan_launch(dims, torch.device(device), torch.float32, num_splits=splits)
    assert 1 < plan.splits <= splits and (plan.splits - 1) * plan.keys_per_split < dims.keys  # no empty split
    assert_matches(chunked_attention(**inputs, num_splits=splits), chunked_attention_ref(**inputs))


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_with_blind_rows_and_empty_splits(device: str):
    """Queries that see nothing, and splits whose keys no query sees, combine to zeros and exact outputs."""
    case = AttnCase("split-blind", q_heads=4, kv_heads=1, tokens=3, head_dim=128, prefix=2, chunks=3, raw=200,
                    layout="blind")
    inputs = make_inputs(case, torch.float32, device, seed=1)
    inputs["q_pos"][1] = 40  # sees only the first 31 keys: the later splits are empty for it
    out = chunked_attention(**inputs, num_splits=3)
    assert_matches(out, chunked_attention_ref(**inputs))
    assert (out[:, :, 0] == 0).all() and (out[:, :, 1:].abs() > 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_no_keys_gives_zeros(device: str):
    case = AttnCase("empty", q_heads=4, kv_heads=1, tokens=2, head_dim=64, prefix=0, chunks=0, raw=0)
    inputs = make_inputs(case, torch.float16, device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    inputs.update(kv_slots=empty, kv_pos=empty)
    out = torch.full_like(inputs["q"], float("nan"))
    assert (chunked_attention(**inputs, out=out) == 0).all()
    assert (chunked_attention_ref(**inputs) == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_scale_and_strided_views(device: str):
    """A custom scale, and q / stores as views into larger buffers (the cache's per-layer slices)."""
    case = AttnCase("views", q_heads=4, kv_heads=2, tokens=3, head_dim=64, prefix=3, chunks=2, raw=12)
    inputs = make_inputs(case, torch.float32, device)
    layers_k = torch.randn(3, *inputs["k_store"].shape, device=device)
    layers_k[1] = inputs["k_store"]
    wide_q = torch.randn(1, 4, 8, 64, device=device)
    wide_q[:, :, 2:5] = inputs["q"]
    views = dict(inputs, k_store=layers_k[1], q=wide_q[:, :, 2:5])
    assert not views["q"].is_contiguous()
    expected = chunked_attention_ref(**inputs, scale=0.3)
    assert_matches(chunked_attention(**views, scale=0.3), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_long_decode_auto_split_on_gpu(dtype: torch.dtype):
    """The default plan at a long context splits over keys on a real GPU and stays exact."""
    case = AttnCase("long", q_heads=32, kv_heads=8, tokens=1, head_dim=128, prefix=40, chunks=500, raw=12000)
    inputs = make_inputs(case, dtype, "cuda")
    dims = check_attention_args(*inputs.values())
    assert plan_launch(dims, torch.device("cuda"), dtype).splits > 1
    assert_matches(chunked_attention(**inputs), chunked_attention_ref(**inputs))


@pytest.mark.parametrize("device", DEVICES)
def test_unsupported_inputs_raise_with_reasons(device: str):
    case = AttnCase("d96", q_heads=2, kv_heads=1, tokens=1, head_dim=96, prefix=2, chunks=0, raw=3)
    inputs = make_inputs(case, torch.float32, device)
    with pytest.raises(ValueError, match="head dim 96 is not supported"):
        chunked_attention(**inputs)
    inputs = make_inputs(AttnCase("f64", 2, 1, 1, 64, 2, 0, 3), torch.float64, device)
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        chunked_attention(**inputs)
