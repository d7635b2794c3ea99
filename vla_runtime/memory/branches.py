"""Several independent continuations ("branches") of one context in a single forward.

Branch ``b``'s tokens sit at positions ``P, P + 1, ...`` right after a context of ``P`` tokens and
see the context and their own earlier tokens only. Used to prefill many memory units at once (each
after the system prefix) and to score answer candidates by log-likelihood (LoTA-style planning)
in one forward instead of one per candidate.
"""

from __future__ import annotations

import torch

from ..kv.attention import masked_attention
from ..kv.full import FullCache
from ..kv.rope import RopeConfig, apply_rope, rope_cos_sin
from ..models.llama import LlamaForCausalLM


class BranchCache:
    """The ``attend`` protocol for branches. context_k / context_v: [L, Hkv, P, D], keys already
    rotated at 0..P-1 (or None: no context); context_bias: [L, n <= P] added to every score of the first
    ``n`` context keys (a ``FullCache.key_bias``), or None. ``k``, ``v`` record every layer's pre-RoPE
    keys and values of the branch tokens: [L, Hkv, T, D]."""

    def __init__(
        self,
        rope: RopeConfig,
        lengths: list[int],
        context_k: torch.Tensor | None,
        context_v: torch.Tensor | None,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
        context_bias: torch.Tensor | None = None,
    ) -> None:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every branch needs at least one token, got lengths {lengths}")
        self.ctx_k, self.ctx_v = context_k, context_v
        p = 0 if context_k is None else context_k.shape[2]
        t = sum(lengths)
        branch = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [T]
        local = torch.cat([torch.arange(n) for n in lengths])  # [T]
        self.cos, self.sin = rope_cos_sin((local + p).to(device), rope)
        same = (branch[:, None] == branch[None, :]) & (local[None, :] <= local[:, None])  # [T, T]
        self.mask = torch.cat([torch.ones(t, p, dtype=torch.bool), same], dim=1).to(device)  # [T, P + T]
        self.bias = None if context_bias is None else torch.nn.functional.pad(context_bias, (0, p + t - context_bias.shape[1]))  # [L, P + T]
        self.k = torch.empty(n_layers, n_kv_heads, t, head_dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer], self.v[layer] = k_raw[0], v[0]
        q = apply_rope(q, self.cos, self.sin)
        k = apply_rope(k_raw, self.cos, self.sin)
        if self.ctx_k is not None:
            k = torch.cat([self.ctx_k[layer][None].to(k.device), k], dim=2)  # [1, Hkv, P + T, D]
            v = torch.cat([self.ctx_v[layer][None].to(v.device), v], dim=2)
        return masked_attention(q, k, v, self.mask, bias=None if self.bias is None else self.bias[layer][None, :])

    def end_forward(self, *, pin: bool = False) -> None:
        pass

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, lengths: list[int], context_k=None, context_v=None, context_bias=None) -> "BranchCache":
        cfg, p = model.cfg, next(model.parameters())
        return cls(
            cfg.rope, lengths, context_k, context_v,
            n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, device=p.device, dtype=p.dtype,
            context_bias=context_bias,
        )  # fmt: skip


@torch.no_grad()
def continuation_logprobs(model: LlamaForCausalLM, cache: FullCache, next_logits: torch.Tensor, candidates: list[list[int]]) -> torch.Tensor:
    """Summed log-probability of each candidate token sequence after the prompt held in ``cache``
    (``next_logits: [V]`` are the prompt's next-token logits; the cache's key bias, if any, applies). One forward for all candidates. -> [n]."""
    if any(not c for c in candidates):
        raise ValueError("every candidate needs at least one token")
    first = next_logits.float().log_softmax(-1)
    scores = torch.tensor([float(first[c[0]]) for c in candidates])
    tails = [c[:-1] for c in candidates]
    rest = [i for i, t in enumerate(tails) if t]
    if not rest:
        return scores
    k, v = cache.buffers(cache.length)  # [L, 1, Hkv, S, D]
    branch = BranchCache.for_model(model, [len(tails[i]) for i in rest], k[:, 0], v[:, 0], cache.key_bias)
    ids = torch.tensor([[t for i in rest for t in tails[i]]], device=next_logits.device)
    logp = model(ids, cache=branch)[0].float().log_softmax(-1)  # [T, V]
    pos = 0
    for i in rest:
        c = candidates[i]
        for j in range(1, len(c)):
            scores[i] += logp[pos + j - 1, c[j]]
        pos += len(c) - 1
    return scores
