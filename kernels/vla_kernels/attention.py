"""Chunked attention in Triton: one store gathered by a slot list, RoPE fused, GQA, causal by position.

The chunked cache keeps every key it attends to (pinned prefix, retained chunk representatives, raw
tokens, the new tokens themselves) in one store ``[B, Hkv, S, D]``, without RoPE, and hands the kernel a
slot list in attention order with a position per slot (MEPIC's fused-RoPE attention over NoPE pages; the
IntentKV lesson: gather the live slots, never point dropped ones at a sentinel key).

Layout of the work (FlashAttention-2 style online softmax, flash-decoding split over keys):

- Rows. The ``G = Hq / Hkv`` query heads that share a key/value head are packed with the ``T`` query tokens
  into ``T * G`` rows (row ``r`` = token ``r // G``, head ``r % G``). One program owns ``BLOCK_M`` rows of one
  (batch, kv head), so each key tile is loaded and rotated once for all the heads that read it.
- RoPE. Queries are rotated once per program from ``q_pos``; every gathered key tile is rotated after it is
  loaded, from its ``kv_pos``: ``cos/sin(pos * inv_freq)`` in float32, HF ``rotate_half`` layout handled by
  loading the two halves of each row, rounded once to the storage dtype (the reference's rounding).
  Scores are the sum of two half-width dots.
- Visibility. Key j is visible to row r iff ``kv_pos[j] <= q_pos[r // G]``; the kernel assumes no order
  of slots or positions. A row that sees no key gets zeros.
- Split-K. For decode (``T * G`` rows fit one tile) at long contexts a launch would have only ``B * Hkv``
  programs; the keys are then cut into ``splits`` ranges, each program writes a normalised partial output
  and its log-sum-exp, and ``_combine_kernel`` merges them, so one query can use the whole GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .capability import interpreted, strided_reasons, supports_config
from .checks import AttentionDims, check_attention_args, check_out
from .rope import rope_cos_sin

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _attention_kernel(
    Q,  # *Pointer* to q [B, Hq, T, D] before RoPE (last dim contiguous)
    K,  # *Pointer* to k_store [B, Hkv, S, D] before RoPE (last dim contiguous)
    V,  # *Pointer* to v_store [B, Hkv, S, D] (last dim contiguous)
    SLOTS,  # *Pointer* to kv_slots [N]
    KV_POS,  # *Pointer* to kv_pos [N]
    Q_POS,  # *Pointer* to q_pos [T]
    INV_FREQ,  # *Pointer* to inv_freq [D/2] float32
    OUT,  # *Pointer* to out [B, Hq, T, D] contiguous; with SPLIT: float32 partials [splits, B, Hq, T, D]
    LSE,  # *Pointer* to float32 log2-sum-exp [splits, B, Hq, T] (SPLIT only)
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    n_kv_heads, n_tokens, n_keys, keys_per_split,
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,  # query heads per kv head
    HALF: tl.constexpr,  # D / 2
    BLOCK_M: tl.constexpr,  # packed (token, head) rows per program
    BLOCK_N: tl.constexpr,  # keys per tile
    SPLIT: tl.constexpr,  # write partials + LSE instead of the output
    DOT_F32: tl.constexpr,  # run dots on float32 operands (interpreter: its bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" for float32 inputs (no TF32)
    FAST_TRIG: tl.constexpr,  # see rope.rope_cos_sin
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h_kv = (pid_bh % n_kv_heads).to(tl.int64)
    dtype = Q.dtype.element_ty
    dot_dtype = tl.float32 if DOT_F32 else dtype

    # Rows of this program: (token, head-in-group) pairs, and their rotated queries.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_tokens * GROUP
    tok = rows // GROUP
    head = h_kv * GROUP + rows % GROUP  # query head, [BLOCK_M]
    d = tl.arange(0, HALF)
    dd = tl.arange(0, 2 * HALF)
    inv_freq = tl.load(INV_FREQ + d)
    q_pos = tl.load(Q_POS + tok, mask=row_ok, other=0)
    q_cos, q_sin = rope_cos_sin(q_pos, inv_freq, FAST_TRIG)  # [BLOCK_M, HALF] each
    q_ptr = Q + b * stride_qb + head[:, None] * stride_qh + tok[:, None].to(tl.int64) * stride_qt + d[None, :]
    q1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    qr1 = (q1 * q_cos - q2 * q_sin).to(dtype).to(dot_dtype)
    qr2 = (q2 * q_cos + q1 * q_sin).to(dtype).to(dot_dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 2 * HALF], tl.float32)

    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    start = pid_s * keys_per_split
    end = tl.minimum(start + keys_per_split, n_keys)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        key_ok = j < end
        slot = tl.load(SLOTS + j, mask=key_ok, other=0).to(tl.int64)
        kv_pos = tl.load(KV_POS + j, mask=key_ok, other=0)
        k_cos, k_sin = rope_cos_sin(kv_pos, inv_freq, FAST_TRIG)  # [BLOCK_N, HALF] each
        k_ptr = k_base + slot[:, None] * stride_ks + d[None, :]
        k1 = tl.load(k_ptr, mask=key_ok[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(k_ptr + HALF, mask=key_ok[:, None], other=0.0).to(tl.float32)
        kr1 = (k1 * k_cos - k2 * k_sin).to(dtype).to(dot_dtype)
        kr2 = (k2 * k_cos + k1 * k_sin).to(dtype).to(dot_dtype)
        scores = tl.dot(qr1, tl.trans(kr1), input_precision=PRECISION)
        scores = tl.dot(qr2, tl.trans(kr2), scores, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        visible = key_ok[None, :] & row_ok[:, None] & (kv_pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: exp2(-inf) = 0
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + dd[None, :], mask=key_ok[:, None], other=0.0)
        p = p.to(dtype).to(dot_dtype)
        acc = tl.dot(p, v.to(dot_dtype), acc * alpha[:, None], input_precision=PRECISION)  # [BLOCK_M, D]
        m_i = m_new

    seen = l_i > 0.0
    inv_l = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    row_idx = ((b * n_kv_heads * GROUP + head) * n_tokens + tok).to(tl.int64)  # row in [B, Hq, T]
    if SPLIT:
        n_rows = tl.num_programs(1) * GROUP * n_tokens
        row_idx += pid_s.to(tl.int64) * n_rows
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(LSE + row_idx, lse, mask=row_ok)
    o_ptr = OUT + row_idx[:, None] * (2 * HALF) + dd[None, :]
    tl.store(o_ptr, (acc * inv_l[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_kernel(
    PART,  # *Pointer* to float32 partial outputs [splits, rows, D], each normalised by its own sum
    LSE,  # *Pointer* to float32 log2-sum-exp of each partial [splits, rows]; -inf where a split saw nothing
    OUT,  # *Pointer* to out [rows, D] contiguous
    n_rows,
    n_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # next power of two >= n_splits
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS_P2)
    s_ok = s < n_splits
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(LSE + s * n_rows + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [SPLITS_P2]; 0 for empty splits
    total = tl.sum(w, 0)
    part = tl.load(PART + (s[:, None] * n_rows + row) * HEAD_DIM + d[None, :], mask=s_ok[:, None], other=0.0)
    acc = tl.sum(part * w[:, None], 0)  # [HEAD_DIM]
    inv_total = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
    tl.store(OUT + row * HEAD_DIM + d, (acc * inv_total).to(OUT.dtype.element_ty))


@dataclass(frozen=True)
class LaunchPlan:
    """Tile sizes and split count for one call. ``keys_per_split`` is a multiple of ``block_n``."""

    block_m: int
    block_n: int
    splits: int
    keys_per_split: int
    num_warps: int
    num_stages: int


# (float32?, head dim, rows per tile) -> (keys per tile, warps, pipeline stages). Picked from offline sm_80/sm_90
# compiles: every entry is free of register spills (float32 tiles hold twice the registers, hence fewer keys).
TILES = {
    (False, 64, 16): (64, 4, 3), (False, 64, 32): (64, 4, 3), (False, 64, 64): (64, 4, 3),
    (False, 128, 16): (64, 4, 3), (False, 128, 32): (64, 4, 3), (False, 128, 64): (64, 8, 2),
    (True, 64, 16): (32, 4, 3), (True, 64, 32): (32, 4, 3), (True, 64, 64): (32, 8, 2),
    (True, 128, 16): (32, 4, 3), (True, 128, 32): (32, 8, 2), (True, 128, 64): (16, 8, 2),
}


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_launch(
    dims: AttentionDims, device: torch.device, dtype: torch.dtype, *, num_splits: int | None = None
) -> LaunchPlan:
    """Choose tiles and split-K for ``dims`` on ``device``.

    Up to 16 packed rows (``T * G``; decode) take a 16-row tile, up to 32 a 32-row tile, more 64-row tiles;
    keys per tile, warps and stages come from ``TILES``. Without an explicit ``num_splits``, a CUDA launch
    with fewer than 8 programs per SM is split over keys (each split keeps at least 4 key tiles); CPU
    launches (interpreter) are not split.
    """
    rows = dims.tokens * dims.group
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n, num_warps, num_stages = TILES[(dtype == torch.float32, dims.head_dim, block_m)]
    programs = triton.cdiv(rows, block_m) * dims.batch * dims.kv_heads
    key_tiles = max(1, triton.cdiv(dims.keys, block_n))
    if num_splits is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            wanted = triton.cdiv(8 * _sm_count(index), programs)
            num_splits = max(1, min(wanted, key_tiles // 4, MAX_SPLITS))
        else:
            num_splits = 1
    elif num_splits < 1:
        raise ValueError(f"`num_splits` must be >= 1 or None, got {num_splits}")
    tiles_per_split = triton.cdiv(key_tiles, min(num_splits, key_tiles))
    splits = triton.cdiv(key_tiles, tiles_per_split)  # no empty trailing split
    return LaunchPlan(block_m, block_n, splits, tiles_per_split * block_n, num_warps, num_stages)


def chunked_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_pos: torch.Tensor,
    q_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of new queries over the keys a slot list picks from one store, RoPE fused (Triton).

    Same contract as ``attention_ref.chunked_attention`` (see there for every argument); in addition
    ``num_splits`` forces the number of key ranges for split-K (``None`` = ``plan_launch``'s choice).
    Requires what ``vla_kernels.supports`` checks (CUDA, or CPU through Triton's interpreter for tests;
    head dim 64 or 128; float32/float16/bfloat16; contiguous last dimensions).

    Returns:
        [B, Hq, T, D] in q's dtype (``out`` if given).
    """
    dims = check_attention_args(q, k_store, v_store, kv_slots, kv_pos, q_pos, inv_freq)
    check_out(out, q)
    reasons = supports_config(q.device, q.dtype, dims.head_dim) + strided_reasons(q=q, k_store=k_store, v_store=v_store)
    if reasons:
        raise ValueError("the Triton chunked_attention cannot run these inputs: " + "; ".join(reasons))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.numel() == 0:
        return out
    if dims.keys == 0:
        return out.zero_()
    plan = plan_launch(dims, q.device, q.dtype, num_splits=num_splits)
    scale = 1.0 / math.sqrt(dims.head_dim) if scale is None else scale
    rows = dims.batch * dims.q_heads * dims.tokens
    if plan.splits > 1:
        target = torch.empty((plan.splits, rows, dims.head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((plan.splits, rows), dtype=torch.float32, device=q.device)
    else:
        target, lse = out, out  # LSE is never touched without SPLIT
    grid = (triton.cdiv(dims.tokens * dims.group, plan.block_m), dims.batch * dims.kv_heads, plan.splits)
    _attention_kernel[grid](
        q, k_store, v_store, kv_slots.contiguous(), kv_pos.contiguous(), q_pos.contiguous(), inv_freq.contiguous(),
        target, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_store.stride(0), k_store.stride(1), k_store.stride(2),
        v_store.stride(0), v_store.stride(1), v_store.stride(2),
        dims.kv_heads, dims.tokens, dims.keys, plan.keys_per_split,
        scale * LOG2E,
        GROUP=dims.group, HALF=dims.head_dim // 2, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        SPLIT=plan.splits > 1,
        DOT_F32=interpreted(_attention_kernel) and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FAST_TRIG=not interpreted(_attention_kernel),
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if plan.splits > 1:
        _combine_kernel[(rows,)](
            target, lse, out, rows, plan.splits, HEAD_DIM=dims.head_dim, SPLITS_P2=triton.next_power_of_2(plan.splits)
        )
    return out
