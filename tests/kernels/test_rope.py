"""Triton ``rope`` against ``rope_ref.rope``: dtypes, head dims, odd lengths, large and unordered positions.

On CPU through ``test_interpreter.py`` (Triton's interpreter), on CUDA natively (``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, assert_matches, kernel_devices

from vla_kernels.rope import rope
from vla_kernels.rope_ref import rope as rope_ref

DEVICES = kernel_devices()
SHAPES = {"one-token": (1, 1, 1), "odd": (2, 3, 37), "two-blocks": (1, 2, 65)}  # (B, H, T)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_rope_kernel_matches_reference(shape: str, dtype: torch.dtype, head_dim: int, device: str):
    gen = torch.Generator().manual_seed(head_dim)
    b, h, t = SHAPES[shape]
    x = torch.randn(b, h, t, head_dim, generator=gen).to(dtype=dtype, device=device)
    pos = torch.randint(0, 30000, (t,), generator=gen).to(torch.int32).to(device)  # unordered, large angles
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, head_dim, 2) / head_dim))).float().to(device)
    assert_matches(rope(x, pos, inv_freq), rope_ref(x, pos, inv_freq))


@pytest.mark.parametrize("device", DEVICES)
def test_rope_kernel_on_strided_view(device: str):
    base = torch.randn(2, 8, 4, 64, device=device)
    x = base.transpose(1, 2)  # [B, H=4, T=8, D] with non-contiguous batch/head/token strides
    pos = torch.arange(8, dtype=torch.int32, device=device) * 7
    inv_freq = torch.rand(32, device=device)
    out = rope(x, pos, inv_freq)
    assert out.is_contiguous()
    assert_matches(out, rope_ref(x, pos, inv_freq))
