"""Torch reference for ``chunked_attention``: gather the listed slots, rotate, masked SDPA.

The oracle for the Triton kernel in ``attention.py`` and the implementation used on CPU. Rounding matches
the kernel's: q and the gathered keys are rotated in float32 and rounded once to the storage dtype, then
attention runs in that dtype (SDPA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_attention_args, check_out
from .rope_ref import rope_angles, rotate


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
) -> torch.Tensor:
    """Attention of new queries over the keys a slot list picks from one store, RoPE applied on the fly.

    Args:
        q: [B, Hq, T, D] queries before RoPE.
        k_store, v_store: [B, Hkv, S, D]; keys before RoPE. ``Hq`` is a multiple of ``Hkv`` (GQA).
        kv_slots: [N] int32 slots into S, in attention order (pinned prefix, retained chunks, raw tokens).
        kv_pos: [N] int32 position of each listed key (keys are rotated at these positions).
        q_pos: [T] int32 position of each query (queries are rotated at these positions).
        inv_freq: [D/2] float32 RoPE inverse frequencies (``vla_runtime.kv.rope.inv_freq``).
        scale: score scale; ``None`` = ``1/sqrt(D)``.
        out: optional [B, Hq, T, D] tensor in q's dtype to write the result into.

    Returns:
        [B, Hq, T, D] in q's dtype. Key j is visible to query i iff ``kv_pos[j] <= q_pos[i]``;
        a query that sees no key gets zeros.
    """
    dims = check_attention_args(q, k_store, v_store, kv_slots, kv_pos, q_pos, inv_freq)
    check_out(out, q)
    if dims.keys == 0:
        result = torch.zeros_like(q)
    else:
        idx = kv_slots.long()
        low, high = int(idx.min()), int(idx.max())  # the reference may sync; the Triton kernel trusts its caller's slots
        if low < 0 or high >= dims.slots:
            raise ValueError(f"`kv_slots` holds {low if low < 0 else high}; expected slot indices in [0, {dims.slots}) of the store")
        k = k_store.index_select(2, idx)  # [B, Hkv, N, D]
        v = v_store.index_select(2, idx)  # [B, Hkv, N, D]
        q_rot = rotate(q, *rope_angles(q_pos, inv_freq))  # [B, Hq, T, D]
        k_rot = rotate(k, *rope_angles(kv_pos, inv_freq))  # [B, Hkv, N, D]
        visible = kv_pos[None, :] <= q_pos[:, None]  # [T, N]
        result = F.scaled_dot_product_attention(
            q_rot, k_rot, v, attn_mask=visible, scale=scale, enable_gqa=dims.group > 1
        )  # [B, Hq, T, D]
        result = torch.where(visible.any(dim=1)[:, None], result, torch.zeros((), dtype=q.dtype, device=q.device))
    if out is None:
        return result
    out.copy_(result)
    return out
