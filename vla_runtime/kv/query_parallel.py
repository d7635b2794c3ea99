"""Not-kept query blocks in the chunked cache's parallel form (OpenVLA-OFT's history mode; OpenVLA's
``HistoryMode.OBSERVATIONS`` with causal blocks).

Streaming: after a kept forward ``f`` (an observation) a *query block* of Q tokens runs inside
``cache.bidirectional_block()``. It sees what the cache holds after ``f``'s ``end_forward`` — the pinned
prompt, the retained chunk representatives, the raw tokens from the raw head on — and itself both ways, at
the positions after the held tokens; then it is rolled back. A query block never becomes part of a chunk,
never moves the raw head, and no later forward sees it.

Training: one forward over the kept forwards with each query block inserted after its forward, e.g.

    P | O_1 | Q_1 | O_2 | Q_2 | ... | O_S | Q_S

``ParallelQueryAttention`` splits the sequence by ``QueryBlocks``:

* **Kept tokens** (P, O_i): the ``ForwardSchedule`` of the kept forwards alone decides what they see and
  when chunks close, and ``ParallelChunkedAttention``'s segments attend them over kept tokens only, so the
  result equals the same run without query blocks (no kept token sees a block; chunks hold kept tokens only).
* **Query blocks**: each block is one more cache state: the chunks formed up to its forward inclusive
  (the hard/soft visibility and ``log g`` bias of the same gate outputs the segments use, at that
  ``formed`` count), the raw keys ``[head, end_f)`` and the block's own Q keys, without a causal mask.
  Positions follow the cache: pinned ``0..P-1``, visible chunks ``P + rank`` (other shown ones half-way
  between their visible neighbours, as in ``segment_attention``), raw token ``t`` at ``P + K + (t - head)``
  and query ``j`` at ``P + K + (end_f - head) + j``. As for segments, the attention is three pieces merged
  (``partial_attention``): the fixed keys per block state (``segment_attention.fixed_attention``), the raw
  keys as a band over the kept tokens (``band_attention``: the offset cancels, so block token ``j`` sits at
  ``end_f + j`` on the kept tokens' axis), and the block's own keys.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from .budget import BudgetMode
from .chunked_parallel import ForwardSchedule, ParallelChunkedAttention
from .chunked_params import ChunkedGatedParams
from .gate import ChunkGate
from .partial_attention import BandPlan, band_attention, merge_partials, partial_attention, take
from .rope import RopeConfig, apply_rope, rope_cos_sin
from .segment_attention import CacheState, FixedPlan, SegmentPlan, attend_segments, fixed_attention


@dataclass(frozen=True)
class QueryBlocks:
    """Where query blocks sit: ``after[i]`` is the kept forward block ``i`` follows (non-decreasing), each
    ``length`` tokens. In the training sequence the blocks after forward ``f`` come right after its tokens.
    ``causal``: a block's tokens see their own block causally (OpenVLA's action tokens decoded one by one
    inside a mark, ``HistoryMode.OBSERVATIONS``) instead of both ways (OpenVLA-OFT's parallel block)."""

    after: tuple[int, ...]
    length: int
    causal: bool = False

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"`length` must be >= 1, got {self.length}")
        if list(self.after) != sorted(self.after) or (self.after and self.after[0] < 0):
            raise ValueError(f"`after` must be non-decreasing forward indices >= 0, got {list(self.after)}")

    def token_order(self, lengths: Sequence[int]) -> tuple[list[int], list[list[int]]]:
        """For kept forwards of ``lengths`` tokens: the training-sequence index of each kept token ([N_kept])
        and of each block's tokens ([S][Q])."""
        if self.after and self.after[-1] >= len(lengths):
            raise ValueError(f"a query block follows forward {self.after[-1]} but there are {len(lengths)} forwards")
        kept: list[int] = []
        blocks: list[list[int]] = []
        at, i = 0, 0
        for f, n in enumerate(lengths):
            kept += range(at, at + n)
            at += n
            while i < len(self.after) and self.after[i] == f:
                blocks.append(list(range(at, at + self.length)))
                at += self.length
                i += 1
        return kept, blocks


