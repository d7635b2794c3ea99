"""SinkWindowCache: the StreamingLLM baseline (Xiao et al. 2023) with decoupled positions.

Holds the pinned prompt, the next ``n_sink`` tokens (attention sinks) and the most recent ``window``
tokens; everything between is dropped at ``end_forward``. Keys are stored pre-RoPE and rotated at
their compacted positions (sinks, then the window, in order: StreamingLLM's "positions within the
cache"), so an episode of any length stays inside the model's position range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import select_backend
from .base import DecoupledParams, KVStats, RowPlan
from .geometry import CacheGeometry
from .slot_cache import SlotCache
from .store import RotatedView, SlotStore, attend_slots, row_plan_of


@dataclass(frozen=True)
class SinkWindowParams(DecoupledParams):
    """Hyper-parameters of ``SinkWindowCache`` (and ``capacity``, ``window``, ``backend`` of ``DecoupledParams``;
    the store's slots must fit pinned + sinks + window + one forward's tokens).

    Args:
        n_sink: tokens after the pinned prompt kept as attention sinks.
    """

    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_sink < 0:
            raise ValueError(f"`n_sink` must be >= 0, got {self.n_sink}")
        if self.capacity is not None and self.window is not None and self.capacity <= self.window + self.n_sink:
            raise ValueError(f"`capacity` ({self.capacity}) must exceed window + n_sink ({self.window + self.n_sink})")


class SinkWindowCache(SlotCache):
    """Pinned prompt + ``n_sink`` sinks + recent ``window`` tokens; see the module docstring."""

    params_class = SinkWindowParams

    def __init__(
        self,
        geometry: CacheGeometry,
        params: SinkWindowParams | None = None,
        *,
        batch: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        grow: bool = False,
    ) -> None:
        """``grow``: the store is allocated as the episode needs it (``SlotStore``)."""
        super().__init__(geometry, params)
        p = self.params
        self.store = SlotStore(geometry, slots=p.capacity, chunk_slots=0, batch=batch, device=device, dtype=dtype, grow=grow)
        self.backend = select_backend(p.backend, geometry, device=device, dtype=dtype)
        self.view = RotatedView(self.store) if self.backend.kernel is None else None
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._plan = None
        self._slots: torch.Tensor | slice | None = None
        self._n_keys = 0
        self._sinks = 0
        self._row_plan: RowPlan | None = None  # this forward's (``row_plan``)

    def _begin_forward(self, t: int) -> None:
        """First layer of a forward of ``t`` tokens: slots and positions once for all layers."""
        s = self.store
        s.room_for(t)
        contiguous = s.contiguous_prefix(t)
        self._plan = s.plan(t)
        self._row_plan = None  # made by ``row_plan`` if a RowsCache asks
        self._n_keys = s.n_pinned + s.n_raw + t
        if contiguous:
            self._slots = slice(0, self._n_keys)
        else:
            self._slots = torch.cat((torch.arange(s.n_pinned, device=s.device), self._plan.raw))

    def plan_forward(self, t: int) -> None:
        if self._plan is None:
            self._begin_forward(t)
            if self.view is not None:
                n = self.geometry.n_layers
                self.view.sync_layers(self.store, [self._slots] * n, [self._n_keys] * n, t)

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] (k pre-RoPE) -> [B, Hq, T, D]."""
        s = self.store
        if self._plan is None:
            self._begin_forward(q.shape[2])
        s.write(layer, self._plan, k_raw, v)
        return attend_slots(s, self.backend, self.view, layer, q, k_raw, v, self._slots, self._n_keys, causal=not self.bidirectional)

    # ---- RowSeam: a forward over several sessions' caches rotates once for all rows (``RowsCache``) -----
    @property
    def row_batching(self) -> bool:
        return self.view is not None  # the Triton kernel reads the store itself: no rotated view to hand over

    def row_plan(self, layer: int, t: int) -> RowPlan:
        """One object for every layer of a forward."""
        if self._plan is None:
            self._begin_forward(t)
        if self._row_plan is None:  # this forward's (``_begin_forward`` forgets the last one's)
            self._row_plan = row_plan_of(self.store, self._n_keys, t, causal=not self.bidirectional)
        return self._row_plan

    def row_attend(self, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.view.attend_rotated(self.store, layer, q_rot, k_rot, v, self._slots, self._n_keys,
                                        causal=not self.bidirectional)  # fmt: skip

    def row_commit(self, k_raw: torch.Tensor, v: torch.Tensor) -> None:
        self.store.write_layers(self._plan, k_raw, v)

    def end_forward(self, *, pin: bool = False) -> None:
        if self._plan is None:
            return
        s = self.store
        may_trim = self._commit(self._plan.new, self._n_keys)
        if self.view is not None:
            self.view.commit(s, [self._n_keys] * self.geometry.n_layers)
        self._plan = self._slots = None
        if pin:
            s.pin()
        elif may_trim:
            take = min(self.params.n_sink - self._sinks, s.n_raw)
            if take > 0:
                s.pin(s.n_pinned + take)
                self._sinks += take
            if s.n_raw > self.params.window:
                s.drop_raw(s.n_raw - self.params.window)

    def held_slots(self) -> int:
        return (self.store.n_pinned + self.store.n_raw) * self.geometry.n_layers

    def stats(self) -> KVStats:
        s = self.store
        return KVStats(
            tokens_raw=s.n_pinned + s.n_raw, bytes=self.held_bytes(), positions_used=self._positions_used, tokens_seen=s.length
        )
