"""KV caches behind one protocol; ``make_cache`` turns a ``KVConfig`` into a cache.

A cache class is built as ``cls(kv_cfg, model_cfg, *, batch, device, dtype, **extra)`` (``FullCache``
takes its capacity only). Adding a cache = its file, a ``CACHES`` entry, a row in ``tests/kv/cases.py``
and a DESIGN.md line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import KVCache, KVStats, kv_bytes
from .chunked_gated import ChunkedGatedCache, ChunkedGatedConfig
from .config import KVConfig, matching_sink_window
from .full import FullCache
from .gate import ChunkGate, ChunkGateConfig, has_gate, load_gate, save_gate
from .sink_window import SinkWindowCache, SinkWindowConfig

if TYPE_CHECKING:
    from ..models.llama import LlamaConfig

CACHES: dict[str, type] = {"full": FullCache, "sink_window": SinkWindowCache, "chunked": ChunkedGatedCache}


def make_cache(
    kv_cfg: KVConfig,
    model_cfg: "LlamaConfig",
    *,
    batch: int = 1,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **extra,
) -> KVCache:
    """Build the cache ``kv_cfg.mode`` names. ``extra`` carries what a mode needs beyond sizes:
    ``gate=`` the policy's ``ChunkGate`` for ``chunked`` (absent or ``None`` = the untrained default,
    which mean-pools and keeps every chunk)."""
    if kv_cfg.mode not in CACHES:
        raise KeyError(f"unknown KV mode {kv_cfg.mode!r}; available: {', '.join(sorted(CACHES))}")
    cls = CACHES[kv_cfg.mode]
    if cls is FullCache:
        return FullCache(model_cfg, capacity=kv_cfg.capacity, batch=batch, device=device, dtype=dtype)
    return cls(kv_cfg, model_cfg, batch=batch, device=device, dtype=dtype, **extra)


__all__ = [
    "CACHES",
    "ChunkGate",
    "ChunkGateConfig",
    "ChunkedGatedCache",
    "ChunkedGatedConfig",
    "FullCache",
    "KVCache",
    "KVConfig",
    "KVStats",
    "SinkWindowCache",
    "SinkWindowConfig",
    "has_gate",
    "kv_bytes",
    "load_gate",
    "make_cache",
    "matching_sink_window",
    "save_gate",
]
