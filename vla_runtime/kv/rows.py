"""RowsCache: one forward over several sessions' caches, row ``i`` of the batch going to ``caches[i]``.

The model runs its projections, MLPs and head on the whole batch ``[B, T, dim]``; attention, which is the
only place the rows' histories differ (lengths, retained chunks, positions), is routed row by row to each
session's own cache. So sessions whose caches hold different lengths or layouts step together, and each
cache sees exactly the calls it would see alone (``attend`` per layer, then ``end_forward``). All rows of one
forward carry the same number ``T`` of new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import KVCache, KVStats


class RowsCache:
    """Batch row ``i`` -> ``caches[i]`` (each a batch-1 cache).

    Args:
        caches: one cache per batch row, all distinct objects.
    """

    def __init__(self, caches: Sequence[KVCache]) -> None:
        if not caches:
            raise ValueError("RowsCache needs at least one cache")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("RowsCache rows must be distinct caches (one session per row)")
        self.caches = list(caches)
        self._marks: list[list[int]] = []

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] with ``B == len(caches)``. Returns [B, Hq, T, D]."""
        if q.shape[0] != len(self.caches):
            raise ValueError(f"batch of {q.shape[0]} rows for {len(self.caches)} caches")
        rows = [c.attend(layer, q[i : i + 1], k_raw[i : i + 1], v[i : i + 1]) for i, c in enumerate(self.caches)]
        return torch.cat(rows, dim=0)  # [B, Hq, T, D]

    def end_forward(self, *, pin: bool = False) -> None:
        for cache in self.caches:
            cache.end_forward(pin=pin)

    def mark(self) -> int:
        """A mark over every row (an index into the marks taken; ``rollback`` takes it back)."""
        self._marks.append([c.mark() for c in self.caches])
        return len(self._marks) - 1

    def rollback(self, mark: int) -> None:
        if not 0 <= mark < len(self._marks):
            raise ValueError(f"unknown RowsCache mark {mark} ({len(self._marks)} taken)")
        for cache, m in zip(self.caches, self._marks[mark]):
            cache.rollback(m)
        del self._marks[mark:]

    def stats(self) -> KVStats:
        """The rows' stats summed (ratios averaged)."""
        rows = [c.stats() for c in self.caches]
        return KVStats(
            tokens_raw=sum(s.tokens_raw for s in rows),
            tokens_compressed=sum(s.tokens_compressed for s in rows),
            chunks_retained=sum(s.chunks_retained for s in rows),
            chunks_dropped=sum(s.chunks_dropped for s in rows),
            bytes=sum(s.bytes for s in rows),
            positions_used=max(s.positions_used for s in rows),
            retained_ratio=sum(s.retained_ratio for s in rows) / len(rows),
            tokens_seen=sum(s.tokens_seen for s in rows),
        )

    def reset(self) -> None:
        for cache in self.caches:
            cache.reset()
