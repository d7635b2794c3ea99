"""Argument checks shared by every kernel and its torch reference (contract 4 of the team brief).

These raise ``ValueError`` for inputs that are wrong for *any* implementation (mismatched shapes, float
indices, ...). Whether the Triton kernel can run a valid input is a different question, answered by
``vla_kernels.supports`` with a list of reasons.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class AttentionDims:
    """Sizes of one ``chunked_attention`` call: batch, query/kv heads, new tokens, head dim, keys, store slots."""

    batch: int
    q_heads: int
    kv_heads: int
    tokens: int
    head_dim: int
    keys: int
    slots: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (GQA ratio)."""
        return self.q_heads // self.kv_heads


def _shape(name: str, t: torch.Tensor, ndim: int, what: str) -> None:
    if t.ndim != ndim:
        raise ValueError(f"`{name}` must be {what}, got shape {tuple(t.shape)}")


def _index(name: str, t: torch.Tensor, length: int, what: str) -> None:
    _shape(name, t, 1, what)
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"`{name}` must be int32 (or int64), got {t.dtype}")
    if t.shape[0] != length:
        raise ValueError(f"`{name}` has {t.shape[0]} entries; expected {length} ({what})")


def check_inv_freq(inv_freq: torch.Tensor, head_dim: int) -> None:
    """inv_freq: [D/2] float32."""
    if inv_freq.ndim != 1 or inv_freq.shape[0] * 2 != head_dim:
        raise ValueError(f"`inv_freq` must be [head_dim/2] = [{head_dim // 2}], got shape {tuple(inv_freq.shape)}")
    if inv_freq.dtype != torch.float32:
        raise ValueError(f"`inv_freq` must be float32, got {inv_freq.dtype}")


def check_attention_args(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_pos: torch.Tensor,
    q_pos: torch.Tensor,
    inv_freq: torch.Tensor,
) -> AttentionDims:
    """Validate a ``chunked_attention`` call and return its sizes.

    q: [B, Hq, T, D]; k_store, v_store: [B, Hkv, S, D]; kv_slots, kv_pos: [N]; q_pos: [T]; inv_freq: [D/2].
    """
    _shape("q", q, 4, "[B, Hq, T, D]")
    _shape("k_store", k_store, 4, "[B, Hkv, S, D]")
    if v_store.shape != k_store.shape:
        raise ValueError(f"`v_store` shape {tuple(v_store.shape)} differs from `k_store` shape {tuple(k_store.shape)}")
    b, hq, t, d = q.shape
    bk, hkv, s, dk = k_store.shape
    if (bk, dk) != (b, d):
        raise ValueError(f"`k_store` is [B={bk}, Hkv, S, D={dk}] but `q` is [B={b}, Hq, T, D={d}]; B and D must match")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if d % 2:
        raise ValueError(f"head dim must be even for RoPE, got {d}")
    if not (q.dtype == k_store.dtype == v_store.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k_store, v_store must share one float dtype, got {q.dtype}, {k_store.dtype}, {v_store.dtype}")
    n = kv_slots.shape[0] if kv_slots.ndim == 1 else -1
    _index("kv_slots", kv_slots, n, "[N] slot indices into the store")
    _index("kv_pos", kv_pos, n, "[N] positions, one per kv_slots entry")
    _index("q_pos", q_pos, t, "[T] positions, one per query token")
    check_inv_freq(inv_freq, d)
    devices = {x.device for x in (q, k_store, v_store, kv_slots, kv_pos, q_pos, inv_freq)}
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(x) for x in devices)}")
    return AttentionDims(batch=b, q_heads=hq, kv_heads=hkv, tokens=t, head_dim=d, keys=n, slots=s)


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> None:
    """out: None, or a contiguous tensor of q's shape, dtype and device to write the result into."""
    if out is not None and (
        out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous()
    ):
        raise ValueError(
            f"`out` must be a contiguous {tuple(q.shape)} {q.dtype} tensor on {q.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )


def check_rope_args(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """x: [B, H, T, D] float; pos: [T] int; inv_freq: [D/2] float32 on x's device."""
    _shape("x", x, 4, "[B, H, T, D]")
    if not x.is_floating_point():
        raise ValueError(f"`x` must be a float tensor, got {x.dtype}")
    if x.shape[-1] % 2:
        raise ValueError(f"head dim must be even for RoPE, got {x.shape[-1]}")
    _index("pos", pos, x.shape[2], "[T] positions, one per token of x")
    check_inv_freq(inv_freq, x.shape[-1])
    if not (x.device == pos.device == inv_freq.device):
        raise ValueError(f"x, pos, inv_freq must be on one device, got {x.device}, {pos.device}, {inv_freq.device}")
