"""Fused RoPE in Triton: rotate ``[B, H, T, D]`` at per-token positions, angles computed in the kernel.

For the queries and new keys a cache rotates itself (the attention kernel in ``attention.py`` rotates its own
inputs). One program rotates ``BLOCK_T`` tokens of one (batch, head): it loads both halves of each row,
computes ``cos/sin(pos * inv_freq)`` in float32 and writes ``[x1 c - x2 s, x2 c + x1 s]`` rounded once to the
input dtype: the numbers of ``rope_ref.rope``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from .capability import interpreted, strided_reasons, supports_config
from .checks import check_rope_args

# 2*pi split in three float32 parts for Cody-Waite reduction: TWO_PI_1 has 8 significant bits, so k * TWO_PI_1 is
# exact for |k| < 2**16 (angles up to ~4e5 rad; compacted positions stay far below).
TWO_PI_1 = tl.constexpr(6.28125)
TWO_PI_2 = tl.constexpr(1.9353071693331003e-03)
TWO_PI_3 = tl.constexpr(1.0253131677018246e-11)
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def rope_cos_sin(pos, inv_freq, FAST_TRIG: tl.constexpr):
    """cos, sin of ``pos[:, None] * inv_freq[None, :]`` in float32 ([BLOCK, HALF]).

    The angle is the float32 product (the reference's rounding). It is reduced to [-pi, pi] by Cody-Waite
    and then evaluated with the GPU's ``sin.approx``/``cos.approx`` (FAST_TRIG: no branches, no local
    memory; abs error <= 2**-20.5 ~ 7e-7 on that range) or with ``tl.sin/tl.cos`` (the interpreter, which has no
    libdevice). libdevice's accurate ``sinf/cosf`` would inline a slow path per element and spill.
    """
    angle = pos.to(tl.float32)[:, None] * inv_freq[None, :]
    k = tl.floor(angle * INV_TWO_PI + 0.5)
    r = tl.fma(-k, TWO_PI_1, angle)
    r = tl.fma(-k, TWO_PI_2, r)
    r = tl.fma(-k, TWO_PI_3, r)
    if FAST_TRIG:
        return libdevice.fast_cosf(r), libdevice.fast_sinf(r)
    return tl.cos(r), tl.sin(r)


@triton.jit
def _rope_kernel(
    X,  # *Pointer* to x [B, H, T, D] (last dim contiguous)
    POS,  # *Pointer* to positions [T] (int32/int64)
    INV_FREQ,  # *Pointer* to inverse frequencies [D/2] float32
    OUT,  # *Pointer* to the result [B, H, T, D] contiguous
    stride_xb,
    stride_xh,
    stride_xt,
    n_heads,
    n_tokens,
    HALF: tl.constexpr,  # D / 2
    BLOCK_T: tl.constexpr,
    FAST_TRIG: tl.constexpr,  # compiled: sin.approx/cos.approx; interpreter: tl.sin/tl.cos
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HALF)
    t_ok = t < n_tokens
    pos = tl.load(POS + t, mask=t_ok, other=0)
    c, s = rope_cos_sin(pos, tl.load(INV_FREQ + d), FAST_TRIG)  # [BLOCK_T, HALF] each
    x_ptr = X + b * stride_xb + h * stride_xh + t[:, None].to(tl.int64) * stride_xt + d[None, :]
    x1 = tl.load(x_ptr, mask=t_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=t_ok[:, None], other=0.0).to(tl.float32)
    o_ptr = OUT + ((b * n_heads + h) * n_tokens + t[:, None].to(tl.int64)) * (2 * HALF) + d[None, :]
    tl.store(o_ptr, (x1 * c - x2 * s).to(OUT.dtype.element_ty), mask=t_ok[:, None])
    tl.store(o_ptr + HALF, (x2 * c + x1 * s).to(OUT.dtype.element_ty), mask=t_ok[:, None])


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [B, H, T, D]`` at positions ``pos: [T]`` (int32) with ``inv_freq: [D/2]`` (float32).

    Returns a new contiguous [B, H, T, D] tensor in x's dtype. CUDA tensors run the compiled kernel,
    CPU tensors Triton's interpreter (tests only; use ``rope_ref.rope`` on CPU).
    """
    check_rope_args(x, pos, inv_freq)
    reasons = supports_config(x.device, x.dtype, x.shape[-1]) + strided_reasons(x=x)
    if reasons:
        raise ValueError("the Triton rope cannot run these inputs: " + "; ".join(reasons))
    b, h, t, d = x.shape
    out = torch.empty((b, h, t, d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_t = min(64, triton.next_power_of_2(t))
    grid = (triton.cdiv(t, block_t), b * h)
    _rope_kernel[grid](
        x, pos.contiguous(), inv_freq.contiguous(), out,
        x.stride(0), x.stride(1), x.stride(2), h, t,
        HALF=d // 2, BLOCK_T=block_t, FAST_TRIG=not interpreted(_rope_kernel),
    )
    return out
