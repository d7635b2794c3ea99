"""The KV seam: what the decoder calls, what a session calls, the stats a cache reports and the base of
every cache's hyper-parameters.

The decoder computes q/k/v (k *before* RoPE) and calls ``cache.attend(layer, q, k, v)``, then
``cache.end_forward()`` once per forward (``AttendSeam``); the cache stores, assigns positions, applies
RoPE and computes attention (DESIGN §3). A session owns the cache for an episode and also marks, rolls
back, resets and reads stats (``EpisodeCache``). A registered cache is both (``KVCache``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from .gate import ChunkGateConfig
    from .geometry import CacheGeometry

KV_BACKENDS = ("auto", "torch", "triton")

P = TypeVar("P", bound="CacheParams")


@dataclass(frozen=True)
class KVStats:
    """What a cache holds after the last forward.

    Args:
        tokens_raw: uncompressed tokens held (pinned prefix + raw window + pending raw), per layer.
        tokens_compressed: chunk representatives held, averaged over layers.
        chunks_retained: chunks kept, summed over layers.
        chunks_dropped: chunks dropped by the gate or evicted by the budget, summed over layers.
        bytes: bytes of K/V actually held (valid entries only, all layers).
        positions_used: largest position id used so far + 1 (must stay below the model's limit).
        retained_ratio: retained / (retained + dropped) chunks; 1.0 when nothing was chunked.
        tokens_seen: tokens appended since the last reset.
    """

    tokens_raw: int = 0
    tokens_compressed: float = 0.0
    chunks_retained: int = 0
    chunks_dropped: int = 0
    bytes: int = 0
    positions_used: int = 0
    retained_ratio: float = 1.0
    tokens_seen: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@runtime_checkable
class AttendSeam(Protocol):
    """What the decoder needs (``models/llama.py``). Shapes: ``B`` batch, ``Hq``/``Hkv`` heads, ``T`` new
    tokens, ``D`` head dim. The training form (``ParallelChunkedAttention``) and the KEEP prefill are seams too."""

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store new k/v for ``layer``, rotate q and keys with the cache's positions, attend.

        q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] (k without RoPE). Returns [B, Hq, T, D].
        New tokens attend causally among themselves and to everything the cache shows them.
        """
        ...

    def end_forward(self, *, pin: bool = False) -> None:
        """Called once after all layers ran a forward: commit the new tokens, compress/evict.

        ``pin=True`` pins everything held so far (the prompt): it is never compressed or evicted.
        """
        ...


@runtime_checkable
class EpisodeCache(Protocol):
    """What a session needs from the cache it owns for an episode."""

    def mark(self) -> int:
        """Open a mark: a token count to ``rollback`` to. Nothing held changes while it is open (compressing
        caches defer compression until ``rollback`` closes it), so the rollback is exact. Take a new mark
        before each attempt you will roll back (HybridVLA: ``m = cache.mark()`` in every denoising step)."""
        ...

    def rollback(self, mark: int) -> None:
        """Drop every token appended after ``mark`` and close the open mark. A mark older than the last
        compression raises ``ValueError``."""
        ...

    def stats(self) -> KVStats: ...

    def reset(self) -> None:
        """Forget the episode (tokens, gate state); weights are untouched."""
        ...


@dataclass(frozen=True)
class RowPlan:
    """One batch row's side of a layer's forward (``RowSeam.row_plan``): the row's keys in attention order sit
    at positions ``0 .. n_keys-1``, its ``T`` new tokens at the last ``T`` of them.

    Args:
        n_keys: keys the last new query sees (held + T) in this layer.
        cos, sin: [T, D] float32 RoPE tables of the new tokens' positions ``n_keys-T .. n_keys-1``.
        causal: the new tokens see each other causally (``False``: both ways, a ``bidirectional_block``).
    """

    n_keys: int
    cos: torch.Tensor
    sin: torch.Tensor
    causal: bool


@runtime_checkable
class RowSeam(Protocol):
    """What a batch-1 cache offers ``RowsCache`` so that a batched forward over several sessions' caches plans and
    rotates once for all rows: per layer the ``RowsCache`` calls ``row_plan``, rotates the new queries and keys of
    every row with the plans' tables and calls ``row_attend``; after the last layer ``row_commit`` with every
    layer's new tokens, then ``end_forward`` as usual."""

    row_batching: bool  # False: this cache attends on its own (e.g. a Triton kernel reads its store)

    def row_plan(self, layer: int, t: int) -> RowPlan:
        """Plan (at the forward's first layer) and describe ``layer``'s forward of ``t`` new tokens."""
        ...

    def row_attend(self, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of ``layer``'s new queries over the held keys and the new ones, everything rotated by the
        plan's tables: q_rot [1, Hq, T, D]; k_rot, v [1, Hkv, T, D]. Returns [1, Hq, T, D]."""
        ...

    def row_commit(self, k_raw: torch.Tensor, v: torch.Tensor) -> None:
        """Store the forward's new tokens of every layer: k_raw (pre-RoPE), v: [L, 1, Hkv, T, D]."""
        ...


@runtime_checkable
class KVCache(AttendSeam, EpisodeCache, Protocol):
    """A cache ``make_cache`` builds: the decoder's seam and the session's handle in one object."""


@dataclass(frozen=True)
class CacheParams:
    """Base of every cache's hyper-parameters (one subclass per cache, in the cache's file).

    Args:
        capacity: slots the cache holds, all regions together; ``None`` = the model's ``max_position``.
    """

    capacity: int | None = None

    def __post_init__(self) -> None:
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"`capacity` must be >= 1 or None, got {self.capacity}")

    def for_step(self: P, tokens: int, *, whole_context: bool) -> P:
        """Fill unset sizes from a policy's step of ``tokens`` tokens; ``whole_context``: the step is all the
        cache will hold (single mode), so it also bounds ``capacity``."""
        return replace(self, capacity=self.capacity or tokens) if whole_context else self

    def resolve(self: P, geometry: "CacheGeometry") -> P:
        """These params with every unset size decided for ``geometry`` (what the cache runs with)."""
        return replace(self, capacity=self.capacity or geometry.max_position)

    def gate_config(self, geometry: "CacheGeometry") -> "ChunkGateConfig | None":
        """The learnable ``ChunkGate`` this cache needs (its owner builds or loads it); ``None``: no gate."""
        return None


@dataclass(frozen=True)
class DecoupledParams(CacheParams):
    """Base of the caches with decoupled positions (pre-RoPE store, compacted positions, a raw window).

    Args:
        window: raw recent window W in tokens; ``None`` = one frame (the policy fills it in, ``for_step``).
        backend: attention implementation, one of ``KV_BACKENDS``; ``auto`` = Triton on CUDA, torch elsewhere.
    """

    window: int | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is not None and self.window < 1:
            raise ValueError(f"`window` must be >= 1 or None, got {self.window}")
        if self.backend not in KV_BACKENDS:
            raise ValueError(f"`backend` is {self.backend!r}; expected one of {', '.join(KV_BACKENDS)}")

    def for_step(self: P, tokens: int, *, whole_context: bool) -> P:
        """As ``CacheParams.for_step``; an unset ``window`` becomes the step's tokens."""
        return replace(super().for_step(tokens, whole_context=whole_context), window=self.window or tokens)

    def resolve(self: P, geometry: "CacheGeometry") -> P:
        """As ``CacheParams.resolve``; ``window`` must be set by now (``ValueError`` otherwise)."""
        if self.window is None:
            raise ValueError("the cache's `window` is None: set it (the policy fills in one frame of tokens)")
        return super().resolve(geometry)
