"""User-facing cache selection: one dataclass, validated, loadable from YAML."""

from __future__ import annotations

from dataclasses import dataclass

KV_MODES = ("full", "sink_window", "chunked")
KV_BACKENDS = ("auto", "torch", "triton")


@dataclass
class KVConfig:
    """Which cache a session uses and its sizes.

    Args:
        mode: ``full`` (stock), ``sink_window`` (StreamingLLM) or ``chunked`` (KV-Efficient).
        capacity: slots a cache holds, all regions together (``full``: tokens; decoupled caches: pinned +
            raw + chunks, and their compacted positions stay below it); ``None`` = the model's ``max_position``.
        window: raw recent window W in tokens (``sink_window`` and ``chunked``); ``None`` = one frame
            (the policy fills it in from its tokens per step).
        n_sink: extra sink tokens kept besides the pinned prompt (``sink_window``).
        chunk: chunk size C (``chunked``).
        max_chunks: retained-chunk budget M per layer; ``None`` = the gate alone decides, bounded only by
            ``capacity`` (the chunk slots left beside a raw area of 3 x (window + chunk) slots).
        aggregator_hidden: hidden size of the per-layer 2-layer MLP aggregator.
        gate_hidden: hidden size of the per-layer LSTM retention gate.
        backend: attention implementation; ``auto`` = Triton on CUDA, torch elsewhere.
    """

    mode: str = "full"
    capacity: int | None = None
    window: int | None = None
    n_sink: int = 4
    chunk: int = 16
    max_chunks: int | None = None
    aggregator_hidden: int = 64
    gate_hidden: int = 32
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in KV_MODES:
            raise ValueError(f"`mode` is {self.mode!r}; expected one of {', '.join(KV_MODES)}")
        if self.backend not in KV_BACKENDS:
            raise ValueError(f"`backend` is {self.backend!r}; expected one of {', '.join(KV_BACKENDS)}")
        for name in ("capacity", "window", "max_chunks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"`{name}` must be >= 1 or None, got {value}")
        for name in ("chunk", "aggregator_hidden", "gate_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.n_sink < 0:
            raise ValueError(f"`n_sink` must be >= 0, got {self.n_sink}")
