"""``ChunkedGatedParams``: the KV-Efficient cache's hyper-parameters, and the chunk schedule that the streaming
cache (``chunked_gated``) and its training form (``chunked_parallel``) share."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .base import DecoupledParams
from .gate import ChunkGateConfig
from .geometry import CacheGeometry

RAW_AREA_WINDOWS = 3  # max_chunks=None: raw area = 3 * (window + chunk) slots


@dataclass(frozen=True)
class ChunkedGatedParams(DecoupledParams):
    """Hyper-parameters of ``ChunkedGatedCache`` (and ``capacity``, ``window``, ``backend`` of ``DecoupledParams``:
    the store holds pinned + raw ring + ``max_chunks`` slots and compacted positions stay below ``capacity``).

    Args:
        chunk: tokens per chunk C.
        max_chunks: retained chunks per layer M (the budget; also the chunk slots of the store); 0 = none kept;
            ``None`` = every slot the raw area does not need (``resolve``).
        aggregator_hidden: hidden size of the per-layer 2-layer MLP aggregator (``ChunkGate``).
        gate_hidden: hidden size of the per-layer LSTM retention gate (``ChunkGate``).
        chunk_mass: add ``log(chunk)`` to every query's score of a chunk key (proportional attention, as token
            merging weighs a merged token by its size), so the one key/value pair of a chunk takes the attention its
            C tokens would if their keys were equal (``ln C + q.k_mean <= ln sum_c exp(q.k_c)``, by Jensen). Without
            it a retained chunk weighs 1/C of its tokens against the raw ones. A property of how a policy was
            trained to read its chunks: ``kv_config.json`` records it and ``saved_gate_geometry`` returns it.
    """

    chunk: int = 16
    max_chunks: int | None = None
    aggregator_hidden: int = 64
    gate_hidden: int = 32
    chunk_mass: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("chunk", "aggregator_hidden", "gate_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.max_chunks is not None and self.max_chunks < 0:
            raise ValueError(f"`max_chunks` must be >= 0 or None, got {self.max_chunks}")
        if self.capacity is None or self.window is None or not self.max_chunks:
            return
        raw = self.capacity - self.max_chunks
        if raw <= self.window + self.chunk:
            raise ValueError(
                f"`capacity` ({self.capacity}) - `max_chunks` ({self.max_chunks}) = {raw} raw slots must exceed "
                f"window + chunk ({self.window + self.chunk}) plus one forward's tokens"
            )

    def resolve(self, geometry: CacheGeometry) -> "ChunkedGatedParams":
        """``capacity=None`` -> the model's ``max_position``; ``max_chunks=None`` -> every slot the raw
        area does not need, leaving ``RAW_AREA_WINDOWS * (window + chunk)`` slots for the pinned prompt,
        the window, a filling chunk and a forward of up to about two windows."""
        p = super().resolve(geometry)
        if p.max_chunks is not None:
            return p
        # 0 when the window fills the store (no chunk can form before it is full)
        return replace(p, max_chunks=max(0, p.capacity - RAW_AREA_WINDOWS * (p.window + p.chunk)))

    @property
    def chunk_score_bias(self) -> float:
        """What ``chunk_mass`` adds to the score of a chunk key: ``log(chunk)``, or 0."""
        return math.log(self.chunk) if self.chunk_mass else 0.0

    def gate_config(self, geometry: CacheGeometry) -> ChunkGateConfig:
        """The ``ChunkGate`` geometry this cache needs (its owner, the policy, builds or loads it)."""
        return ChunkGateConfig(
            n_layers=geometry.n_layers,
            head_dim=geometry.head_dim,
            chunk=self.chunk,
            aggregator_hidden=self.aggregator_hidden,
            gate_hidden=self.gate_hidden,
        )


# ---- shared with the parallel form ---------------------------------------------------------------
def chunk_schedule(n_raw: int, *, window: int, chunk: int) -> int:
    """How many chunks form when ``n_raw`` raw tokens are held after a forward."""
    return max(0, (n_raw - window) // chunk)
