"""How each method obtains the memory's KV in the shared per-layer prefill loop.

A method decides (1) how the memory is cut into stored KV **units** and which prompt ranges
(**modules**) are read from which unit, (2) which token positions are computed at layer 0, and
(3) after each layer's attention, which of them stay computed (the set only shrinks; every token
not computed at a layer uses stored KV re-positioned to where it now sits).

* ``full``: recompute everything (text memory).
* ``prefix``: exact reuse of the longest token prefix shared with an earlier prompt, the rest computed.
* ``reuse``: every segment's stored KV, only the query computed (Prompt Cache / full reuse).
* ``cacheblend``: KV stored in fixed-size token blocks; layers 0..check compute every memory token, then the
  ``recompute_ratio`` tokens whose values deviate most from the stored ones at the check layer.
* ``epic``: the first ``epic_k`` tokens of every segment recomputed at every layer (LegoLink-k).
* ``keep``: static groups stored jointly, dynamic segments alone; all segments at layer 0, then per layer
  the ``ratio(l)`` most important segments by multi-hop importance propagation.

The system prefix is always exact cached KV (except in ``full``). A unit placed right after the
prefix was prefilled in exactly this context (unless the prompt has a ``context`` filler), so its KV is
exact and never needs recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .config import PrefillConfig
from .importance import SegmentAttention, reduce_attention
from .prompt import MemoryPrompt

if TYPE_CHECKING:
    from .prefill import PlanContext
    from .prefill_run import AttentionView, PrefillRun


@dataclass(frozen=True)
class Module:
    """A prompt range ``[start, end)`` whose stored KV lives in ``unit`` from ``offset`` on.

    ``unit is None``: never stored, always computed. ``exact``: the stored KV equals what a full
    prefill computes here (loaded, never recomputed)."""

    id: str
    start: int
    end: int
    unit: str | None = None
    offset: int = 0
    exact: bool = False

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class UnitSpec:
    """A unit that must be in the store: its key and tokens (prefilled after the system prefix)."""

    key: str
    token_ids: tuple[int, ...]


@dataclass
class Plan:
    modules: list[Module]
    units: list[UnitSpec]
    computed: torch.Tensor  # [S] bool, positions computed at layer 0
    stored_value_layers: frozenset[int] = field(default_factory=frozenset)  # layers that compare fresh vs stored V


def _positions(n: int, ranges) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for a, b in ranges:
        mask[a:b] = True
    return mask


class RecomputeMethod:
    """Base: subclasses set ``name`` and implement ``plan``; the rest are no-op hooks."""

    name = ""

    def __init__(self, cfg: PrefillConfig) -> None:
        self.cfg = cfg

    def plan(self, prompt: MemoryPrompt, ctx: "PlanContext") -> Plan:
        raise NotImplementedError

    def after_attention(self, layer: int, view: "AttentionView") -> torch.Tensor | None:
        """The positions computed at ``layer + 1`` ([S] bool, a subset of this layer's), or None = same."""
        return None

    def finish(self, run: "PrefillRun") -> None:
        """Called after the last layer (prefix caching keeps the prompt's KV)."""

    def segments_at(self, layer: int) -> int | None:
        """How many segments stay recomputed at ``layer`` (None: the method does not select segments)."""
        return None

    # helpers shared by the segment-based methods
    @staticmethod
    def _prefix_module(prompt: MemoryPrompt, ctx: "PlanContext") -> tuple[list[Module], list[UnitSpec]]:
        if not prompt.n_prefix:
            return [], []
        key = ctx.prefix_key(prompt.prefix_ids)
        return [Module("<prefix>", 0, prompt.n_prefix, key, 0, exact=True)], []

    def _segment_units(self, prompt: MemoryPrompt, ctx: "PlanContext", *, joint: bool) -> tuple[list[Module], list[UnitSpec]]:
        """One module per segment; units per segment, or per prompt unit when ``joint`` (static groups)."""
        modules, units = self._prefix_module(prompt, ctx)
        spans = prompt.spans()
        starts = prompt.unit_starts()
        for i, unit in enumerate(prompt.units):
            mine = [s for s in spans if s.unit == i]
            if joint:
                key = ctx.unit_key(unit.token_ids)
                units.append(UnitSpec(key, unit.token_ids))
                for s in mine:
                    modules.append(Module(s.id, s.start, s.end, key, s.start - starts[i], exact=starts[i] == prompt.n_prefix and not prompt.context_ids))
            else:
                for seg, s in zip(unit.segments, mine):
                    key = ctx.unit_key(seg.token_ids)
                    units.append(UnitSpec(key, seg.token_ids))
                    modules.append(Module(s.id, s.start, s.end, key, 0, exact=s.start == prompt.n_prefix and not prompt.context_ids))
        return modules, units


class FullRecompute(RecomputeMethod):
    name = "full"

    def plan(self, prompt, ctx):
        return Plan([], [], torch.ones(prompt.n_tokens, dtype=torch.bool))


class PrefixCaching(RecomputeMethod):
    """Keeps the KV of recent prompts' ``[prefix + memory]`` (exact, positions 0..) and reuses the
    longest common token prefix with the new prompt."""

    name = "prefix"
    max_prompts = 4

    def __init__(self, cfg):
        super().__init__(cfg)
        self._prompts: list[tuple[tuple[int, ...], str]] = []  # (tokens, store key), most recent last

    def plan(self, prompt, ctx):
        tokens = prompt.token_ids()[: prompt.memory_end]
        best, best_key = 0, None
        for stored, key in self._prompts:
            if key not in ctx.store:
                continue
            n = 0
            for a, b in zip(stored, tokens):
                if a != b:
                    break
                n += 1
            if n > best:
                best, best_key = n, key
        modules = [Module("<prefix-cache>", 0, best, best_key, 0, exact=True)] if best else []
        computed = torch.ones(prompt.n_tokens, dtype=torch.bool)
        computed[:best] = False
        return Plan(modules, [], computed)

    def finish(self, run):
        n = run.prompt.memory_end
        tokens = tuple(run.prompt.token_ids()[:n])
        key = run.ctx.unit_key(tokens, kind="prompt")
        run.store_prompt_kv(key, n)
        self._prompts = [p for p in self._prompts if p[1] != key][-(self.max_prompts - 1) :] + [(tokens, key)]


class FullReuse(RecomputeMethod):
    name = "reuse"

    def plan(self, prompt, ctx):
        modules, units = self._segment_units(prompt, ctx, joint=False)
        return Plan(modules, units, _positions(prompt.n_tokens, [(prompt.memory_end, prompt.n_tokens)]))


class Epic(RecomputeMethod):
    name = "epic"

    def plan(self, prompt, ctx):
        modules, units = self._segment_units(prompt, ctx, joint=False)
        heads = [(m.start, min(m.end, m.start + self.cfg.epic_k)) for m in modules if not m.exact]
        return Plan(modules, units, _positions(prompt.n_tokens, [*heads, (prompt.memory_end, prompt.n_tokens)]))


class CacheBlend(RecomputeMethod):
    name = "cacheblend"

    def plan(self, prompt, ctx):
        if self.cfg.block_tokens == 0:
            modules, units = self._segment_units(prompt, ctx, joint=False)
        else:
            modules, units = self._prefix_module(prompt, ctx)
            ids = prompt.token_ids()
            b = self.cfg.block_tokens
            for i, a in enumerate(range(prompt.n_prefix, prompt.memory_end, b)):
                end = min(a + b, prompt.memory_end)
                block = tuple(ids[a:end])
                key = ctx.unit_key(block)
                units.append(UnitSpec(key, block))
                modules.append(Module(f"<block {i}>", a, end, key, 0, exact=a == prompt.n_prefix and not prompt.context_ids))
        computed = _positions(prompt.n_tokens, [(prompt.n_prefix, prompt.n_tokens)])
        return Plan(modules, units, computed, stored_value_layers=frozenset({self.cfg.check_layer}))

    def after_attention(self, layer, view):
        if layer != self.cfg.check_layer:
            return None
        prompt = view.run.prompt
        rows = view.rows
        memory = (rows >= prompt.n_prefix) & (rows < prompt.memory_end)  # [T]
        deviation = ((view.v_fresh - view.v_stored) ** 2).sum(dim=(0, 2))  # [T]
        n = int(round(self.cfg.recompute_ratio * prompt.n_memory))
        keep = torch.zeros_like(memory)
        if n:
            top = torch.topk(deviation.masked_fill(~memory, float("-inf")), min(n, int(memory.sum()))).indices
            keep[top] = True
        nxt = torch.zeros(prompt.n_tokens, dtype=torch.bool)
        nxt[rows[keep | (rows >= prompt.memory_end)]] = True
        return nxt


class Keep(RecomputeMethod):
    name = "keep"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.n_segments = 0
        self._selected: list[Module] = []

    def plan(self, prompt, ctx):
        modules, units = self._segment_units(prompt, ctx, joint=self.cfg.static_grouping)
        candidates = [m for m in modules if m.unit is not None and not m.exact]
        self.n_segments = len(candidates)
        first = self.segments_at(0)
        if 0 < first < len(candidates):
            raise ValueError(f"KEEP's layer-0 share must be 0 or 1 (all segments or none), got {self.cfg.ratio(0)}")
        self._selected = candidates if first else []
        ranges = [(m.start, m.end) for m in self._selected] + [(prompt.memory_end, prompt.n_tokens)]
        return Plan(modules, units, _positions(prompt.n_tokens, ranges))

    def segments_at(self, layer: int) -> int:
        """Segments recomputed at ``layer``: ``max(min_keep, int(N * ratio(layer)))`` (0 if the share is 0)."""
        share = self.cfg.ratio(layer)
        if share <= 0 or not self.n_segments:
            return 0
        return min(self.n_segments, max(self.cfg.min_keep, int(self.n_segments * share + 1e-9)))

    def after_attention(self, layer, view):
        if layer + 1 >= view.run.n_layers:
            return None
        keep = min(self.segments_at(layer + 1), len(self._selected))
        if keep == len(self._selected):
            return None
        ids = view.run.importance_evaluation(layer, [m.id for m in self._selected], self.segment_attention(view))
        chosen = set(ids)
        self._selected = [m for m in self._selected if m.id in chosen]
        prompt = view.run.prompt
        return _positions(prompt.n_tokens, [(m.start, m.end) for m in self._selected] + [(prompt.memory_end, prompt.n_tokens)])

    def segment_attention(self, view: "AttentionView") -> SegmentAttention:
        """Query -> segment and segment -> segment attention among the currently recomputed segments."""
        rows = view.rows
        ref = self.cfg.ref_tokens
        prompt = view.run.prompt
        device = rows.device  # the model's
        q_rows = torch.arange(max(prompt.memory_end, prompt.n_tokens - ref), prompt.n_tokens, device=device)
        groups_pos = [q_rows] + [torch.arange(max(m.start, m.end - ref), m.end, device=device) for m in self._selected]
        all_pos = torch.cat(groups_pos)
        idx = torch.searchsorted(rows, all_pos)  # rows is sorted; every scoring row is computed
        probs = view.probs(idx)  # [R, S]
        bounds, groups = 0, []
        for g in groups_pos:
            groups.append(torch.arange(bounds, bounds + g.numel(), device=device))
            bounds += g.numel()
        spans = [(m.start, m.end) for m in self._selected]
        seg = reduce_attention(probs, groups, spans, sink_tokens=self.cfg.sink_tokens)  # [1 + N, N]
        return SegmentAttention(query=seg[0], cross=seg[1:])


METHODS: dict[str, type[RecomputeMethod]] = {
    m.name: m for m in (FullRecompute, PrefixCaching, FullReuse, CacheBlend, Epic, Keep)
}
