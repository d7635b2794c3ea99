"""Attention over keys/values a cache holds (torch reference path, SDPA).

Caches decide *which* keys a query sees and at which positions; this module only turns
rotated q/k/v plus a visibility rule into outputs. GQA is handled by SDPA's ``enable_gqa``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``q`` [B, Hq, ...] has more heads than ``k`` [B, Hkv, ...] (SDPA's ``enable_gqa``), as a plain bool:
    the branch makes ``torch.compile`` guard on the head counts under dynamic shapes, where the comparison would
    be a ``SymBool`` that SDPA rejects (torch 2.11: a graph break in every layer)."""
    if q.shape[1] == k.shape[1]:
        return False
    return True


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, past: int, key_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention where the last ``T`` keys are the queries' own tokens (causal among them).

    q: [B, Hq, T, D] rotated; k, v: [B, Hkv, past + T, D] (k rotated). Returns [B, Hq, T, D].
    Query i sees keys ``0 .. past + i``. ``key_bias``: [past + T] added to every query's score of each key.
    """
    t = q.shape[2]
    gqa = grouped(q, k)
    if key_bias is not None:
        q_idx = torch.arange(t, device=q.device)[:, None] + past  # [T, 1]
        k_idx = torch.arange(k.shape[2], device=q.device)[None, :]  # [1, S]
        bias = key_bias.to(q.dtype)[None, :].masked_fill(k_idx > q_idx, float("-inf"))  # [T, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    s = k.shape[2]
    q_idx = torch.arange(t, device=q.device)[:, None] + past  # [T, 1]
    k_idx = torch.arange(s, device=q.device)[None, :]  # [1, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=k_idx <= q_idx, enable_gqa=gqa)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention where every query sees every key: held keys and the queries' own block both ways.

    q: [B, Hq, T, D] rotated; k, v: [B, Hkv, S, D] (k rotated; the last T are the queries' own tokens).
    Returns [B, Hq, T, D]. What a cache's ``bidirectional_block`` forward uses instead of ``causal_attention``.
    ``key_bias``: [S] added to every query's score of each key, or ``None``.
    """
    mask = None if key_bias is None else key_bias.to(q.dtype)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped(q, k))


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention with an explicit visibility mask and optional additive score bias.

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: [T, S] or [B, 1, T, S] bool (True = visible);
    bias: broadcastable to [B, Hq, T, S] (e.g. soft-gate ``log g``). Returns [B, Hq, T, D].
    A query row with no visible key returns zeros rather than NaN.
    """
    gqa = grouped(q, k)
    if bias is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    else:
        neg = torch.finfo(torch.float32).min
        attn_bias = torch.where(mask, bias.float(), torch.full((), neg, device=q.device))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias.to(q.dtype), enable_gqa=gqa)
    return torch.nan_to_num(out, nan=0.0)