@dataclass(frozen=True)
class BlockTables:
    """Per-block tables (built once per schedule).

    Args:
        kept: [N_kept] long, training-sequence index of each kept token. query: [S, Q] long, of each block token.
        restore: [N] long, where each training-sequence token sits in ``cat(kept outputs, block outputs)``.
        formed: chunks formed before each block's state ([S] ints).
        fixed: the blocks as cache states (``FixedPlan``; queries are the block tokens, flattened ``[S * Q]``).
        band: each block token's raw keys, the kept tokens ``head .. end - 1`` (``BandPlan``).
    """

    kept: torch.Tensor
    query: torch.Tensor
    restore: torch.Tensor
    formed: list[int]
    fixed: FixedPlan
    band: BandPlan

    @classmethod
    def build(cls, schedule: ForwardSchedule, blocks: QueryBlocks, device: torch.device) -> "BlockTables":
        kept, query = blocks.token_order(schedule.lengths)
        ends = list(itertools.accumulate(schedule.lengths))
        formed, states, pos, lo, hi = [], [], [], [], []
        n_q = blocks.length
        for i, f in enumerate(blocks.after):
            e = ends[f]
            c = bisect.bisect_right(schedule.chunk_forward, f)  # chunks formed up to forward f inclusive
            p = e if e <= schedule.pinned else schedule.pinned
            head = schedule.chunk_starts[c - 1] + schedule.chunk if c else p
            own = tuple(float(e + j) for j in range(n_q))  # the block's tokens follow its forward's
            formed.append(c)
            states.append(CacheState(tuple(range(i * n_q, (i + 1) * n_q)), own, p, head, c))
            pos += own
            lo += [head] * n_q
            hi += [e] * n_q

        def tensor(rows, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(rows, dtype=dtype, device=device)

        order = tensor(kept + [t for block in query for t in block])
        return cls(
            kept=tensor(kept),
            query=tensor(query).reshape(len(blocks.after), n_q),
            restore=torch.argsort(order),
            formed=formed,
            fixed=FixedPlan.build(states, max(formed + [0]), device),
            band=BandPlan.build(pos, lo, hi, len(kept), device),
        )


class ParallelQueryAttention(ParallelChunkedAttention):
    """``ParallelChunkedAttention`` over kept forwards plus not-kept bidirectional ``QueryBlocks`` (module docstring).

    ``schedule``: the kept forwards' ``ForwardSchedule``; the model's input is the training sequence
    (``QueryBlocks.token_order``: N = kept tokens + S * Q). Other arguments as ``ParallelChunkedAttention``.
    """

    def __init__(
        self,
        schedule: ForwardSchedule,
        blocks: QueryBlocks,
        gate: ChunkGate,
        params: ChunkedGatedParams,
        rope: RopeConfig,
        *,
        soft: bool = True,
        temperature: float = 1.0,
        budget: BudgetMode = BudgetMode.HARD,
    ) -> None:
        super().__init__(schedule, gate, params, rope, soft=soft, temperature=temperature, budget=budget)
        self.blocks = blocks
        self._tables: BlockTables | None = None

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, N, D]; k_raw, v: [B, Hkv, N, D] over the training sequence -> [B, Hq, N, D]."""
        n_blocks = len(self.blocks.after)
        expected = self.schedule.n_tokens + n_blocks * self.blocks.length
        if q.shape[2] != expected:
            raise ValueError(f"the sequence has {q.shape[2]} tokens; the kept forwards and query blocks cover {expected}")
        if self._tables is None:
            self._tables = BlockTables.build(self.schedule, self.blocks, q.device)
        if self._plan is None:
            self._plan = SegmentPlan.build(self.schedule, self.formed, q.device)
        t = self._tables
        qk, kk, vk = take(q, t.kept), take(k_raw, t.kept), take(v, t.kept)  # [B, H, N_kept, D]
        k_rep, v_rep, visible, shown, bias = self.chunk_keys(layer, kk, vk, self.formed + t.formed)
        n_seg = len(self.formed)
        kept_out = attend_segments(
            self._plan, self.rope, qk, kk, vk, k_rep, v_rep, visible=visible[:, :n_seg], shown=shown[:, :n_seg],
            bias=None if bias is None else bias[:, :n_seg],
        )  # fmt: skip
        block_out = attend_blocks(
            t, self.rope, take(q, t.query), take(k_raw, t.query), take(v, t.query), kk, vk, k_rep, v_rep,
            visible=visible[:, n_seg:], shown=shown[:, n_seg:], bias=None if bias is None else bias[:, n_seg:],
            causal=self.blocks.causal,
        )  # fmt: skip
        return take(torch.cat((kept_out, block_out.flatten(2, 3)), dim=2), t.restore)


def attend_blocks(
    t: BlockTables,
    rope: RopeConfig,
    q: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_rep: torch.Tensor,
    v_rep: torch.Tensor,
    *,
    visible: torch.Tensor,
    shown: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool = False,
) -> torch.Tensor:
    """Every query block: its state's fixed keys, its raw keys and its own block (``causal``: up to itself),
    three ``partial_attention`` pieces merged.

    q: [B, Hq, S, Q, D]; k_own, v_own: [B, Hkv, S, Q, D] (the blocks' own, k pre-RoPE); k, v: [B, Hkv, N_kept, D]
    the kept tokens (pre-RoPE); k_rep, v_rep: [B, Hkv, n, D]; visible, shown: [B, S, n] bool; bias: [B, S, n]
    or ``None``. Returns [B, Hq, S, Q, D].
    """
    b, hq, s, n_q, d = q.shape
    flat_q = q.flatten(2, 3)  # [B, Hq, S * Q, D]
    fixed = fixed_attention(t.fixed, rope, flat_q, k, v, k_rep, v_rep, visible=visible, shown=shown, bias=bias)
    raw = band_attention(t.band, rope, flat_q, k, v)
    cos, sin = rope_cos_sin(torch.arange(n_q, device=q.device), rope)  # [Q, D]: the block's own, relative

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, S, Q, D] -> [B * S, H, Q, D]
        return x.transpose(1, 2).reshape(b * s, x.shape[1], n_q, d)

    own_mask = torch.ones(n_q, n_q, dtype=torch.bool, device=q.device)
    if causal:
        own_mask = own_mask.tril()
    out, lse = partial_attention(
        flat(apply_rope(q, cos, sin)), flat(apply_rope(k_own, cos, sin)), flat(v_own), own_mask.expand(b * s, 1, n_q, n_q)
    )  # fmt: skip
    own = (out.view(b, s, hq, n_q, d).transpose(1, 2).flatten(2, 3), lse.view(b, s, hq, n_q).transpose(1, 2).flatten(2, 3))
    return merge_partials([fixed, raw, own]).to(q.dtype).view(b, hq, s, n_q, d)
