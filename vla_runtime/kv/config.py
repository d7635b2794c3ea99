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


def matching_sink_window(chunked: KVConfig) -> KVConfig:
    """The ``sink_window`` config that holds as many KV bytes as ``chunked`` at its full chunk budget.

    After every forward a chunked cache holds, per layer, the pinned prompt P, at most ``max_chunks`` chunk
    representatives M, the raw window W and fewer than C raw tokens waiting to form the next chunk: at most
    P + M + W + C - 1 tokens. A sink-window cache holds P + ``n_sink`` + W'. Equal bytes: W' = M + W + C - 1 - n_sink
    (same model, dtype and prompt; both caches hold one forward's new tokens on top while it runs).

    ``chunked`` needs ``mode="chunked"`` and explicit ``window`` and ``max_chunks``.
    """
    if chunked.mode != "chunked":
        raise ValueError(f"matching_sink_window takes a chunked KVConfig, got mode {chunked.mode!r}")
    if chunked.window is None or chunked.max_chunks is None:
        raise ValueError(
            f"matching_sink_window needs the chunked cache's `window` and `max_chunks` (got {chunked.window}, "
            f"{chunked.max_chunks}): the bytes it holds depend on both"
        )
    window = chunked.max_chunks + chunked.window + chunked.chunk - 1 - chunked.n_sink
    if window < 1:
        raise ValueError(f"a chunked cache this small ({chunked}) holds fewer tokens than the sink-window cache's sinks")
    return KVConfig(mode="sink_window", capacity=chunked.capacity, window=window, n_sink=chunked.n_sink, backend=chunked.backend)
