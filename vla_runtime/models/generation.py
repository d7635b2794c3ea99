"""Token generation over a cache: prefill once, then one cached decode step per token.

Kept apart from the model file (gpt-fast's split): the sampler, ``TokenHead`` (logits of all ids or an id
range, then a pick), ``decode`` (the one decoding loop every caller uses: OpenVLA's action tokens,
HybridVLA's autoregressive branch, the KEEP planner), ``greedy_tokens`` (the same loop for a greedy head as one
function, which ``torch.compile`` captures whole) and ``generate`` (prefill + decode for plain LMs).
Tokens are collected in a list and concatenated once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..kv.base import KVCache
from .llama import LlamaForCausalLM, LlamaModel


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


class TokenHead:
    """How the next token is chosen from the decoder's final hidden state: the LM head's logits over all ids or
    one id range (``id_range = (first, last)``, only those rows of the head are computed), then greedy or
    sampled (``sampling``), optionally limited to ``allowed`` ids ([V] bool).

    ``record_confidence``: greedy picks also keep each pick's probability (max softmax) in ``confidences``.
    """

    def __init__(self, lm_head: torch.nn.Linear, sampling: SamplingConfig = SamplingConfig(), *,
                 id_range: tuple[int, int] | None = None, allowed: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, record_confidence: bool = False) -> None:
        if record_confidence and sampling.temperature != 0:
            raise ValueError("record_confidence needs greedy decoding (temperature 0)")
        self.weight = lm_head.weight if id_range is None else lm_head.weight[id_range[0] : id_range[1] + 1]
        self.offset = 0 if id_range is None else id_range[0]
        self.sampling, self.allowed, self.generator = sampling, allowed, generator
        self.confidences: list[torch.Tensor] | None = [] if record_confidence else None

    @property
    def plain_greedy(self) -> bool:
        """Greedy over every id of the range, recording nothing: what ``greedy_tokens`` computes."""
        return self.sampling.temperature == 0 and self.allowed is None and self.confidences is None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, dim] -> logits [B, V'] (V' = the range's size, else the vocabulary)."""
        return F.linear(hidden, self.weight)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, V'] (of this head's ids) -> token ids [B, 1] in the vocabulary."""
        if self.allowed is not None:
            logits = logits.masked_fill(~self.allowed, float("-inf"))
        if self.confidences is not None:
            p, tok = logits.float().softmax(-1).max(-1)
            self.confidences.append(p)
            return tok[:, None] + self.offset
        return sample(logits, self.sampling, self.generator) + self.offset


@torch.no_grad()
def decode(
    next_logits: Callable[[torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    pick: Callable[[torch.Tensor], torch.Tensor],
    *,
    max_new_tokens: int,
    stop: Callable[[list[torch.Tensor]], bool] | None = None,
) -> torch.Tensor:
    """The one decoding loop (OpenVLA's action tokens, HybridVLA's AR branch, the planner, ``generate``).

    ``logits``: [B, V'] after the prompt, already in the cache. Each round ``pick(logits)`` chooses ids [B, 1];
    ``stop(tokens so far)`` may end the loop (that token included); otherwise ``next_logits(ids)`` runs the ids
    through the model (appending them to the cache) for the next logits. Returns ids [B, n], n <= max_new_tokens;
    the last pick is not run through the model.
    """
    out: list[torch.Tensor] = []
    for i in range(max_new_tokens):
        tok = pick(logits)
        out.append(tok)
        if stop is not None and stop(out):
            break
        if i + 1 < max_new_tokens:
            logits = next_logits(tok)
    return torch.cat(out, dim=1)


def greedy_tokens(
    model: LlamaModel, cache: KVCache, weight: torch.Tensor, offset: int, logits: torch.Tensor, n: int
) -> torch.Tensor:
    """``decode`` with a ``plain_greedy`` ``TokenHead`` (rows ``weight`` [V', dim] of the LM head, ids from
    ``offset``), as one function of tensors and the cache: what ``policies.compiled.CompiledTokenLoop`` traces
    into one graph, the n - 1 one-token forwards with their plans and commits included.

    logits: [B, V'] after the prompt -> ids [B, n]; the last pick is not run through the model.
    """
    next_logits = lambda ids: F.linear(model(ids, cache=cache)[:, -1], weight)  # noqa: E731  [B, V']
    pick = lambda scores: scores.argmax(dim=-1, keepdim=True) + offset  # noqa: E731  [B, 1] ids
    return decode(next_logits, logits, pick, max_new_tokens=n)


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
    head = TokenHead(model.lm_head, sampling, allowed=allowed_ids, generator=generator)
    done: list[torch.Tensor] = []

    def every_row_stopped(tokens: list[torch.Tensor]) -> bool:
        hit = torch.isin(tokens[-1][:, 0], torch.tensor(stop_ids, device=tokens[-1].device))
        done.append(hit if not done else done[-1] | hit)
        return bool(done[-1].all())

    return decode(
        lambda tok: model(tok, cache=cache, last_only=True)[:, -1],
        model(input_ids, inputs_embeds, cache=cache, last_only=True)[:, -1],
        head.pick,
        max_new_tokens=max_new_tokens,
        stop=every_row_stopped if stop_ids else None,
    )
