"""RowsCache: one forward over several sessions' caches, row ``i`` of the batch going to ``caches[i]``.

The model runs its projections, MLPs and head on the whole batch ``[B, T, dim]``; the rows' histories differ
(lengths, retained chunks, positions), and each cache keeps its own: it plans the forward, stores the new
tokens and compresses as it would alone (``attend`` per layer, then ``end_forward``). All rows of one forward
carry the same number ``T`` of new tokens.

Every cache that offers the ``RowSeam`` (``row_batching``) leaves the rest to the ``RowsCache`` too: each lays
its keys out in attention order at positions ``0 .. n-1`` and says where the forward's new tokens sit
(``row_plan``), the ``RowsCache`` rotates every row's new queries and keys in one pass, each cache appends its
row's rotated keys to its own rotated view and attends over it (``row_attend``: one small attention call per
row on keys it holds contiguously, bit for bit what it computes alone), and after the last layer stores the
forward's pre-RoPE keys and values of every layer at once (``row_commit``). So per row and layer only the
append and the attention call are left. (One call for all rows was measured too, ``benchmarks/bench_row_attention.py``:
on a CPU it saves at most ~0.1 ms of a layer's decode, a padded copy of the rows' keys or views kept in one pooled
buffer lose that, and SDPA's output depends on the padded key length, so a row would get what it gets alone only
if alone it padded to the batch's length.) A cache without the seam (a Triton-backed one) makes every row attend
through its own ``attend``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import KVCache, KVStats, RowPlan
from .rope import apply_rope


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
        self.batched = all(getattr(c, "row_batching", False) for c in self.caches)
        self._new: list[tuple[torch.Tensor, torch.Tensor]] = []  # this forward's (k_raw, v) per layer, [B, Hkv, T, D]
        self._tables: tuple[list[RowPlan], torch.Tensor, torch.Tensor] | None = None  # plans, cos, sin of the last layer

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] with ``B == len(caches)``. Returns [B, Hq, T, D]."""
        if q.shape[0] != len(self.caches):
            raise ValueError(f"batch of {q.shape[0]} rows for {len(self.caches)} caches")
        if not self.batched:
            rows = [c.attend(layer, q[i : i + 1], k_raw[i : i + 1], v[i : i + 1]) for i, c in enumerate(self.caches)]
            return torch.cat(rows, dim=0)  # [B, Hq, T, D]
        t = q.shape[2]
        plans = [c.row_plan(layer, t) for c in self.caches]
        if self._tables is None or any(a is not b for a, b in zip(plans, self._tables[0])):  # else: as the last layer
            cos = torch.stack([p.cos for p in plans]).unsqueeze(1)  # [B, 1, T, D]
            self._tables = plans, cos, torch.stack([p.sin for p in plans]).unsqueeze(1)
        _, cos, sin = self._tables
        k_rot, q_rot = apply_rope(k_raw, cos, sin), apply_rope(q, cos, sin)  # [B, Hkv, T, D], [B, Hq, T, D]
        self._new.append((k_raw, v))
        rows = [c.row_attend(layer, q_rot[i : i + 1], k_rot[i : i + 1], v[i : i + 1]) for i, c in enumerate(self.caches)]
        return torch.cat(rows, dim=0)  # [B, Hq, T, D]

    def end_forward(self, *, pin: bool = False) -> None:
        """Each row's cache stores its new tokens of every layer, then ends the forward as alone, or with the
        other rows of its type where the type offers ``end_forward_rows`` (the chunked cache runs the chunks
        every row forms through the gate in one pass)."""
        self._tables = None
        if self._new:
            k_raw, v = (torch.stack(x) for x in zip(*self._new))  # [L, B, Hkv, T, D]
            self._new.clear()
            for i, cache in enumerate(self.caches):
                cache.row_commit(k_raw[:, i : i + 1], v[:, i : i + 1])
        by_type: dict[type, list] = {}
        for cache in self.caches:  # a cache type may end its rows together (``end_forward_rows``)
            by_type.setdefault(type(cache), []).append(cache)
        for kind, caches in by_type.items():
            ends = getattr(kind, "end_forward_rows", None)
            if ends is not None:
                ends(caches, pin=pin)
            else:
                for cache in caches:
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
        """Every row's cache forgets its episode, and the marks taken over them are gone."""
        for cache in self.caches:
            cache.reset()
        self._marks.clear()
        self._new.clear()
        self._tables = None
