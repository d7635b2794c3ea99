"""KEEP's multi-hop importance: which memory segments to keep recomputing at the next layer.

From one layer's attention:
  * ``query``: attention of the last query rows to each segment (heads and rows averaged, the
    segment's leading sink tokens left out) -- the initial importance;
  * ``cross``: attention between segments (the last rows of segment i to the tokens of segment j,
    same reduction), only among segments recomputed at this layer (only they have fresh rows).
Propagation: take the top-``keep`` segments as the relevant set, then re-score every segment as
its query importance plus ``hop_weight`` times the importance-weighted average of the relevant
set's cross-attention to it (in either direction, since causality lets only the later of two
segments attend to the earlier); repeat until the relevant set stops changing (at most ``hops``
rounds). A segment a relevant segment leans on therefore becomes relevant too (query -> key -> table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentAttention:
    """query: [N] attention mass from the query to each candidate segment.
    cross: [N, N] mass from candidate i's last rows to candidate j's tokens (0 where j is after i)."""

    query: torch.Tensor
    cross: torch.Tensor

    def __post_init__(self) -> None:
        n = self.query.shape[0]
        if self.cross.shape != (n, n):
            raise ValueError(f"`cross` must be [{n}, {n}] for {n} segments, got {tuple(self.cross.shape)}")


def _normalise(x: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return x / total if total > 0 else torch.full_like(x, 1.0 / max(1, x.numel()))


def _top(score: torch.Tensor, keep: int) -> frozenset[int]:
    # stable tie-break by index so the selection is deterministic
    order = sorted(range(score.numel()), key=lambda i: (-float(score[i]), i))
    return frozenset(order[:keep])


def propagate_importance(attention: SegmentAttention, keep: int, *, hops: int, hop_weight: float) -> tuple[list[int], torch.Tensor]:
    """Indices (ascending) of the ``keep`` most important segments and their final scores [N]."""
    n = attention.query.numel()
    if keep >= n:
        return list(range(n)), attention.query
    if keep <= 0:
        return [], attention.query
    q = _normalise(attention.query.double().clamp_min(0))
    cross = attention.cross.double().clamp_min(0)
    cross = cross + cross.T  # either direction of a link between two segments
    cross.fill_diagonal_(0)
    score = q
    selected = _top(score, keep)
    for _ in range(hops):
        idx = torch.tensor(sorted(selected))
        w = _normalise(score[idx])  # [k] importance of the relevant set
        spread = _normalise((w[:, None] * cross[idx]).sum(0))  # [N]
        score = q + hop_weight * spread
        new = _top(score, keep)
        if new == selected:
            break
        selected = new
    return sorted(selected), score.float()


def reduce_attention(
    probs: torch.Tensor, row_groups: list[torch.Tensor], col_spans: list[tuple[int, int]], *, sink_tokens: int
) -> torch.Tensor:
    """Segment-level attention from token-level probabilities.

    probs: [R, S] (heads already averaged); row_groups: per source group the indices into R of its
    rows; col_spans: per target segment its ``[start, end)`` columns. Returns [G, N]: for each
    source group the mean over its rows of the mass on each target segment, leaving out the first
    ``sink_tokens`` of each target (kept if the segment is that short).
    """
    cols = torch.zeros(len(col_spans), probs.shape[1], dtype=probs.dtype, device=probs.device)  # [N, S]
    for j, (a, b) in enumerate(col_spans):
        start = a + sink_tokens if b - a > sink_tokens else a
        cols[j, start:b] = 1.0
    per_col = probs @ cols.T  # [R, N]
    return torch.stack([per_col[g].mean(0) for g in row_groups])  # [G, N]
