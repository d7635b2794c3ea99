"""Training forms for ``HistoryMode.OBSERVATIONS``: each step's decode forwards are not kept.

At inference (``OpenVLASession``) a step's frame forward stays in the cache; its ``action_dim - 1`` decode
forwards run inside a mark and are rolled back, so the next frame takes their positions and no later token
sees an action. A window trains in one forward over

    P | O_1 | A_1 | O_2 | A_2 | ... | O_S | A_S

(``FlatLayout.kept`` marks the A blocks): kept tokens see the kept tokens before them; block A_i sees what
the cache holds after O_i and itself causally, at the positions that follow O_i. With the full cache that is
a mask (``masked_form``); with the chunked cache the kept forwards alone decide what is chunked and the A
blocks are causal ``QueryBlocks`` of ``ParallelQueryAttention`` (``chunked_form``).
"""

from __future__ import annotations

import torch

from vla_runtime.kv.attention import causal_attention, masked_attention
from vla_runtime.kv.budget import BudgetMode
from vla_runtime.kv.chunked_parallel import ForwardSchedule
from vla_runtime.kv.chunked_params import ChunkedGatedParams
from vla_runtime.kv.gate import ChunkGate
from vla_runtime.kv.query_parallel import ParallelQueryAttention, QueryBlocks
from vla_runtime.kv.rope import RopeConfig, apply_rope, rope_cos_sin

from .layout import FlatLayout


def query_blocks(layout: FlatLayout) -> tuple[list[int], QueryBlocks]:
    """The kept forwards' lengths and the not-kept runs after them as causal ``QueryBlocks`` (equal lengths)."""
    lengths, after, runs = [], [], []
    for n, kept in zip(layout.boundaries, layout.kept):
        if kept:
            lengths.append(n)
            continue
        if not lengths:
            raise ValueError("a not-kept forward before any kept one: the prompt is always kept")
        if after and after[-1] == len(lengths) - 1:
            runs[-1] += n
        else:
            after.append(len(lengths) - 1)
            runs.append(n)
    if len(set(runs)) > 1:
        raise ValueError(f"not-kept blocks of different lengths {sorted(set(runs))}: every step decodes as many tokens")
    return lengths, QueryBlocks(after=tuple(after), length=runs[0] if runs else 1, causal=True)


def positions_and_mask(layout: FlatLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] long positions the streamed cache gives every token and the [N, N] bool visibility (module doc)."""
    positions, runs = [], []  # runs: 0 for a kept token, i for the i-th not-kept run
    held = run = offset = 0  # kept tokens so far; the current run; its tokens so far
    previous_kept = True
    for n, kept in zip(layout.boundaries, layout.kept or (True,) * len(layout.boundaries)):
        if kept:
            positions += range(held, held + n)
            runs += [0] * n
            held += n
        else:
            run, offset = (run + 1, 0) if previous_kept else (run, offset)
            positions += range(held + offset, held + offset + n)  # the positions the next kept tokens take again
            runs += [run] * n
            offset += n
        previous_kept = kept
    run_of = torch.tensor(runs)
    idx = torch.arange(len(runs))
    same_run = (run_of[None, :] == run_of[:, None]) & (run_of[:, None] > 0)
    mask = (idx[None, :] <= idx[:, None]) & ((run_of == 0)[None, :] | same_run)
    return torch.tensor(positions), mask


class ObservationFullForm:
    """The full cache's training form (``FullCache`` with each step's decodes rolled back), in two attention
    calls per layer: the kept tokens causally among themselves (their positions are 0..N_kept-1, so the
    fused causal kernel applies), and every decode block at once against all keys through the mask's rows.

    Args:
        layout: the window's ``FlatLayout`` (``kept`` marks the decode forwards). rope: the decoder's RoPE.
    """

    def __init__(self, layout: FlatLayout, rope: RopeConfig, device: torch.device) -> None:
        positions, mask = positions_and_mask(layout)
        kept = torch.repeat_interleave(torch.tensor(layout.kept), torch.tensor(layout.boundaries))  # [N]
        self.kept = kept.nonzero().squeeze(1).to(device)  # [N_kept]
        self.blocks = (~kept).nonzero().squeeze(1).to(device)  # [N_blocks]
        self.block_mask = mask[~kept].to(device)  # [N_blocks, N]
        self.cos, self.sin = rope_cos_sin(positions.to(device), rope)  # [N, D] each

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, N, D]; k_raw, v: [B, Hkv, N, D] -> [B, Hq, N, D]."""
        q, k = apply_rope(q, self.cos, self.sin), apply_rope(k_raw, self.cos, self.sin)
        out = torch.empty_like(q)
        kept = self.kept
        out[:, :, kept] = causal_attention(q[:, :, kept], k[:, :, kept], v[:, :, kept], past=0)
        if len(self.blocks):
            out[:, :, self.blocks] = masked_attention(q[:, :, self.blocks], k, v, self.block_mask)
        return out

    def end_forward(self, *, pin: bool = False) -> None:
        """Nothing to commit."""


def masked_form(layout: FlatLayout, rope: RopeConfig, device: torch.device) -> ObservationFullForm:
    """The full cache's training form (``ObservationFullForm``)."""
    return ObservationFullForm(layout, rope, device)


def chunked_form(
    layout: FlatLayout,
    gate: ChunkGate,
    params: ChunkedGatedParams,
    rope: RopeConfig,
    *,
    temperature: float,
    budget: BudgetMode,
) -> ParallelQueryAttention:
    """The chunked cache's parallel form over the kept forwards, each step's decodes a causal query block."""
    lengths, blocks = query_blocks(layout)
    schedule = ForwardSchedule.build(tuple(lengths), layout.pinned, window=params.window, chunk=params.chunk)
    return ParallelQueryAttention(
        schedule, blocks, gate, params, rope, soft=True, temperature=temperature, budget=budget
    )  # fmt: skip
