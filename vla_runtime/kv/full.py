"""FullCache: stock behaviour, the reference every other cache is tested against.

Keys are rotated on write at their absolute positions 0, 1, 2, ... (positions never shift, so
rotated copies are stored). Buffers are preallocated; new tokens are written by slice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import causal_attention
from .base import KVStats, kv_bytes
from .rope import apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from ..models.llama import LlamaConfig


class FullCache:
    """Every token kept, absolute positions. Buffers ``k, v: [L, B, Hkv, capacity, D]``."""

    def __init__(
        self,
        model_cfg: "LlamaConfig",
        *,
        capacity: int | None = None,
        batch: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg = model_cfg
        self.capacity = capacity or model_cfg.max_position
        shape = (model_cfg.n_layers, batch, model_cfg.n_kv_heads, self.capacity, model_cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self._pending = 0
        self._cos = self._sin = None

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        if self._cos is None:  # first layer of this forward: positions once for all layers
            end = self.length + t
            if end > self.capacity:
                raise ValueError(
                    f"FullCache is full: {self.length} tokens held + {t} new > capacity {self.capacity}; "
                    "raise KVConfig.capacity or use mode='chunked'"
                )
            pos = torch.arange(self.length, end, device=q.device)
            self._cos, self._sin = rope_cos_sin(pos, self.cfg.rope)
            self._pending = t
        start, end = self.length, self.length + t
        self.k[layer, :, :, start:end] = apply_rope(k_raw, self._cos, self._sin)
        self.v[layer, :, :, start:end] = v
        q = apply_rope(q, self._cos, self._sin)
        return causal_attention(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], past=start)

    def end_forward(self, *, pin: bool = False) -> None:
        self.length += self._pending
        self._pending = 0
        self._cos = self._sin = None

    def mark(self) -> int:
        return self.length

    def rollback(self, mark: int) -> None:
        if not 0 <= mark <= self.length:
            raise ValueError(f"mark {mark} is outside the {self.length} tokens held")
        self.length = mark

    def stats(self) -> KVStats:
        return KVStats(
            tokens_raw=self.length,
            bytes=kv_bytes(
                self.length,
                n_layers=self.cfg.n_layers,
                n_kv_heads=self.cfg.n_kv_heads,
                head_dim=self.cfg.head_dim,
                batch=self.k.shape[1],
                dtype=self.k.dtype,
            ),
            positions_used=self.length,
            tokens_seen=self.length,
        )

    def reset(self) -> None:
        self.length = 0
        self._pending = 0
        self._cos = self._sin = None
