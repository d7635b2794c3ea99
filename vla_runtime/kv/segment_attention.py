"""Every segment of the parallel form at once: fixed keys per cache state, raw keys as one band.

A segment's queries see ``pinned | the chunks formed before it | its raw tokens``, at compacted positions
that depend on the segment (``chunked_parallel``): pinned ``0..P-1``, visible chunks ``P + rank`` (other
shown ones half-way between their visible neighbours), raw token ``t`` and query ``t`` at ``t + offset`` with
``offset = P + K - head``. The attention is computed in two pieces (``partial_attention``), merged exactly:

* **Fixed keys** (pinned and chunks) per *cache state*: a segment here, a query block in
  ``query_parallel``. States are grouped (``group_states``: by how many chunks precede them, ``CHUNK_GROUPS``
  bands, and by how many queries they run, ``LENGTH_CLASSES``) and each group pads only to its own longest
  state and its own chunk count; per group the keys are gathered once per state, rotated at the state's
  positions, and attended in one call.
* **Raw keys**: a raw key's distance to a query is their distance in tokens (the offset moves both), so
  every query's raw keys are a run ``head .. itself`` at token positions, attended tile by tile
  (``band_attention``) instead of gathered again for every segment, which cost ~16x the real work at a
  window of 270 tokens (segments are about one control step long).

Padding: query slots past a state's end repeat its last query (their outputs are discarded); pinned slots
past a state's pinned count are masked.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .partial_attention import BandPlan, band_attention, merge_partials, partial_attention, take
from .rope import apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from .chunked_parallel import ForwardSchedule
    from .rope import RopeConfig

CHUNK_GROUPS = 8  # bands of "chunks formed before the state"
LENGTH_CLASSES = (8, 56)  # states of <= 8, <= 56, more queries


@dataclass(frozen=True)
class CacheState:
    """One state of the cache and the queries that run in it.

    Args:
        rows: the queries' indices in the caller's query tensor.
        pos: their positions with the raw head at ``head`` (a segment's tokens: their own index; a query
            block's: the end of its forward onwards); the compacted position is ``pos + P + K - head``.
        pinned: pinned tokens P. head: first raw token. formed: chunks formed so far (the fixed keys' range).
    """

    rows: tuple[int, ...]
    pos: tuple[float, ...]
    pinned: int
    head: int
    formed: int


def group_states(states: Sequence[CacheState], n_chunks: int) -> list[list[int]]:
    """State indices grouped so that each group pads little: same band of formed chunks, same length class."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(states):
        key = (s.formed * CHUNK_GROUPS // (n_chunks + 1), bisect.bisect_left(LENGTH_CLASSES, len(s.rows)))
        groups.setdefault(key, []).append(i)
    return [groups[k] for k in sorted(groups)]


@dataclass(frozen=True)
class FixedTables:
    """Padded tables of one group of S states (shared by every layer).

    Args:
        states: [S] long, the states' indices (into ``visible``/``shown``/``bias``).
        n_chunks: chunks the group's keys include (the most any of its states has formed).
        q_idx: [S, Tm] query of each slot (padding repeats the state's last query); q_valid: [S, Tm] bool;
            q_real: [N_group] long, the real slots in ``q_idx.flatten()``.
        q_pos: [S, Tm] float, the slot's position before the offset (``CacheState.pos``).
        p_valid: [S, Pm] bool, pinned key slots in use (``Pm``: the largest pinned count).
        pinned, head: [S] float, each state's pinned count and raw head.
    """

    states: torch.Tensor
    n_chunks: int
    q_idx: torch.Tensor
    q_valid: torch.Tensor
    q_real: torch.Tensor
    q_pos: torch.Tensor
    p_valid: torch.Tensor
    pinned: torch.Tensor
    head: torch.Tensor

    @classmethod
    def build(cls, states: Sequence[CacheState], which: list[int], device: torch.device) -> "FixedTables":
        group = [states[i] for i in which]
        t_max = max(len(s.rows) for s in group)
        p_max = max(s.pinned for s in group)

        def padded(values: Sequence, width: int) -> list:
            return [values[min(i, len(values) - 1)] for i in range(width)]

        def tensor(rows, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(rows, dtype=dtype, device=device)

        q_valid = tensor([[i < len(s.rows) for i in range(t_max)] for s in group], torch.bool)
        return cls(
            states=tensor(which),
            n_chunks=max(s.formed for s in group),
            q_idx=tensor([padded(s.rows, t_max) for s in group]),
            q_valid=q_valid,
            q_real=q_valid.flatten().nonzero().squeeze(1),
            q_pos=tensor([padded(s.pos, t_max) for s in group], torch.float32),
            p_valid=tensor([[i < s.pinned for i in range(p_max)] for s in group], torch.bool).reshape(len(group), p_max),
            pinned=tensor([s.pinned for s in group], torch.float32),
            head=tensor([s.head for s in group], torch.float32),
        )

    @property
    def p_max(self) -> int:
        return self.p_valid.shape[1]


@dataclass(frozen=True)
class FixedPlan:
    """States in groups (``group_states``) and the permutation back to the callers' query order.

    Args:
        groups: one ``FixedTables`` per group.
        restore: [N] long, position in the groups' concatenated outputs of each query 0..N-1.
    """

    groups: tuple[FixedTables, ...]
    restore: torch.Tensor

    @classmethod
    def build(cls, states: Sequence[CacheState], n_chunks: int, device: torch.device) -> "FixedPlan":
        """``states`` must cover queries ``0..N-1`` once each."""
        groups = tuple(FixedTables.build(states, which, device) for which in group_states(states, n_chunks))
        rows = torch.cat([g.q_idx[g.q_valid] for g in groups])  # [N] query of each output row, group order
        return cls(groups, torch.argsort(rows))


def fixed_attention(
    plan: FixedPlan,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed-key piece of every state: its pinned keys and chunk representatives.

    q: [B, Hq, N, D] (before RoPE); k, v: [B, Hkv, M, D] the kept tokens (the first ``Pm`` are the pinned
    prompt; k before RoPE); k_rep, v_rep: [B, Hkv, n, D]; visible, shown: [B, S, n] bool per state (chunks
    at or past a state's ``formed`` must be False); bias: [B, S, n] score bias of the chunk keys or ``None``.
    Returns ``partial_attention``'s out [B, Hq, N, D] and lse [B, Hq, N].
    """
    outs, lses = [], []
    for t in plan.groups:
        st, c = t.states, t.n_chunks
        out, lse = _fixed_group(
            t, rope, q, k, v, k_rep[:, :, :c], v_rep[:, :, :c], visible=visible[:, st, :c], shown=shown[:, st, :c],
            bias=None if bias is None else bias[:, st, :c],
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return take(torch.cat(outs, dim=2), plan.restore), take(torch.cat(lses, dim=2), plan.restore)


def _fixed_group(t: FixedTables, rope, q, k, v, k_rep, v_rep, *, visible, shown, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """``fixed_attention`` for one group: its S states padded into one call. Shapes as there, with S and n the
    group's; returns out [B, Hq, N_group, D], lse [B, Hq, N_group] (the group's real queries, in table order)."""
    b, _, _, d = k.shape
    s, pm = t.q_idx.shape[0], t.p_max
    vis = visible.float()
    before = vis.cumsum(-1) - vis  # [B, S, n] visible chunks before each chunk
    c_pos = t.pinned[None, :, None] + before - 0.5 * (1.0 - vis)  # [B, S, n]
    offset = vis.sum(-1) + t.pinned[None] - t.head[None]  # [B, S]: P + K - head
    pin_pos = torch.arange(pm, device=k.device, dtype=torch.float32).expand(b, s, pm)  # [B, S, Pm]
    pos = torch.cat((pin_pos, c_pos), dim=-1)  # [B, S, Pm + n]
    q_pos = t.q_pos[None] + offset[..., None]  # [B, S, Tm]
    ok = torch.cat((t.p_valid.expand(b, s, pm), shown), dim=-1)  # [B, S, Pm + n]; every fixed key precedes the queries

    def gather(x: torch.Tensor, rep: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, S, Pm + n, D]
        return torch.cat((x[:, :, :pm], rep), dim=2)[:, :, None].expand(-1, -1, s, -1, -1)

    cos, sin = rope_cos_sin(pos, rope)  # [B, S, Pm + n, D]
    keys = apply_rope(gather(k, k_rep), cos[:, None], sin[:, None])
    values = gather(v, v_rep)
    q_cos, q_sin = rope_cos_sin(q_pos, rope)  # [B, S, Tm, D]
    queries = apply_rope(take(q, t.q_idx), q_cos[:, None], q_sin[:, None])  # [B, Hq, S, Tm, D]
    key_bias = None
    if bias is not None:
        key_bias = torch.cat((bias.new_zeros(b, s, pm), bias.masked_fill(~shown, 0.0)), dim=-1)
        key_bias = key_bias.reshape(b * s, 1, 1, -1)  # [B * S, 1, 1, Pm + n]

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, S, T, D] -> [B * S, H, T, D]
        return x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[3], d)

    out, lse = partial_attention(flat(queries), flat(keys), flat(values), ok.reshape(b * s, 1, 1, -1), bias=key_bias)
    out = out.view(b, s, -1, out.shape[2], d).transpose(1, 2)  # [B, Hq, S, Tm, D]
    lse = lse.view(b, s, -1, lse.shape[2]).transpose(1, 2)  # [B, Hq, S, Tm]
    return take(out.flatten(2, 3), t.q_real), take(lse.flatten(2, 3), t.q_real)


@dataclass(frozen=True)
class SegmentPlan:
    """A schedule's segments as cache states (``FixedPlan``) and its tokens' raw runs (``BandPlan``)."""

    fixed: FixedPlan
    band: BandPlan

    @classmethod
    def build(cls, schedule: "ForwardSchedule", formed: list[int], device: torch.device) -> "SegmentPlan":
        """formed[i]: chunks formed before segment i."""
        states, lo = [], []
        for seg, c in zip(schedule.segments, formed):
            tokens = tuple(range(seg.start, seg.end))
            states.append(CacheState(tokens, tuple(float(i) for i in tokens), seg.pinned, seg.head, c))
            lo += [seg.head] * len(tokens)
        n = schedule.n_tokens
        positions = list(range(n))
        band = BandPlan.build(positions, lo, [i + 1 for i in positions], n, device)  # raw keys: head .. itself
        return cls(FixedPlan.build(states, schedule.n_chunks, device), band)


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
    """One layer of the parallel form, every segment.

    q: [B, Hq, N, D]; k, v: [B, Hkv, N, D] (k pre-RoPE); k_rep, v_rep: [B, Hkv, n, D] chunk representatives;
    visible, shown: [B, S, n] bool (held by streaming / keys of this form; chunks at or past a segment's
    ``formed`` must be False); bias: [B, S, n] score bias of the chunk keys or ``None``. Returns [B, Hq, N, D].
    """
    fixed = fixed_attention(plan.fixed, rope, q, k, v, k_rep, v_rep, visible=visible, shown=shown, bias=bias)
    raw = band_attention(plan.band, rope, q, k, v)
    return merge_partials([fixed, raw]).to(q.dtype)
