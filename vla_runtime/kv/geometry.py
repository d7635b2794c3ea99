"""What a cache needs to know about the decoder it serves: a handful of numbers, built by the models.

``kv`` never imports ``vla_runtime.models`` (DESIGN §1): a model config hands its caches a
``CacheGeometry`` (``LlamaConfig.geometry``) and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rope import RopeConfig


@dataclass(frozen=True)
class CacheGeometry:
    """Shapes and positions of the K/V a decoder produces.

    Args:
        n_layers: decoder layers L (one K/V store each).
        n_kv_heads: key/value heads Hkv per layer.
        head_dim: per-head size D.
        max_position: positions the model was trained for; a cache's default capacity.
        rope: the RoPE frequency schedule the cache rotates keys and queries with.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_position: int
    rope: RopeConfig

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if self.rope.head_dim != self.head_dim:
            raise ValueError(f"`rope.head_dim` ({self.rope.head_dim}) must equal `head_dim` ({self.head_dim})")
