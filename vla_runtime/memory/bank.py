"""Embodied memory: segments with versions, semantic groups that turn static or dynamic, retrieval.

A **segment** is one piece of memory (an object's state dict, a layout fact, a past task) with an id,
its text, a version that increases on every change, and the step it last changed. Segments are
clustered into **groups** by the sentence encoder: a new segment joins the group whose centroid is
most similar (cosine >= ``cluster_threshold``, group not full), else it starts a new one; a segment
keeps its group for life (so a KV unit's identity does not flicker with wording changes).

A group is **static** once neither its members' texts nor its membership changed for ``t`` steps
(``static_after``); it is then one KV unit, prefilled jointly. A **dynamic** group's segments are
separate units. An update to any member makes the group dynamic again at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .config import MemoryConfig
from .encoder import TextEncoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentView:
    """An immutable snapshot of a segment (what a prompt is built from)."""

    id: str
    text: str
    version: int


@dataclass
class Segment:
    id: str
    text: str
    version: int
    changed_step: int
    order: int  # creation order, for a stable prompt order
    group: int
    embedding: torch.Tensor  # [d], unit norm: of the current text (retrieval)
    joined: torch.Tensor  # [d]: of the text it joined its group with (the group's centroid counts this one)

    def view(self) -> SegmentView:
        return SegmentView(self.id, self.text, self.version)


@dataclass
class Group:
    id: int
    members: list[str] = field(default_factory=list)  # segment ids in joining order
    changed_step: int = 0  # last step a member's text or the membership changed
    centroid_sum: torch.Tensor | None = None  # sum of member embeddings at joining time


@dataclass(frozen=True)
class MemoryUnit:
    """What retrieval returns and a prompt is built from: a static group (one jointly prefilled unit)
    or one dynamic segment. ``score`` is its cosine similarity to the query (max over members)."""

    id: str
    static: bool
    segments: tuple[SegmentView, ...]
    score: float = 0.0
    order: tuple[int, int] = (0, 0)  # stable prompt order: static groups by group id, then segments by age


class EmbodiedMemory:
    """Segments + groups + the step clock. ``step`` advances with ``advance()``; every change made in
    between is stamped with the current step."""

    def __init__(self, encoder: TextEncoder, config: MemoryConfig | None = None) -> None:
        self.encoder = encoder
        self.config = config or MemoryConfig()
        self.step = 0
        self._segments: dict[str, Segment] = {}
        self._groups: dict[int, Group] = {}
        self._next_order = 0
        self._next_group = 0

    # ---- segments -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, segment_id: str) -> bool:
        return segment_id in self._segments

    def get(self, segment_id: str) -> Segment:
        if segment_id not in self._segments:
            raise KeyError(f"no memory segment {segment_id!r}")
        return self._segments[segment_id]

    def segments(self) -> list[Segment]:
        return sorted(self._segments.values(), key=lambda s: s.order)

    @staticmethod
    def _check(segment_id: str, text: str) -> None:
        if not isinstance(segment_id, str) or not segment_id:
            raise ValueError(f"segment id must be a non-empty string, got {segment_id!r}")
        if segment_id.startswith("<"):  # the prefill's modules ("<prefix>", "<block 0>") share the namespace
            raise ValueError(f"segment id {segment_id!r}: ids starting with '<' are the prefill's own")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"segment {segment_id!r}: text must be a non-empty string")

    def add(self, segment_id: str, text: str) -> Segment:
        """A new segment, grouped by similarity. Raises ``ValueError`` if the id exists."""
        self._check(segment_id, text)
        if segment_id in self._segments:
            raise ValueError(f"segment {segment_id!r} already exists; use update()")
        emb = self.encoder.encode([text])[0]
        group = self._assign_group(emb)
        seg = Segment(segment_id, text, 0, self.step, self._next_order, group.id, emb, emb)
        self._next_order += 1
        self._segments[segment_id] = seg
        group.members.append(segment_id)
        group.centroid_sum = emb.clone() if group.centroid_sum is None else group.centroid_sum + emb
        group.changed_step = self.step
        return seg

    def update(self, segment_id: str, text: str) -> bool:
        """New text for a segment. Returns False (and changes nothing) when the text is the same."""
        self._check(segment_id, text)
        seg = self.get(segment_id)
        if seg.text == text:
            return False
        seg.embedding = self.encoder.encode([text])[0]  # retrieval ranks the text it holds now
        seg.text = text
        seg.version += 1
        seg.changed_step = self.step
        self._groups[seg.group].changed_step = self.step
        return True

    def upsert(self, segment_id: str, text: str) -> bool:
        """``add`` or ``update``; returns whether anything changed."""
        if segment_id in self._segments:
            return self.update(segment_id, text)
        self.add(segment_id, text)
        return True

    def delete(self, segment_id: str) -> None:
        seg = self.get(segment_id)
        group = self._groups[seg.group]
        group.members.remove(segment_id)
        group.changed_step = self.step
        if group.centroid_sum is not None:
            group.centroid_sum = group.centroid_sum - seg.joined
        if not group.members:
            del self._groups[group.id]
        del self._segments[segment_id]

    def advance(self, steps: int = 1) -> int:
        """Move the step clock forward; returns the new step."""
        if steps < 0:
            raise ValueError(f"`steps` must be >= 0, got {steps}")
        self.step += steps
        return self.step

    # ---- groups ---------------------------------------------------------------------------------
    def _assign_group(self, emb: torch.Tensor) -> Group:
        best, best_sim = None, self.config.cluster_threshold
        for group in self._groups.values():
            if len(group.members) >= self.config.max_group_size or group.centroid_sum is None:
                continue
            sim = float(torch.nn.functional.normalize(group.centroid_sum, dim=0) @ emb)
            if sim >= best_sim:
                best, best_sim = group, sim
        if best is None:
            best = Group(self._next_group)
            self._groups[best.id] = best
            self._next_group += 1
        return best

    def groups(self) -> list[Group]:
        return [self._groups[k] for k in sorted(self._groups)]

    def is_static(self, group: Group) -> bool:
        """Static iff neither texts nor membership changed in the last ``static_after`` steps."""
        return self.step - group.changed_step >= self.config.static_after

    def units(self) -> list[MemoryUnit]:
        """Every memory unit in the stable prompt order: static groups (by group id) first, then dynamic
        segments (by creation order)."""
        return self._order(self._all_units({}))

    def _all_units(self, scores: dict[str, float]) -> list[MemoryUnit]:
        units = []
        for group in self.groups():
            members = [self._segments[m] for m in group.members]
            if self.is_static(group):
                views = tuple(s.view() for s in sorted(members, key=lambda s: s.order))
                score = max(scores.get(s.id, 0.0) for s in members)
                units.append(MemoryUnit(f"group:{group.id}", True, views, score, (0, group.id)))
            else:
                units.extend(MemoryUnit(s.id, False, (s.view(),), scores.get(s.id, 0.0), (1, s.order)) for s in members)
        return units

    @staticmethod
    def _order(units: list[MemoryUnit]) -> list[MemoryUnit]:
        return sorted(units, key=lambda u: u.order)

    # ---- retrieval ------------------------------------------------------------------------------
    def retrieve(self, query: str, k: int | None = None) -> list[MemoryUnit]:
        """Top-``k`` segments by cosine similarity to ``query``: static groups are taken whole (their
        score is their best member's) and only if they fit in the remaining ``k``, dynamic segments one
        by one. Returned in the stable prompt order of ``units()``."""
        k = self.config.top_k if k is None else k
        if k < 1:
            raise ValueError(f"`k` must be >= 1, got {k}")
        if not self._segments:
            return []
        segs = self.segments()
        q = self.encoder.encode([query])[0]
        sims = torch.stack([s.embedding for s in segs]) @ q  # [n]
        scores = {s.id: float(v) for s, v in zip(segs, sims)}
        chosen, used = [], 0
        for unit in sorted(self._all_units(scores), key=lambda u: -u.score):
            if used + len(unit.segments) <= k:
                chosen.append(unit)
                used += len(unit.segments)
            if used == k:
                break
        return self._order(chosen)
