"""Configs of the KEEP memory stack: memory (segments, grouping, retrieval), KV store tiers, prefill method.

Each is a dataclass with working defaults, validated in ``__post_init__``; strings (method, tier and
schedule names) are resolved through registries where they are used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

LOAD_SCHEDULES = ("serial", "next_layer", "balanced")
TIER_KINDS = ("device", "host", "disk")


@dataclass
class MemoryConfig:
    """Segments, static/dynamic grouping and retrieval.

    Args:
        static_after: ``t``: a group is static once none of its segments (nor its membership) changed
            for this many steps; static groups are prefilled jointly, dynamic ones per segment.
        cluster_threshold: cosine similarity (all-MiniLM-L6-v2) between a new segment and a group's
            centroid needed to join that group; below it the segment starts a new group.
        max_group_size: a group never holds more segments than this (joint prefills stay short).
        top_k: segments retrieved per query (static groups count their members).
        segment_suffix: appended to every segment's text before tokenising (KEEP: one per line).
    """

    static_after: int = 10
    cluster_threshold: float = 0.5
    max_group_size: int = 8
    top_k: int = 20
    segment_suffix: str = "\n"

    def __post_init__(self) -> None:
        if self.static_after < 1:
            raise ValueError(f"`static_after` must be >= 1 step, got {self.static_after}")
        if not -1.0 <= self.cluster_threshold <= 1.0:
            raise ValueError(f"`cluster_threshold` is a cosine similarity in [-1, 1], got {self.cluster_threshold}")
        if self.max_group_size < 1:
            raise ValueError(f"`max_group_size` must be >= 1, got {self.max_group_size}")
        if self.top_k < 1:
            raise ValueError(f"`top_k` must be >= 1, got {self.top_k}")


@dataclass
class TierConfig:
    """One level of the KV store.

    Args:
        kind: ``device`` (the compute device), ``host`` (CPU RAM, pinned on CUDA machines) or ``disk``
            (one safetensors file per unit under ``path``).
        budget_bytes: bytes this tier may hold; least recently used units move down a tier (or are
            dropped from the last one) when it is over budget.
        bandwidth: bytes/s to emulate for reads from this tier (a slow link on a machine that has none);
            ``None`` reads at full speed.
        path: directory of the ``disk`` tier.
    """

    kind: str = "host"
    budget_bytes: int = 4 << 30
    bandwidth: float | None = None
    path: str | Path | None = None

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise ValueError(f"tier `kind` is {self.kind!r}; expected one of {', '.join(TIER_KINDS)}")
        if self.budget_bytes < 0:
            raise ValueError(f"tier `budget_bytes` must be >= 0, got {self.budget_bytes}")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"tier `bandwidth` must be > 0 bytes/s or None, got {self.bandwidth}")
        if self.kind == "disk" and self.path is None:
            raise ValueError("a `disk` tier needs `path` (a directory for its safetensors files)")


@dataclass
class StoreConfig:
    """Tiers from fastest to slowest. Default: one 4 GiB CPU-RAM tier."""

    tiers: list[TierConfig] = field(default_factory=lambda: [TierConfig()])

    def __post_init__(self) -> None:
        self.tiers = [TierConfig(**t) if isinstance(t, dict) else t for t in self.tiers]
        if not self.tiers:
            raise ValueError("`tiers` must name at least one tier")
        kinds = [t.kind for t in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"each tier kind may appear once, got {kinds}")


@dataclass
class PrefillConfig:
    """How a prefill with memory obtains the memory's KV (``method``) and its knobs.

    Args:
        method: ``keep`` | ``full`` (recompute everything, text memory) | ``prefix`` (prefix caching) |
            ``reuse`` (full reuse, Prompt Cache) | ``cacheblend`` | ``epic``.
        decay: KEEP: the share of memory segments recomputed at layer l is ``decay ** l``. 0.5 (0.8 until
            issue 20's decay sweep, then 0.6): on 200 KitchenWorld and 200 PlanWorld questions each step down
            agreed with full recomputation as often (0.5: 148 and 139, 0.6: 147 and 137, 0.8: 145 and 138) and
            was faster (0.5 against 0.6: 1.08-1.10x). On SmolLM2-135M recomputation past the lowest layers buys
            no agreement (see the README); a larger model may need a slower decay.
        ratios: KEEP: explicit per-layer shares (the last one repeats); overrides ``decay``.
            ``(0.0,)`` recomputes nothing (= full reuse); ``(1.0,)`` recomputes everything.
        min_keep: KEEP: at least this many segments stay recomputed while any are (released code: 1).
        ref_tokens: KEEP: the last query rows (and last rows of each segment) whose attention scores importance.
        hops: KEEP: multi-hop propagation rounds until the selected set is stable; 0 = query attention only
            (the default since issue 20: on KitchenWorld with SmolLM2-135M, 200 questions, 4 rounds changed
            agreement with full recomputation on 7 questions, 2 for and 5 against; see the README).
        hop_weight: KEEP: weight of propagated importance against the query's own attention.
        sink_tokens: KEEP: leading tokens of each segment left out of its score (attention sinks).
        static_grouping: KEEP: static groups keep their joint KV; ``False`` (the default since issue 20)
            stores every segment alone. Joint KV did not earn its place: 200 KitchenWorld questions with the
            context filler, 10 answers lost and 2 gained against per-segment KV (p = 0.039); PlanWorld
            (40 questions) 6 lost, 0 gained.
        recompute_ratio: CacheBlend: share of memory tokens recomputed after the check layer.
        check_layer: CacheBlend: layer whose value deviation selects the tokens (0 and it compute everything).
        block_tokens: CacheBlend: fixed-size token blocks its KV is stored in (LMCache's 256); 0 = one per segment.
        epic_k: EPIC (LegoLink-k): leading tokens of every segment recomputed at every layer.
        stored_bias: subtracted from every attention score of a memory key read from stored KV at a layer (a
            segment not recomputed there; exact units excluded), in the prefill and in every decode after it
            (``FullCache.bias_keys``). Stored KV draws more of the query's attention than the same tokens in
            context, so a segment KEEP recomputes loses that edge to the ones it does not. 0 = off (the default:
            on 200 KitchenWorld questions B = 1 agreed with full recomputation as often as full reuse, 149
            each, and answered 5 fewer right; B = 2 answered 17 fewer right; see the README).
        load_schedule: ``balanced`` (loader thread, next layer first then preloads deeper layers of
            segments that can no longer be recomputed), ``next_layer`` (loader one layer ahead), ``serial``.
    """

    method: str = "keep"
    decay: float = 0.5
    ratios: tuple[float, ...] | None = None
    min_keep: int = 1
    ref_tokens: int = 3
    hops: int = 0
    hop_weight: float = 1.0
    sink_tokens: int = 1
    static_grouping: bool = False
    recompute_ratio: float = 0.15
    check_layer: int = 1
    block_tokens: int = 256
    epic_k: int = 4
    stored_bias: float = 0.0
    load_schedule: str = "balanced"

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"`decay` must be in (0, 1], got {self.decay}")
        if self.ratios is not None:
            self.ratios = tuple(float(r) for r in self.ratios)
            if not self.ratios or any(not 0.0 <= r <= 1.0 for r in self.ratios):
                raise ValueError(f"`ratios` must be a non-empty list of shares in [0, 1], got {self.ratios}")
            if any(b > a for a, b in zip(self.ratios, self.ratios[1:])):
                raise ValueError(f"`ratios` must not increase from layer to layer (the set only shrinks), got {self.ratios}")
        for name in ("min_keep", "ref_tokens", "hops", "sink_tokens", "check_layer", "block_tokens", "epic_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
        if self.ref_tokens < 1:
            raise ValueError(f"`ref_tokens` must be >= 1, got {self.ref_tokens}")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"`recompute_ratio` must be in [0, 1], got {self.recompute_ratio}")
        if not 0.0 <= self.stored_bias < float("inf"):
            raise ValueError(f"`stored_bias` must be a finite score offset >= 0, got {self.stored_bias}")
        if self.hop_weight < 0:
            raise ValueError(f"`hop_weight` must be >= 0, got {self.hop_weight}")
        if self.load_schedule not in LOAD_SCHEDULES:
            raise ValueError(f"`load_schedule` is {self.load_schedule!r}; expected one of {', '.join(LOAD_SCHEDULES)}")

    def ratio(self, layer: int) -> float:
        """KEEP's share of segments recomputed at ``layer``."""
        if self.ratios is not None:
            return self.ratios[min(layer, len(self.ratios) - 1)]
        return self.decay**layer
