"""RowsCache: one forward over several sessions' caches, row ``i`` of the batch going to ``caches[i]``.

The model runs its projections, MLPs and head on the whole batch ``[B, T, dim]``; the rows' histories differ
(lengths, retained chunks, positions), and each cache keeps its own: it plans the forward, stores the new
tokens and compresses as it would alone (``attend`` per layer, then ``end_forward``). All rows of one forward
carry the same number ``T`` of new tokens.

Attention itself runs batched when every cache offers the ``RowSeam`` (``row_batching``): each cache lays its
keys out in attention order at positions ``0 .. n-1``, so the ``RowsCache`` keeps, per layer, one padded copy
``[B, Hkv, Lmax, D]`` of every row's rotated keys and values (``PaddedRows``), appends the new tokens to it
and runs one attention call per group of rows holding the same number of keys. The copy of a row is taken once (from the cache's own
rotated keys) and again only when that row's layout changes (a compression); a ``RowsCache`` lives for one
batched step, and its caches must not run forwards of their own meanwhile. Otherwise (a Triton-backed
cache) attention is routed row by row to each cache's ``attend``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import block_attention, causal_attention
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
        self._padded: dict[int, PaddedRows] = {}  # per layer
        self._new: list[tuple[torch.Tensor, ...]] = []  # this forward's (k_raw, k_rot, v) per layer, [B, Hkv, T, D]

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] with ``B == len(caches)``. Returns [B, Hq, T, D]."""
        if q.shape[0] != len(self.caches):
            raise ValueError(f"batch of {q.shape[0]} rows for {len(self.caches)} caches")
        if not self.batched:
            rows = [c.attend(layer, q[i : i + 1], k_raw[i : i + 1], v[i : i + 1]) for i, c in enumerate(self.caches)]
            return torch.cat(rows, dim=0)  # [B, Hq, T, D]
        t = q.shape[2]
        plans = [c.row_plan(layer, t) for c in self.caches]
        cos = torch.stack([p.cos for p in plans]).unsqueeze(1)  # [B, 1, T, D]
        sin = torch.stack([p.sin for p in plans]).unsqueeze(1)
        k_rot = apply_rope(k_raw, cos, sin)  # [B, Hkv, T, D]
        self._new.append((k_raw, k_rot, v))
        if layer not in self._padded:
            self._padded[layer] = PaddedRows(len(self.caches), k_raw)
        padded = self._padded[layer]
        padded.update(self.caches, layer, plans, k_rot, v)
        return padded.attend(apply_rope(q, cos, sin), plans)

    def end_forward(self, *, pin: bool = False) -> None:
        """Each row's cache stores its new tokens of every layer, then ends the forward as alone."""
        if self._new:
            k_raw, k_rot, v = (torch.stack(x) for x in zip(*self._new))  # [L, B, Hkv, T, D]
            self._new.clear()
            for i, cache in enumerate(self.caches):
                cache.row_commit(k_raw[:, i : i + 1], k_rot[:, i : i + 1], v[:, i : i + 1])
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


class PaddedRows:
    """One layer's rotated keys and values of every row, padded to the longest: ``k, v: [B, Hkv, cap, D]``,
    row ``i`` valid in ``[0, n[i])`` (attention reads no further).

    Args:
        rows: B. like: a [B, Hkv, T, D] tensor giving heads, head dim, dtype and device.
    """

    def __init__(self, rows: int, like: torch.Tensor) -> None:
        self.k = like.new_empty(rows, like.shape[1], 0, like.shape[3])
        self.v = torch.empty_like(self.k)
        self.n = [0] * rows
        self.version = [-1] * rows  # the layout version each row's copy was taken at; -1: none yet

    def _reserve(self, length: int) -> None:
        """Room for ``length`` keys per row and a few decoded tokens beyond (the copies kept)."""
        cap = self.k.shape[2]
        if length <= cap:
            return
        shape = (*self.k.shape[:2], length + 16, self.k.shape[3])
        k, v = self.k.new_empty(shape), self.v.new_empty(shape)
        k[:, :, :cap], v[:, :, :cap] = self.k, self.v
        self.k, self.v = k, v

    def update(self, caches: Sequence[KVCache], layer: int, plans: list[RowPlan], k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Bring every row to its plan: copy a row's held keys again when its layout changed (or it is new), then
        write the new tokens. k_rot (rotated by the plans' tables), v: [B, Hkv, T, D]."""
        t = k_rot.shape[2]
        self._reserve(max(p.n_keys for p in plans))
        held = [p.n_keys - t for p in plans]
        for i, (cache, plan) in enumerate(zip(caches, plans)):
            if self.version[i] != plan.version or self.n[i] < held[i]:
                k_held, v_held = cache.row_held(layer, held[i])  # [1, Hkv, held, D]
                self.k[i, :, : held[i]], self.v[i, :, : held[i]] = k_held[0], v_held[0]
                self.version[i] = plan.version
            self.n[i] = plan.n_keys
        if len(set(held)) == 1:  # one slice for every row
            self.k[:, :, held[0] : held[0] + t], self.v[:, :, held[0] : held[0] + t] = k_rot, v
            return
        for i, h in enumerate(held):  # cheaper than an advanced-index write for a handful of rows
            self.k[i, :, h : h + t], self.v[i, :, h : h + t] = k_rot[i], v[i]

    def attend(self, q: torch.Tensor, plans: list[RowPlan]) -> torch.Tensor:
        """q: [B, Hq, T, D] rotated by the plans' tables -> [B, Hq, T, D].

        Rows that see the same number of keys (and attend the same way) share one attention call over the padded
        copy, computed exactly as each of their caches alone computes it. (One call over all rows behind a
        key-padding mask rounds the softmax's blocks differently, by about an ulp, and was no faster on CPU.)
        """
        t = q.shape[2]
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, p in enumerate(plans):
            groups.setdefault((p.n_keys, p.causal), []).append(i)
        if len(groups) == 1:
            return self._attend_group(q, slice(None), *next(iter(groups)), t)
        out = torch.empty_like(q)
        for (n, causal), rows in groups.items():
            if rows[-1] - rows[0] == len(rows) - 1:  # consecutive rows: views, no copy
                sel = slice(rows[0], rows[-1] + 1)
                out[sel] = self._attend_group(q, sel, n, causal, t)
            else:
                idx = torch.tensor(rows, device=q.device)
                out.index_copy_(0, idx, self._attend_group(q, idx, n, causal, t))
        return out

    def _attend_group(self, q: torch.Tensor, rows: slice | torch.Tensor, n: int, causal: bool, t: int) -> torch.Tensor:
        """The rows ``rows`` (a slice or [G] long), all with ``n`` keys -> [G, Hq, T, D]."""
        if isinstance(rows, slice):
            q, k, v = q[rows], self.k[rows, :, :n], self.v[rows, :, :n]
        else:
            q, k, v = q.index_select(0, rows), self.k[:, :, :n].index_select(0, rows), self.v[:, :, :n].index_select(0, rows)
        return causal_attention(q, k, v, past=n - t) if causal else block_attention(q, k, v)
