"""The cache matrix every KV test crosses (STYLE §1.3), plus the helpers and oracles the tests share.

``CASES[mode]`` is one row per registered cache: ``easy`` params never compress the test episodes (window
>= the sequence), so the cache must equal ``FullCache``; ``hard`` params compress on every step (when the
cache compresses at all, ``compresses``). Adding a cache = a row here; ``test_contract.py`` runs every
registered cache through the contract and fails for a cache without a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vla_runtime.kv import CACHES, FullCache, KVConfig, KVMode, make_cache
from vla_runtime.kv.chunked_parallel import step_boundaries
from vla_runtime.kv.rope import apply_rope, rope_cos_sin
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class CacheCase:
    """One cache's row: params (``KVConfig`` keys) for the two levels, and whether ``hard`` compresses."""

    easy: dict = field(default_factory=dict)
    hard: dict = field(default_factory=dict)
    compresses: bool = True


CASES: dict[KVMode, CacheCase] = {
    KVMode.FULL: CacheCase(easy={}, hard={"capacity": 256}, compresses=False),
    KVMode.SINK_WINDOW: CacheCase(easy={"window": 512, "n_sink": 4}, hard={"window": 10, "n_sink": 2, "capacity": 64}),
    KVMode.CHUNKED: CacheCase(
        easy={"window": 512, "chunk": 4, "max_chunks": 8}, hard={"window": 8, "chunk": 4, "max_chunks": 3, "capacity": 64}
    ),
}
REGISTERED = [KVMode.parse(name) for name in CACHES]  # what the contract tests run: the registry, not the rows
COMPRESSING = [mode for mode, case in CASES.items() if case.compresses]

PROMPT = 5  # pinned prompt tokens
STEP = 12  # prefill tokens per control step
DECODES = 3  # single-token forwards per step


def case(mode: KVMode) -> CacheCase:
    """The matrix row of ``mode``; a registered cache without one fails here, naming itself."""
    if mode not in CASES:
        raise AssertionError(f"cache {mode.value!r} is registered but has no row in tests/kv/cases.py CASES")
    return CASES[mode]


def kv(mode: KVMode, level: str, **overrides) -> KVConfig:
    return KVConfig.of(mode, **{**getattr(case(mode), level), **overrides})


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig.from_name("tiny")).eval()


def episode(steps: int, *, batch: int = 1, seed: int = 0, dim: int = 64) -> tuple[torch.Tensor, list[int]]:
    """Random input embeddings [B, N, dim] and the forward lengths of a history episode."""
    bounds = step_boundaries(PROMPT, [STEP] * steps, DECODES)
    x = torch.randn(batch, sum(bounds), dim, generator=torch.Generator().manual_seed(seed))
    return x, bounds


@torch.no_grad()
def run_stream(model: LlamaForCausalLM, cache, x: torch.Tensor, bounds: list[int], pinned: int = PROMPT) -> torch.Tensor:
    """Feed ``x`` [B, N, dim] forward by forward (the prompt pinned); logits [B, N, V]."""
    out, start = [], 0
    for n in bounds:
        out.append(model(inputs_embeds=x[:, start : start + n], cache=cache, pin=start + n <= pinned))
        start += n
    return torch.cat(out, dim=1)


def build(mode: str, level: str, model: LlamaForCausalLM, **overrides):
    return make_cache(kv(mode, level, **overrides), model.cfg)


def full_cache(model: LlamaForCausalLM) -> FullCache:
    return FullCache(model.cfg.geometry)


class ReferenceCompactCache:
    """Oracle for the decoupled caches, written the obvious way (not a cache anyone should use).

    It keeps every token's pre-RoPE k/v (grown with ``torch.cat``), and each forward attends over the
    tokens the policy shows, re-rotated from scratch at compacted positions 0..N-1:
    ``sink``: pinned prompt + the next ``n_sink`` tokens + the last ``window`` tokens;
    ``chunk``: pinned prompt + the mean of each chunk's k and v (every chunk kept, the oldest dropped
    beyond ``max_chunks``) + the raw tokens. That is ``ChunkedGatedCache`` with an untrained gate.
    """

    def __init__(self, cfg: LlamaConfig, *, window: int, n_sink: int = 0, chunk: int | None = None, max_chunks: int | None = None):
        self.cfg, self.window, self.n_sink, self.chunk, self.max_chunks = cfg, window, n_sink, chunk, max_chunks
        empty = torch.zeros(1, cfg.n_kv_heads, 0, cfg.head_dim)
        self.k = [empty] * cfg.n_layers
        self.v = [empty] * cfg.n_layers
        self.length = self.prefix = self.head = self.sinks = 0
        self.chunks: list[int] = []  # first token of each retained chunk
        self.new = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.new = t = q.shape[2]
        self.k[layer] = torch.cat((self.k[layer], k), dim=2)
        self.v[layer] = torch.cat((self.v[layer], v), dim=2)
        ks, vs = self.k[layer], self.v[layer]
        parts_k = [ks[:, :, : self.prefix]]
        parts_v = [vs[:, :, : self.prefix]]
        for s in self.chunks:
            parts_k.append(ks[:, :, s : s + self.chunk].mean(2, keepdim=True))
            parts_v.append(vs[:, :, s : s + self.chunk].mean(2, keepdim=True))
        parts_k.append(ks[:, :, self.head :])
        parts_v.append(vs[:, :, self.head :])
        keys, values = torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)
        n = keys.shape[2]
        cos, sin = rope_cos_sin(torch.arange(n), self.cfg.rope)
        keys = apply_rope(keys, cos, sin)
        q = apply_rope(q, cos[n - t :], sin[n - t :])
        mask = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])

    def end_forward(self, *, pin: bool = False) -> None:
        self.length += self.new
        if pin:
            self.prefix = self.head = self.length
            return
        if self.chunk is None:
            take = min(self.n_sink - self.sinks, self.length - self.head)
            self.sinks += take
            self.prefix += take
            self.head = max(self.head, self.prefix, self.length - self.window)
            return
        while self.length - self.head - self.window >= self.chunk:
            self.chunks.append(self.head)
            self.head += self.chunk
            if self.max_chunks is not None and len(self.chunks) > self.max_chunks:
                self.chunks.pop(0)
