"""Every segment of the parallel form in one attention call (segments padded and stacked as a batch).

A segment's queries see ``pinned | the chunks formed before it | its raw tokens``, at compacted positions
that depend on the segment (``chunked_parallel``). Running the segments one by one costs a few dozen
small ops per segment and layer: a 150-step episode has ~150 segments, so the Python and dispatch
overhead dominated the forward and the backward. Here the per-segment index tables are built once per
schedule (``SegmentTables``); per layer the keys of every segment are gathered into one padded block
``[B * S, Hkv, P + n + R, D]``, rotated at their positions and attended in one masked SDPA call.

Padding to the longest segment and to every chunk of the episode would do ~5x the real work (segments
run from 1 to ~90 query tokens, and early ones see few chunks), so segments are first grouped
(``group_segments``): by how many chunks precede them (``CHUNK_GROUPS`` bands) and by length (``LENGTH_CLASSES``).
Each group pads only to its own longest segment and its own chunk count: about 20 calls per layer.

Padding: query slots past a segment's end repeat its last query (their outputs are discarded, and every
real query sees at least its own key, so no row is empty); raw-key slots past the segment's end and
pinned slots past its pinned count are masked.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .attention import masked_attention
from .rope import apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from .chunked_parallel import ForwardSchedule
    from .chunked_parallel import Segment
    from .rope import RopeConfig

CHUNK_GROUPS = 8  # bands of "chunks formed before the segment"
LENGTH_CLASSES = (8, 56)  # segment lengths <= 8, <= 56, longer


def group_segments(segments: Sequence["Segment"], formed: Sequence[int], n_chunks: int) -> list[list[int]]:
    """Segment indices grouped so that each group pads little: same band of preceding chunks, same length class."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (seg, c) in enumerate(zip(segments, formed)):
        key = (c * CHUNK_GROUPS // (n_chunks + 1), bisect.bisect_left(LENGTH_CLASSES, seg.end - seg.start))
        groups.setdefault(key, []).append(i)
    return [groups[k] for k in sorted(groups)]


@dataclass(frozen=True)
class SegmentTables:
    """Padded index tables of S segments of a schedule (one group; shared by every layer).

    Args:
        segments: [S] long, the segments' indices in the schedule.
        n_chunks: chunks the group's keys include (the most any of its segments can see).
        q_idx: [S, Tm] token of each query slot (padding repeats the segment's last token).
        q_valid: [S, Tm] bool, real query slots.
        r_idx: [S, Rm] raw key tokens ``head ..`` (padding repeats the last one).
        r_valid: [S, Rm] bool.
        p_valid: [S, Pm] bool, pinned key slots in use (``Pm``: the largest pinned count).
        pinned, head: [S] float, the segment's pinned count and raw head (for positions).
    """

    segments: torch.Tensor
    n_chunks: int
    q_idx: torch.Tensor
    q_valid: torch.Tensor
    r_idx: torch.Tensor
    r_valid: torch.Tensor
    p_valid: torch.Tensor
    pinned: torch.Tensor
    head: torch.Tensor

    @classmethod
    def build(cls, schedule: "ForwardSchedule", formed: list[int], which: list[int], device: torch.device) -> "SegmentTables":
        """Tables of the segments ``which``; formed[i]: chunks formed before segment i."""
        segs = [schedule.segments[i] for i in which]
        t_max = max(s.end - s.start for s in segs)
        r_max = max(s.end - s.head for s in segs)
        p_max = max(s.pinned for s in segs)

        def padded(first: int, end: int, width: int) -> list[int]:
            return [min(first + i, end - 1) for i in range(width)]

        def tensor(rows, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(rows, dtype=dtype, device=device)

        return cls(
            segments=tensor(which),
            n_chunks=max(formed[i] for i in which),
            q_idx=tensor([padded(s.start, s.end, t_max) for s in segs]),
            q_valid=tensor([[i < s.end - s.start for i in range(t_max)] for s in segs], torch.bool),
            r_idx=tensor([padded(s.head, s.end, r_max) for s in segs]),
            r_valid=tensor([[i < s.end - s.head for i in range(r_max)] for s in segs], torch.bool),
            p_valid=tensor([[i < s.pinned for i in range(p_max)] for s in segs], torch.bool).reshape(len(segs), p_max),
            pinned=tensor([s.pinned for s in segs], torch.float32),
            head=tensor([s.head for s in segs], torch.float32),
        )

    @property
    def p_max(self) -> int:
        return self.p_valid.shape[1]


@dataclass(frozen=True)
class SegmentPlan:
    """A schedule's segments in groups (``group_segments``), and the permutation back to token order.

    Args:
        groups: one ``SegmentTables`` per group.
        restore: [N] long, position in the groups' concatenated outputs of each token 0..N-1.
    """

    groups: tuple[SegmentTables, ...]
    restore: torch.Tensor

    @classmethod
    def build(cls, schedule: "ForwardSchedule", formed: list[int], device: torch.device) -> "SegmentPlan":
        """formed[i]: chunks formed before segment i."""
        groups = tuple(
            SegmentTables.build(schedule, formed, which, device)
            for which in group_segments(schedule.segments, formed, schedule.n_chunks)
        )
        tokens = torch.cat([g.q_idx[g.q_valid] for g in groups])  # [N] token of each output row, group order
        return cls(groups, torch.argsort(tokens))


def attend_segments(
    plan: SegmentPlan,
    rope: "RopeConfig",
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rep: torch.Tensor,
    v_rep: torch.Tensor,
    *,
    visible: torch.Tensor,
    shown: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """One layer of the parallel form, every segment (one attention call per group).

    q: [B, Hq, N, D]; k, v: [B, Hkv, N, D] (k pre-RoPE); k_rep, v_rep: [B, Hkv, n, D] chunk representatives;
    visible, shown: [B, S, n] bool (held by streaming / keys of this form; chunks at or past a segment's
    ``formed`` must be False); bias: [B, S, n] score bias of the chunk keys or ``None``.
    Visible chunks sit at ``P + rank``, other shown ones half-way between their visible neighbours.
    Returns [B, Hq, N, D].
    """
    outs = []
    for t in plan.groups:
        seg, c = t.segments, t.n_chunks
        outs.append(
            _attend_group(
                t, rope, q, k, v, k_rep[:, :, :c], v_rep[:, :, :c], visible=visible[:, seg, :c],
                shown=shown[:, seg, :c], bias=None if bias is None else bias[:, seg, :c],
            )
        )  # fmt: skip
    return torch.cat(outs, dim=2)[:, :, plan.restore]


def _attend_group(t: SegmentTables, rope, q, k, v, k_rep, v_rep, *, visible, shown, bias) -> torch.Tensor:
    """``attend_segments`` for one group: its S segments padded into one SDPA call. Shapes as there, with
    S and n the group's; returns [B, Hq, N_group, D] (the group's real queries, in table order)."""
    b, _, _, d = k.shape
    s, pm = t.q_idx.shape[0], t.p_max
    vis = visible.float()
    before = vis.cumsum(-1) - vis  # [B, S, n] visible chunks before each chunk
    c_pos = t.pinned[None, :, None] + before - 0.5 * (1.0 - vis)  # [B, S, n]
    offset = vis.sum(-1) + t.pinned[None] - t.head[None]  # [B, S]: P + K - head
    pin_pos = torch.arange(pm, device=k.device, dtype=torch.float32).expand(b, s, pm)  # [B, S, Pm]
    raw_pos = t.r_idx[None].float() + offset[..., None]  # [B, S, Rm]
    pos = torch.cat((pin_pos, c_pos, raw_pos), dim=-1)  # [B, S, K]
    q_pos = t.q_idx[None].float() + offset[..., None]  # [B, S, Tm]
    ok = torch.cat((t.p_valid.expand(b, s, pm), shown, t.r_valid.expand(b, -1, -1)), dim=-1)  # [B, S, K]

    def gather(x: torch.Tensor, rep: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, S, K, D]
        fixed = torch.cat((x[:, :, :pm], rep), dim=2)[:, :, None].expand(-1, -1, s, -1, -1)  # [B, Hkv, S, Pm + n, D]
        return torch.cat((fixed, x[:, :, t.r_idx]), dim=3)

    cos, sin = rope_cos_sin(pos, rope)  # [B, S, K, D]
    keys = apply_rope(gather(k, k_rep), cos[:, None], sin[:, None])
    values = gather(v, v_rep)
    q_cos, q_sin = rope_cos_sin(q_pos, rope)  # [B, S, Tm, D]
    queries = apply_rope(q[:, :, t.q_idx], q_cos[:, None], q_sin[:, None])  # [B, Hq, S, Tm, D]
    mask = ok[:, :, None, :] & (pos[:, :, None, :] <= q_pos[..., None])  # [B, S, Tm, K]
    key_bias = None
    if bias is not None:
        zeros = bias.new_zeros
        key_bias = torch.cat((zeros(b, s, pm), bias.masked_fill(~shown, 0.0), zeros(b, s, t.r_idx.shape[1])), dim=-1)
        key_bias = key_bias.reshape(b * s, 1, 1, -1)  # [B * S, 1, 1, K]

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, S, T, D] -> [B * S, H, T, D]
        return x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[3], d)

    out = masked_attention(flat(queries), flat(keys), flat(values), mask.reshape(b * s, 1, *mask.shape[2:]), bias=key_bias)
    out = out.view(b, s, -1, out.shape[2], d).transpose(1, 2)  # [B, Hq, S, Tm, D]
    return out[:, :, t.q_valid]  # [B, Hq, N_group, D]
