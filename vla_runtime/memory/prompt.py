"""The token layout of a prompt with memory: ``[system prefix][memory units ...][query]``.

Stored unit KV is prefilled after ``[system prefix][context]``: ``context`` (empty by default) is a
fixed filler that is never part of the prompt; it conditions every stored unit as if it sat deeper in
a memory (issue 20: a unit prefilled right after the prefix over-attracts the query's attention).

Every segment is tokenised on its own (text + ``segment_suffix``), so the concatenation is the same
token sequence whichever way a method stores or recomputes it, and a segment's tokens never change
while its text does not. A static group's unit is its members' tokens back to back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

from .bank import MemoryUnit


@dataclass(frozen=True)
class PromptSegment:
    id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PromptUnit:
    """A unit as the prefill sees it: ``joint`` units (static groups) were prefilled together."""

    id: str
    segments: tuple[PromptSegment, ...]
    joint: bool = False

    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for s in self.segments for t in s.token_ids)


@dataclass(frozen=True)
class SegmentSpan:
    """Where a segment sits in the prompt: absolute positions ``[start, end)``; ``unit`` indexes ``units``."""

    id: str
    unit: int
    start: int
    end: int


@dataclass(frozen=True)
class MemoryPrompt:
    prefix_ids: tuple[int, ...]
    units: tuple[PromptUnit, ...]
    query_ids: tuple[int, ...]
    context_ids: tuple[int, ...] = ()  # stored units are prefilled after prefix + context (not in the prompt)

    def __post_init__(self) -> None:
        if not self.query_ids:
            raise ValueError("a prompt needs at least one query token")
        ids = [s.id for u in self.units for s in u.segments]
        if len(set(ids)) != len(ids):
            raise ValueError(f"segment ids repeat in the prompt: {sorted({i for i in ids if ids.count(i) > 1})}")

    @property
    def n_prefix(self) -> int:
        return len(self.prefix_ids)

    @cached_property
    def n_memory(self) -> int:
        return sum(len(u.token_ids) for u in self.units)

    @property
    def n_tokens(self) -> int:
        return self.n_prefix + self.n_memory + len(self.query_ids)

    @property
    def memory_end(self) -> int:
        return self.n_prefix + self.n_memory

    def token_ids(self) -> list[int]:
        return [*self.prefix_ids, *(t for u in self.units for t in u.token_ids), *self.query_ids]

    def spans(self) -> list[SegmentSpan]:
        out, pos = [], self.n_prefix
        for i, unit in enumerate(self.units):
            for seg in unit.segments:
                out.append(SegmentSpan(seg.id, i, pos, pos + len(seg.token_ids)))
                pos += len(seg.token_ids)
        return out

    def unit_starts(self) -> list[int]:
        out, pos = [], self.n_prefix
        for unit in self.units:
            out.append(pos)
            pos += len(unit.token_ids)
        return out


class PromptBuilder:
    """Tokenises segments (memoised by text) and lays out prompts for one tokenizer."""

    def __init__(self, tokenizer, *, segment_suffix: str = "\n", cache_size: int = 8192) -> None:
        self.tokenizer = tokenizer
        self.segment_suffix = segment_suffix
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` without special tokens added (BOS etc.)."""
        if text in self._cache:
            self._cache.move_to_end(text)
            return self._cache[text]
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self._cache[text] = ids
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ids

    def unit(self, unit: MemoryUnit) -> PromptUnit:
        segs = tuple(PromptSegment(s.id, self.encode(s.text + self.segment_suffix)) for s in unit.segments)
        empty = [s.id for s in segs if not s.token_ids]
        if empty:
            raise ValueError(f"segments {empty} tokenise to nothing")
        return PromptUnit(unit.id, segs, joint=unit.static and len(segs) > 1)

    def build(self, prefix: str, units: list[MemoryUnit], query: str, *, context: str = "") -> MemoryPrompt:
        """``prefix`` and ``query`` are raw text (chat-template markup included, special tokens as text);
        ``context``: the filler stored units are prefilled after (never in the prompt; "" = none)."""
        ctx = self.encode(context) if context else ()
        return MemoryPrompt(self.encode(prefix), tuple(self.unit(u) for u in units), self.encode(query), ctx)
