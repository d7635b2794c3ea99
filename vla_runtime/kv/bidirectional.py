"""BidirectionalPass: the attend seam of one stand-alone forward in which every token sees every token.

OpenVLA-OFT decodes a whole action chunk in one forward with *full bidirectional* attention: its LLaMA
(moojink/transformers-openvla-oft, commit "Full bidirectional attention") calls SDPA with ``is_causal=False``
and, for an unpadded batch-1 sequence, no mask at all. Positions are HF's default ``0 .. T-1``. Nothing
is stored: the seam rotates q and k at those positions and attends over the forward's own tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import grouped
from .base import KVStats
from .rope import RopeConfig, apply_rope, rope_cos_sin


class BidirectionalPass:
    """One forward, no cache: RoPE at positions ``0 .. T-1``, attention without a mask.

    Args:
        rope: the decoder's RoPE schedule (``LlamaConfig.rope``).
        device: where ``plan_forward`` puts the positions (the decoder's device).
    """

    def __init__(self, rope: RopeConfig, device: torch.device | str = "cpu") -> None:
        self.rope = rope
        self.device = torch.device(device)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._tokens = 0

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] (k pre-RoPE) -> [B, Hq, T, D]; query i sees every key."""
        t = q.shape[2]
        if self._cos is None or self._cos.shape[0] != t:  # first layer of the forward: positions once
            self._cos, self._sin = rope_cos_sin(torch.arange(t, device=q.device), self.rope)  # [T, D] each
        self._tokens = t
        q = apply_rope(q, self._cos, self._sin)
        k = apply_rope(k_raw, self._cos, self._sin)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=grouped(q, k))

    def plan_forward(self, t: int) -> None:
        """The coming forward's positions ``0 .. t-1``, before it: a compiled forward (``CompiledDecoder``) reads
        them instead of computing them in its first layer."""
        self._cos, self._sin = rope_cos_sin(torch.arange(t, device=self.device), self.rope)  # [T, D] each

    def end_forward(self, *, pin: bool = False) -> None:
        """Forget the positions (nothing is held; ``pin`` has nothing to pin)."""
        self._cos = self._sin = None

    def stats(self) -> KVStats:
        """Nothing is held between forwards; ``tokens_seen`` is the last forward's length."""
        return KVStats(positions_used=self._tokens, tokens_seen=self._tokens)
