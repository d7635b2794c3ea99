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
  and query ``j`` at ``P + K + (end_f - head) + j``. All blocks run as one batched attention call per layer.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from .attention import masked_attention
from .budget import BudgetMode
from .chunked_parallel import ForwardSchedule, ParallelChunkedAttention
from .chunked_params import ChunkedGatedParams
from .gate import ChunkGate
from .rope import RopeConfig, apply_rope, rope_cos_sin
from .segment_attention import SegmentPlan, attend_segments


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
    """Per-block index tables (built once per schedule).

    Args:
        kept: [N_kept] long, training-sequence index of each kept token. query: [S, Q] long, of each block token.
        restore: [N] long, where each training-sequence token sits in ``cat(kept outputs, block outputs)``.
        formed: chunks formed before each block's state ([S] ints).
        r_idx: [S, Rm] long kept-token index of each raw key (padding repeats the last); r_valid: [S, Rm] bool.
        p_valid: [S, Pm] bool pinned slots in use. pinned, head, end: [S] float (pinned count, raw head, the
            end of the block's forward, in kept tokens).
    """

    kept: torch.Tensor
    query: torch.Tensor
    restore: torch.Tensor
    formed: list[int]
    r_idx: torch.Tensor
    r_valid: torch.Tensor
    p_valid: torch.Tensor
    pinned: torch.Tensor
    head: torch.Tensor
    end: torch.Tensor

    @classmethod
    def build(cls, schedule: ForwardSchedule, blocks: QueryBlocks, device: torch.device) -> "BlockTables":
        kept, query = blocks.token_order(schedule.lengths)
        ends = list(itertools.accumulate(schedule.lengths))
        formed, pinned, head, end = [], [], [], []
        for f in blocks.after:
            e = ends[f]
            c = bisect.bisect_right(schedule.chunk_forward, f)  # chunks formed up to forward f inclusive
            p = e if e <= schedule.pinned else schedule.pinned
            formed.append(c)
            pinned.append(p)
            head.append(schedule.chunk_starts[c - 1] + schedule.chunk if c else p)
            end.append(e)
        s = len(blocks.after)
        r_max = max([e - h for e, h in zip(end, head)] + [1])
        p_max = max(pinned + [0])

        def tensor(rows, dtype=torch.long) -> torch.Tensor:
            return torch.tensor(rows, dtype=dtype, device=device)

        order = tensor(kept + [t for block in query for t in block])
        return cls(
            kept=tensor(kept),
            query=tensor(query).reshape(s, blocks.length),
            restore=torch.argsort(order),
            formed=formed,
            r_idx=tensor([[min(h + i, e - 1) for i in range(r_max)] for h, e in zip(head, end)]).reshape(s, r_max),
            r_valid=tensor([[i < e - h for i in range(r_max)] for h, e in zip(head, end)], torch.bool).reshape(s, r_max),
            p_valid=tensor([[i < p for i in range(p_max)] for p in pinned], torch.bool).reshape(s, p_max),
            pinned=tensor(pinned, torch.float32),
            head=tensor(head, torch.float32),
            end=tensor(end, torch.float32),
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
        qk, kk, vk = q[:, :, t.kept], k_raw[:, :, t.kept], v[:, :, t.kept]  # [B, H, N_kept, D]
        k_rep, v_rep, visible, shown, bias = self.chunk_keys(layer, kk, vk, self.formed + t.formed)
        n_seg = len(self.formed)
        kept_out = attend_segments(
            self._plan, self.rope, qk, kk, vk, k_rep, v_rep, visible=visible[:, :n_seg], shown=shown[:, :n_seg],
            bias=None if bias is None else bias[:, :n_seg],
        )  # fmt: skip
        block_out = attend_blocks(
            t, self.rope, q[:, :, t.query], k_raw[:, :, t.query], v[:, :, t.query], kk, vk, k_rep, v_rep,
            visible=visible[:, n_seg:], shown=shown[:, n_seg:], bias=None if bias is None else bias[:, n_seg:],
            causal=self.blocks.causal,
        )  # fmt: skip
        return torch.cat((kept_out, block_out.flatten(2, 3)), dim=2)[:, :, t.restore]


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
    """Every query block in one masked attention call (``causal``: a block sees itself causally).

    q: [B, Hq, S, Q, D]; k_own, v_own: [B, Hkv, S, Q, D] (the blocks' own, k pre-RoPE); k, v: [B, Hkv, N_kept, D]
    the kept tokens (pre-RoPE); k_rep, v_rep: [B, Hkv, n, D]; visible, shown: [B, S, n] bool; bias: [B, S, n]
    or ``None``. Returns [B, Hq, S, Q, D].
    """
    b, _, s, n_q, d = q.shape
    pm = t.p_valid.shape[1]
    vis = visible.float()
    before = vis.cumsum(-1) - vis  # [B, S, n] visible chunks before each chunk
    c_pos = t.pinned[None, :, None] + before - 0.5 * (1.0 - vis)  # [B, S, n]
    offset = vis.sum(-1) + t.pinned[None] - t.head[None]  # [B, S]: P + K - head
    pin_pos = torch.arange(pm, device=k.device, dtype=torch.float32).expand(b, s, pm)  # [B, S, Pm]
    raw_pos = t.r_idx[None].float() + offset[..., None]  # [B, S, Rm]
    own_pos = (t.end[None] + offset)[..., None] + torch.arange(n_q, device=k.device)  # [B, S, Q]
    pos = torch.cat((pin_pos, c_pos, raw_pos, own_pos), dim=-1)  # [B, S, K]
    ok = torch.cat(
        (t.p_valid.expand(b, s, pm), shown, t.r_valid.expand(b, -1, -1), shown.new_ones(b, s, n_q)), dim=-1
    )  # [B, S, K]

    def gather(x: torch.Tensor, rep: torch.Tensor, own: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, S, K, D]
        fixed = torch.cat((x[:, :, :pm], rep), dim=2)[:, :, None].expand(-1, -1, s, -1, -1)  # [B, Hkv, S, Pm + n, D]
        return torch.cat((fixed, x[:, :, t.r_idx], own), dim=3)

    cos, sin = rope_cos_sin(pos, rope)  # [B, S, K, D]
    keys = apply_rope(gather(k, k_rep, k_own), cos[:, None], sin[:, None])
    values = gather(v, v_rep, v_own)
    q_cos, q_sin = rope_cos_sin(own_pos, rope)  # [B, S, Q, D]
    queries = apply_rope(q, q_cos[:, None], q_sin[:, None])  # [B, Hq, S, Q, D]
    mask = ok[:, :, None, :].expand(-1, -1, n_q, -1)  # [B, S, Q, K]: every query sees every shown key
    if causal:  # ... of the cache, and its own block's keys up to itself
        own = torch.ones(n_q, n_q, dtype=torch.bool, device=k.device).tril()
        mask = torch.cat((mask[..., : mask.shape[-1] - n_q], own.expand(b, s, n_q, n_q)), dim=-1)
    key_bias = None
    if bias is not None:
        zeros = bias.new_zeros
        tail = t.r_idx.shape[1] + n_q
        key_bias = torch.cat((zeros(b, s, pm), bias.masked_fill(~shown, 0.0), zeros(b, s, tail)), dim=-1)
        key_bias = key_bias.reshape(b * s, 1, 1, -1)  # [B * S, 1, 1, K]

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, S, T, D] -> [B * S, H, T, D]
        return x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[3], d)

    out = masked_attention(flat(queries), flat(keys), flat(values), mask.reshape(b * s, 1, n_q, -1), bias=key_bias)
    return out.view(b, s, -1, n_q, d).transpose(1, 2)  # [B, Hq, S, Q, D]
