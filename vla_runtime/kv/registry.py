"""The one registry of caches (name -> class), the ``KVMode`` enum built from it, and ``make_cache``.

The registry names are the YAML/CLI spelling (``--kv chunked``); past that edge the code passes
``KVMode`` members. A cache class says everything else about itself: its hyper-parameters
(``params_class``) and the constructor ``SlotCache`` fixes, so ``make_cache`` has no special case.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from .base import CacheParams, KVCache
from .chunked_gated import ChunkedGatedCache
from .full import FullCache
from .geometry import CacheGeometry
from .sink_window import SinkWindowCache
from .slot_cache import SlotCache

if TYPE_CHECKING:
    from .config import KVConfig

CACHES: dict[str, type[SlotCache]] = {
    "full": FullCache,
    "sink_window": SinkWindowCache,
    "chunked": ChunkedGatedCache,
}


class _RegisteredMode(enum.Enum):
    """Behaviour of ``KVMode`` (its members come from ``CACHES``)."""

    @classmethod
    def parse(cls, value: "str | _RegisteredMode") -> "KVMode":
        """A member from its YAML/CLI name; ``ValueError`` listing the registered names otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError as e:
            raise ValueError(f"`mode` is {value!r}; expected one of {', '.join(CACHES)}") from e

    @property
    def cache_class(self) -> type[SlotCache]:
        return CACHES[self.value]

    @property
    def params_class(self) -> type[CacheParams]:
        return CACHES[self.value].params_class


KVMode = _RegisteredMode("KVMode", [(name.upper(), name) for name in CACHES], module=__name__, qualname="KVMode")
KVMode.__doc__ = "The registered caches as an enum: ``KVMode.CHUNKED.value == 'chunked'`` (the YAML/CLI name)."


def make_cache(
    kv_cfg: "KVConfig",
    geometry: CacheGeometry,
    *,
    batch: int = 1,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **extra,
) -> KVCache:
    """Build the cache ``kv_cfg.mode`` names with ``kv_cfg.params``. ``extra`` carries what a cache needs
    beyond its params, e.g. ``gate=`` the policy's ``ChunkGate`` when ``kv_cfg.gate_config`` is not ``None``."""
    if not isinstance(kv_cfg.mode, KVMode):
        raise KeyError(f"unknown KV mode {kv_cfg.mode!r}; available: {', '.join(sorted(CACHES))}")
    return kv_cfg.mode.cache_class(geometry, kv_cfg.params, batch=batch, device=device, dtype=dtype, **extra)
