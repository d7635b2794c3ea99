"""Which attention implementation a decoupled cache uses: chosen once, at construction.

The choice is ``vla_kernels.attention_backend`` (the ``backend`` parameter: ``auto`` = Triton on CUDA when the
kernels support the device/dtype/head dim, also overridable with ``$VLA_KV_BACKEND``; ``torch``;
``triton`` = an error listing the reasons where it cannot run). Triton means the cache hands its
pre-RoPE store, slot list and positions to ``vla_kernels.chunked_attention`` (contract 4). Torch means
the cache's own torch path (``store.RotatedView``): the same contract specialised to how the caches lay
keys out (positions 0..N-1 in attention order), keeping rotated copies between layout changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from vla_kernels import attention_backend

from .geometry import CacheGeometry


@dataclass(frozen=True)
class CacheBackend:
    """The attention a cache runs (``vla_kernels.AttentionBackend`` resolved for it): ``kernel`` is contract 4's
    ``chunked_attention`` (Triton), or ``None`` for the cache's own torch path."""

    name: str
    kernel: Callable[..., torch.Tensor] | None = None


def select_backend(name: str, geometry: CacheGeometry, *, device: torch.device | str, dtype: torch.dtype) -> CacheBackend:
    """Resolve a cache's ``backend`` parameter for this model geometry, device and dtype."""
    chosen = attention_backend(name, device, dtype=dtype, head_dim=geometry.head_dim)
    return CacheBackend(chosen.name, chosen if chosen.name == "triton" else None)
