"""KV caches behind the attend seam; ``make_cache`` turns a ``KVConfig`` into a cache.

Recipe: adding a cache is one file, one registry line and one test row.

1. ``vla_runtime/kv/<name>.py``: a ``@dataclass(frozen=True)`` params class deriving from ``CacheParams``
   (``DecoupledParams`` for a pre-RoPE store with a raw window) that validates its fields in
   ``__post_init__``, and the cache, a ``SlotCache`` subclass with ``params_class`` set, the constructor
   ``(geometry, params=None, *, batch, device, dtype)``, ``attend``, ``end_forward``, ``held_slots`` and
   ``stats`` (``mark``/``rollback``/``reset``/bytes come from ``SlotCache``). Optionally the ``RowSeam``
   (``row_batching``, ``row_plan``, ``row_attend``, ``row_commit``; ``base.py``): then a ``RowsCache`` over
   several sessions' caches plans and rotates once for all rows instead of row by row.
2. One line in ``registry.CACHES``: ``"<name>": <Cache>``. ``KVMode``, ``KVConfig``'s YAML/CLI keys,
   ``make_cache`` and the CLI ``--kv`` choices follow from it.
3. One row in ``tests/kv/cases.py`` (``CASES``): the contract tests in ``tests/kv/test_contract.py`` run
   every registered cache against ``FullCache`` and the protocol's promises, and fail on a cache without a row.
"""

from __future__ import annotations

from .base import AttendSeam, CacheParams, DecoupledParams, EpisodeCache, KVCache, KVStats
from .chunked_gated import ChunkedGatedCache
from .chunked_params import ChunkedGatedParams
from .config import KVConfig, matching_sink_window
from .full import CacheFullError, FullCache, FullParams
from .gate import ChunkGate, ChunkGateConfig
from .gate_io import has_gate, load_gate, save_gate, saved_gate_geometry
from .geometry import CacheGeometry
from .registry import CACHES, KVMode, make_cache
from .sink_window import SinkWindowCache, SinkWindowParams

__all__ = [
    "CACHES",
    "CacheFullError",
    "AttendSeam",
    "CacheGeometry",
    "CacheParams",
    "ChunkGate",
    "ChunkGateConfig",
    "ChunkedGatedCache",
    "ChunkedGatedParams",
    "DecoupledParams",
    "EpisodeCache",
    "FullCache",
    "FullParams",
    "KVCache",
    "KVConfig",
    "KVMode",
    "KVStats",
    "SinkWindowCache",
    "SinkWindowParams",
    "has_gate",
    "load_gate",
    "make_cache",
    "matching_sink_window",
    "save_gate",
    "saved_gate_geometry",
]
