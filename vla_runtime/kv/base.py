"""The KV seam: the protocol every cache implements, and the stats it reports.

The decoder computes q/k/v (k *before* RoPE) and calls ``cache.attend(layer, q, k, v)``;
the cache stores, assigns positions, applies RoPE and computes attention (DESIGN §3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class KVStats:
    """What a cache holds after the last forward.

    Args:
        tokens_raw: uncompressed tokens held (pinned prefix + raw window + pending raw), per layer.
        tokens_compressed: chunk representatives held, averaged over layers.
        chunks_retained: chunks kept, summed over layers.
        chunks_dropped: chunks dropped by the gate or evicted by the budget, summed over layers.
        bytes: bytes of K/V actually held (valid entries only, all layers).
        positions_used: largest position id used so far + 1 (must stay below the model's limit).
        retained_ratio: retained / (retained + dropped) chunks; 1.0 when nothing was chunked.
        tokens_seen: tokens appended since the last reset.
    """

    tokens_raw: int = 0
    tokens_compressed: float = 0.0
    chunks_retained: int = 0
    chunks_dropped: int = 0
    bytes: int = 0
    positions_used: int = 0
    retained_ratio: float = 1.0
    tokens_seen: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@runtime_checkable
class KVCache(Protocol):
    """Protocol of every cache. Shapes: ``B`` batch, ``Hq``/``Hkv`` heads, ``T`` new tokens, ``D`` head dim."""

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store new k/v for ``layer``, rotate q and keys with the cache's positions, attend.

        q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] (k without RoPE). Returns [B, Hq, T, D].
        New tokens attend causally among themselves and to everything the cache shows them.
        """
        ...

    def end_forward(self, *, pin: bool = False) -> None:
        """Called once after all layers ran a forward: commit the new tokens, compress/evict.

        ``pin=True`` pins everything held so far (the prompt): it is never compressed or evicted.
        """
        ...

    def mark(self) -> int:
        """Open a mark: a token count to ``rollback`` to. Nothing held changes while it is open (compressing
        caches defer compression until ``rollback`` closes it), so the rollback is exact. Take a new mark
        before each attempt you will roll back (HybridVLA: ``m = cache.mark()`` in every denoising step)."""
        ...

    def rollback(self, mark: int) -> None:
        """Drop every token appended after ``mark`` and close the open mark. A mark older than the last
        compression raises ``ValueError``."""
        ...

    def stats(self) -> KVStats: ...

    def reset(self) -> None:
        """Forget the episode (tokens, gate state); weights are untouched."""
        ...


def kv_bytes(n_tokens: int, *, n_layers: int, n_kv_heads: int, head_dim: int, batch: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for ``n_tokens`` tokens in every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * n_tokens * n_layers * n_kv_heads * head_dim * batch * itemsize
