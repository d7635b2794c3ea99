"""Prefill with memory as a per-layer loop over our decoder (KEEP §4-5; CacheBlend/EPIC/Prompt Cache
baselines through the same loop).

The decoder runs one layer at a time (``PrefillRun.layer_step``: our LLaMA block's arithmetic), with ``x``
holding only the rows computed at that layer; rows the next layer drops leave right after the attention. ``PrefillRun`` (``prefill_run.py``) is the cache object the layer talks to
(the ``attend`` protocol): it owns a working buffer of the whole prompt's pre-RoPE keys per layer
(stored KV loaded for rows not computed, fresh k for computed rows), rotates all keys at their
absolute positions, and attends with a true causal mask by position (a row sees key j iff
``pos[j] <= pos[row]``). Values and rotated keys land directly in a ``FullCache`` (written through its
``buffers``, then ``hold``) that afterwards holds the whole prompt, so decoding continues with the ordinary model forward.

The paper's three interfaces: ``load_memory(memory_id, layer_id)`` (the loader calls ``load_memories``:
the memories that drop out of recomputation together, one transfer per layer), ``prefill_layer(input,
layer_id, kv)`` and ``importance_evaluation(layer_id, memory_ids, attention)``.

Units missing from the store (new or changed segments, groups that turned static or dynamic) are
prefilled first, in one forward where every unit sees the system prefix (then the prompt's
``context`` filler, if any) and itself only (``BranchCache``).
That cost is part of the time to first token.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..kv.full import FullCache, FullParams
from ..kv.rope import apply_rope, rope_cos_sin
from ..models.llama import LlamaForCausalLM
from .branches import BranchCache
from .config import PrefillConfig
from .importance import SegmentAttention, propagate_importance
from .loader import LayerLoader
from .methods import METHODS, Plan
from .prefill_run import PrefillRun
from .prompt import MemoryPrompt
from .store import KVStore, LayerRead, UnitKV, content_key

log = logging.getLogger(__name__)


@dataclass
class PrefillStats:
    """What one prefill did. Token-layers count (token, layer) pairs computed."""

    method: str
    n_tokens: int
    n_memory: int
    memory_token_layers: int  # memory tokens x layers
    recomputed_memory_token_layers: int
    computed_token_layers: int  # every computed row (prefix, memory, query) x layer
    units_built: int
    tokens_built: int
    loads: int
    bytes_loaded: int
    build_ms: float
    loop_ms: float
    ttft_ms: float
    loader_stall_ms: float
    memory_rows_per_layer: list[int] = field(default_factory=list)
    modules_per_layer: list[tuple[str, ...]] = field(default_factory=list)  # modules with a computed token

    @property
    def recompute_share(self) -> float:
        return self.recomputed_memory_token_layers / max(1, self.memory_token_layers)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [V] float32, next-token logits after the prompt
    cache: FullCache  # holds the whole prompt; continue decoding with model(ids, cache=cache)
    stats: PrefillStats
    load_log: list[tuple[str, int]]  # (module, layer) loads in order
    load_ahead: list[int]  # per load: how many layers ahead of the computing layer it finished


class PlanContext:
    """Keys a method needs: everything stored is tied to the model and the system prefix (and context
    filler) it saw."""

    def __init__(self, model_tag: str, prefix_ids: tuple[int, ...], store: KVStore, context_ids: tuple[int, ...] = ()) -> None:
        self.model_tag = model_tag
        self.prefix_ids = tuple(prefix_ids)
        self.context_ids = tuple(context_ids)
        self.store = store

    def prefix_key(self, prefix_ids) -> str:
        return content_key(self.model_tag, "prefix", tuple(prefix_ids))

    def context_key(self) -> str:
        return content_key(self.model_tag, "context", self.prefix_ids, self.context_ids)

    def unit_key(self, token_ids, *, kind: str = "unit") -> str:
        if self.context_ids and kind == "unit":
            return content_key(self.model_tag, kind, self.prefix_ids, ("context", self.context_ids), tuple(token_ids))
        return content_key(self.model_tag, kind, self.prefix_ids, tuple(token_ids))


class MemoryPrefill:
    """The engine: a model, a KV store and one method. ``run(prompt)`` -> logits + a decode-ready cache.

    ``model`` is our ``LlamaForCausalLM`` (any LLaMA/Qwen2 geometry). One run at a time: the returned
    cache is reused by the next run.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        store: KVStore,
        config: PrefillConfig | None = None,
        *,
        decode_capacity: int = 64,
    ) -> None:
        self.model = model
        self.store = store
        self.config = config or PrefillConfig()
        if self.config.method not in METHODS:
            raise KeyError(f"unknown prefill method {self.config.method!r}; available: {', '.join(sorted(METHODS))}")
        self.method = METHODS[self.config.method](self.config)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.decode_capacity = decode_capacity
        self.model_tag = self._fingerprint(model)
        self._out: FullCache | None = None
        self._run: PrefillRun | None = None

    @staticmethod
    def _fingerprint(model: LlamaForCausalLM) -> str:
        """The model's config, dtype and every weight: stored KV is tied to all of them (two models that differ in
        one attention layer must not share units). Hashes each parameter's bytes once, at construction."""
        digest = hashlib.sha1()
        for name, p in model.named_parameters():
            digest.update(name.encode())
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return content_key(repr(model.cfg), str(model.model.embed_tokens.weight.dtype), digest.hexdigest())

    # ---- the paper's interfaces -----------------------------------------------------------------
    def load_memory(self, memory_id: str, layer_id: int) -> int:
        """Copy memory ``memory_id``'s stored KV of layer ``layer_id`` into the running prefill's buffers
        (keys pre-RoPE; they are rotated to their new positions at attention). Returns bytes moved."""
        return self.load_memories([memory_id], layer_id)

    def load_memories(self, memory_ids: Sequence[str], layer_id: int) -> int:
        """``load_memory`` of several memories at one layer, as one transfer from the store (the loader's
        job for the segments that dropped out of recomputation together). Returns bytes moved."""
        run = self._run
        reads = []
        for mid in memory_ids:
            m = run.modules[mid]
            a, b = m.start, m.end
            reads.append(LayerRead(m.unit, m.offset, m.offset + m.length, run.k_pre[layer_id, :, a:b],
                                   run.out.buffers(b)[1][layer_id, 0, :, a:b]))  # fmt: skip
        return self.store.read_layers(reads, layer_id, non_blocking=self.device.type == "cuda")

    def prefill_layer(self, input: torch.Tensor, layer_id: int, kv: PrefillRun) -> tuple[torch.Tensor, PrefillRun]:
        """Run decoder layer ``layer_id`` on the computed rows ``input: [1, T, dim]`` against ``kv``.
        Returns the next layer's input (rows it still computes; after the last layer, the prompt's last row) and
        the updated KV."""
        kv.record()
        return kv.layer_step(self.model.model.layers[layer_id], input), kv

    def importance_evaluation(self, layer_id: int, memory_ids: list[str], attention: SegmentAttention) -> list[str]:
        """The memories to recompute at layer ``layer_id + 1`` (KEEP's multi-hop propagation)."""
        keep = self.method.segments_at(layer_id + 1)
        if keep is None:
            raise TypeError(f"method {self.method.name!r} does not select memories by importance")
        picked, _ = propagate_importance(
            attention, min(keep, len(memory_ids)), hops=self.config.hops, hop_weight=self.config.hop_weight
        )
        return [memory_ids[i] for i in picked]

    # ---- running --------------------------------------------------------------------------------
    def _prefix(self, ctx: PlanContext, prefix_ids: tuple[int, ...]) -> tuple[UnitKV | None, int]:
        """The system prefix's KV (built and stored when missing) and the tokens built for it."""
        if not prefix_ids:
            return None, 0
        key = ctx.prefix_key(prefix_ids)
        built = 0
        if key not in self.store:
            self.store.put(key, self._build([prefix_ids], None)[0])
            built = len(prefix_ids)
        return self.store.get(key), built

    @torch.no_grad()
    def _build(self, units: list[tuple[int, ...]], prefix: UnitKV | None) -> list[UnitKV]:
        """Prefill units in one forward, each right after the system prefix and blind to the others."""
        ctx_k = ctx_v = None
        if prefix is not None:
            cos, sin = rope_cos_sin(torch.arange(prefix.n_tokens, device=self.device), self.model.cfg.rope)
            ctx_k, ctx_v = apply_rope(prefix.k.to(self.device), cos, sin), prefix.v.to(self.device)  # [L, Hkv, P, D]
        lengths = [len(u) for u in units]
        cache = BranchCache.for_model(self.model, lengths, ctx_k, ctx_v)
        ids = torch.tensor([[t for u in units for t in u]], device=self.device)
        self.model.model(ids, cache=cache)
        out, a = [], 0
        for n in lengths:
            out.append(UnitKV(cache.k[:, :, a : a + n].clone(), cache.v[:, :, a : a + n].clone()))
            a += n
        return out

    def _ensure_units(self, ctx: PlanContext, prompt: MemoryPrompt, plan: Plan) -> tuple[int, int]:
        missing = {}
        for u in plan.units:
            if u.key not in self.store and u.key not in missing:
                missing[u.key] = u.token_ids
        needs_prefix = bool(missing) or any(m.id == "<prefix>" for m in plan.modules)
        prefix, prefix_built = self._prefix(ctx, prompt.prefix_ids) if needs_prefix else (None, 0)
        context_built = 0
        if missing:
            if prompt.context_ids:  # units see [prefix][context]: the context's KV is built once and stored
                key = ctx.context_key()
                if key not in self.store:
                    self.store.put(key, self._build([prompt.context_ids], prefix)[0])
                    context_built = len(prompt.context_ids)
                ckv = self.store.get(key)
                prefix = ckv if prefix is None else UnitKV(torch.cat([prefix.k, ckv.k], dim=2), torch.cat([prefix.v, ckv.v], dim=2))
            for key, kv in zip(missing, self._build(list(missing.values()), prefix)):
                self.store.put(key, kv)
        built = len(missing) + bool(prefix_built) + bool(context_built)
        return built, sum(len(t) for t in missing.values()) + prefix_built + context_built

    def _out_cache(self, n_tokens: int) -> FullCache:
        need = n_tokens + self.decode_capacity
        if self._out is None or self._out.capacity < need:
            self._out = FullCache(self.model.cfg.geometry, FullParams(capacity=need), device=self.device, dtype=self.dtype)
        self._out.reset()
        return self._out

    @torch.no_grad()
    def run(self, prompt: MemoryPrompt) -> PrefillResult:
        """Prefill ``prompt``; returns the next-token logits, a decode-ready cache and what it cost."""
        cfg = self.model.cfg
        if prompt.n_tokens + self.decode_capacity > cfg.max_position:
            raise ValueError(
                f"prompt of {prompt.n_tokens} tokens (+{self.decode_capacity} to decode) exceeds the model's "
                f"{cfg.max_position} positions; retrieve fewer segments"
            )
        t0 = time.perf_counter()
        ctx = PlanContext(self.model_tag, prompt.prefix_ids, self.store, prompt.context_ids)
        plan = self.method.plan(prompt, ctx)
        keys = {m.unit for m in plan.modules if m.unit is not None} | {u.key for u in plan.units}
        if prompt.context_ids:  # the context filler's KV is stored, then read while the units are built
            keys.add(ctx.context_key())
        with self.store.pinned(keys):
            built, built_tokens = self._ensure_units(ctx, prompt, plan)
            t_built = time.perf_counter()
            run = PrefillRun(self, prompt, plan, ctx, self._out_cache(prompt.n_tokens))
            self._run = run
            loader = LayerLoader(self.load_memories, cfg.n_layers, self.config.load_schedule, device=self.device)
            run.loader = loader
            try:
                needed = run.needed_from_stored(run.computed)
                loader.need([m.id for m in plan.modules if m.id in needed], range(cfg.n_layers))
                if plan.stored_value_layers:  # CacheBlend compares with the stored values of the others
                    others = [m.id for m in plan.modules if m.unit is not None and m.id not in needed]
                    loader.need(others, sorted(plan.stored_value_layers))
                ids = torch.tensor(prompt.token_ids(), device=self.device)
                x = self.model.model.embed_tokens(ids[run.rows])[None]  # [1, T, dim]
                for layer in range(cfg.n_layers):
                    loader.begin_layer(layer)
                    x, run = self.prefill_layer(x, layer, run)
                logits = self.model.lm_head(self.model.model.norm(x[:, -1:])).float()[0, -1]
            finally:
                loader.close()
            run.out.hold(prompt.n_tokens)
            run.out.bias_keys(run.key_bias)
            self.method.finish(run)
        t1 = time.perf_counter()
        n_mem = prompt.n_memory
        stats = PrefillStats(
            method=self.method.name,
            n_tokens=prompt.n_tokens,
            n_memory=n_mem,
            memory_token_layers=n_mem * cfg.n_layers,
            recomputed_memory_token_layers=sum(run.stats_rows),
            computed_token_layers=sum(run.stats_total),
            units_built=built,
            tokens_built=built_tokens,
            loads=len(loader.log),
            bytes_loaded=loader.bytes,
            build_ms=(t_built - t0) * 1e3,
            loop_ms=(t1 - t_built) * 1e3,
            ttft_ms=(t1 - t0) * 1e3,
            loader_stall_ms=loader.stall_s * 1e3,
            memory_rows_per_layer=run.stats_rows,
            modules_per_layer=run.stats_modules,
        )
        self._run = None
        return PrefillResult(logits=logits, cache=run.out, stats=stats, load_log=list(loader.log), load_ahead=list(loader.ahead))
