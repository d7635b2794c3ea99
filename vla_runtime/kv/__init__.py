"""KV caches behind one protocol; ``make_cache`` turns a ``KVConfig`` into a cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import KVCache, KVStats, kv_bytes
from .config import KVConfig
from .full import FullCache

if TYPE_CHECKING:
    from ..models.llama import LlamaConfig

CACHES: dict[str, type] = {"full": FullCache}


def make_cache(
    kv_cfg: KVConfig,
    model_cfg: "LlamaConfig",
    *,
    batch: int = 1,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **extra,
) -> KVCache:
    """Build the cache ``kv_cfg.mode`` names. ``extra`` carries what a mode needs beyond sizes (the chunk gate)."""
    if kv_cfg.mode not in CACHES:
        raise KeyError(f"unknown KV mode {kv_cfg.mode!r}; available: {', '.join(sorted(CACHES))}")
    cls = CACHES[kv_cfg.mode]
    if cls is FullCache:
        return FullCache(model_cfg, capacity=kv_cfg.capacity, batch=batch, device=device, dtype=dtype)
    return cls(kv_cfg, model_cfg, batch=batch, device=device, dtype=dtype, **extra)


__all__ = ["CACHES", "FullCache", "KVCache", "KVConfig", "KVStats", "kv_bytes", "make_cache"]
