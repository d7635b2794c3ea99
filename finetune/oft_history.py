"""OpenVLA-OFT's history mode as one training forward (the ``FullCache`` stream, written as a mask).

At inference (``vla_runtime.policies.openvla_oft``) the prompt is pinned, each step keeps its observation
O_i (images + proprio, causal) and evaluates its query block Q_i (``"\\nOut:" 29871 zeros </s>``)
bidirectionally over the history, then rolls Q_i back. A window of S steps trains in one forward over

    P | O_1 | Q_1 | O_2 | Q_2 | ... | O_S | Q_S

with explicit positions and visibility: P and O tokens see the kept tokens before them (P, O_1 .. O_i,
never a Q); Q_i sees P and O_1 .. O_i and itself both ways, at the positions that follow O_i (the positions
O_{i+1} takes again, as the rollback does). ``tests/finetune/test_oft.py`` checks this against the session.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vla_runtime.kv.attention import masked_attention
from vla_runtime.kv.rope import RopeConfig, apply_rope, rope_cos_sin


@dataclass(frozen=True)
class HistoryLayout:
    """Token layout of S history-mode steps in one forward.

    Args:
        prompt: pinned prompt tokens P. obs: tokens per observation. query: tokens per query block.
        steps: S. first_action: index, inside a query block, of its first action position.
        action_tokens: K * A positions the head reads, from ``first_action - 1``.
    """

    prompt: int
    obs: int
    query: int
    steps: int
    first_action: int
    action_tokens: int

    @property
    def n_tokens(self) -> int:
        return self.prompt + self.steps * (self.obs + self.query)

    def obs_start(self, i: int) -> int:
        return self.prompt + i * (self.obs + self.query)

    def query_start(self, i: int) -> int:
        return self.obs_start(i) + self.obs

    def positions(self) -> torch.Tensor:
        """[N] long: the positions the streamed cache gives every token (Q_i at the ones after O_i)."""
        parts = [torch.arange(self.prompt)]
        for i in range(self.steps):
            base = self.prompt + i * self.obs
            parts += [base + torch.arange(self.obs), base + self.obs + torch.arange(self.query)]
        return torch.cat(parts)

    def mask(self) -> torch.Tensor:
        """[N, N] bool (True = visible), see the module docstring."""
        n = self.n_tokens
        kept = torch.zeros(n, dtype=torch.bool)
        kept[: self.prompt] = True
        for i in range(self.steps):
            kept[self.obs_start(i) : self.obs_start(i) + self.obs] = True
        idx = torch.arange(n)
        mask = (idx[None, :] <= idx[:, None]) & kept[None, :]  # the kept tokens before each row
        for i in range(self.steps):
            q = self.query_start(i)
            mask[q : q + self.query, q : q + self.query] = True  # the query block both ways
        return mask

    def head_rows(self) -> torch.Tensor:
        """[S, K * A] long: the rows the head reads for each step (from ``first_action - 1`` of Q_i)."""
        offsets = torch.arange(self.action_tokens) + self.first_action - 1
        return torch.stack([self.query_start(i) + offsets for i in range(self.steps)])


class PositionedMaskedForm:
    """A training form (the decoder's attend seam) for one forward at given positions with a visibility mask.

    Args:
        rope: the decoder's RoPE schedule. positions: [N] long. mask: [N, N] bool (True = visible).
    """

    def __init__(self, rope: RopeConfig, positions: torch.Tensor, mask: torch.Tensor) -> None:
        self.cos, self.sin = rope_cos_sin(positions, rope)  # [N, D] each
        self.mask = mask

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, N, D]; k_raw, v: [B, Hkv, N, D] -> [B, Hq, N, D]."""
        return masked_attention(apply_rope(q, self.cos, self.sin), apply_rope(k_raw, self.cos, self.sin), v, self.mask)

    def end_forward(self, *, pin: bool = False) -> None:
        """Nothing to commit."""
