"""Token generation over a cache: prefill once, then one cached decode step per token.

Kept apart from the model file (gpt-fast's split): ``prefill``, ``decode_one``,
``generate``, and the sampler. Tokens are collected in a list and concatenated once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.base import KVCache
from .llama import LlamaForCausalLM


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` is greedy. ``top_k = 0`` and ``top_p = 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"`temperature` must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"`top_k` must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}")


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] -> token ids [B, 1]."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > cfg.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.inference_mode()
def generate(
    model: LlamaForCausalLM,
    cache: KVCache,
    *,
    max_new_tokens: int,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    stop_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    allowed_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill the prompt into ``cache`` then decode up to ``max_new_tokens`` tokens.

    input_ids: [B, T] or inputs_embeds: [B, T, dim]. allowed_ids: optional [V] bool mask of tokens
    that may be produced. Returns new ids [B, n] (n <= max_new_tokens; stops when every row hit a stop id).
    """
    logits = model(input_ids, inputs_embeds, cache=cache, last_only=True)[:, -1]  # [B, V]
    out: list[torch.Tensor] = []
    done = None
    for i in range(max_new_tokens):
        if allowed_ids is not None:
            logits = logits.masked_fill(~allowed_ids, float("-inf"))
        tok = sample(logits, sampling, generator)  # [B, 1]
        out.append(tok)
        if stop_ids:
            hit = torch.isin(tok[:, 0], torch.tensor(stop_ids, device=tok.device))
            done = hit if done is None else done | hit
            if bool(done.all()):
                break
        if i + 1 < max_new_tokens:
            logits = model(tok, cache=cache, last_only=True)[:, -1]
    return torch.cat(out, dim=1)
